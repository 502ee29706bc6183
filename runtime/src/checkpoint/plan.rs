//! What a load has found and will apply: the [`Plan`] a checkpoint is checked into before
//! anything changes, the models' and optimizers' state [`Assembled`] in this run's layout, and
//! the outcome of the search for the [`Newest`] sound checkpoint. The protocol that fills them
//! is the facade's (`accelerator/restore.rs`, `reshard.rs`, `newest.rs`).

use crate::checkpoint::direct::DirectFile;
use crate::checkpoint::store::RankState;
use crate::data::LoaderPosition;
use crate::data::LoopPosition;
use crate::error::{CheckpointErrorKind, Error, Result};
use crate::precision::scaler::LossScaler;
use crate::rng::RngState;
use crate::stateful::{StateDict, Stateful};
use candle_core::Tensor;
use std::path::{Path, PathBuf};

/// Everything a load will apply, already read, parsed and checked.
pub(crate) struct Plan {
    pub(crate) dir: PathBuf,
    /// Per model: its saved weights in this run's layout, already checked against the live
    /// variables.
    pub(crate) models: Vec<ModelLoad>,
    pub(crate) optimizers: Vec<StateDict>,
    pub(crate) loaders: Vec<LoaderPosition>,
    /// `None` for a rank the saving run did not have: it keeps its own stream.
    pub(crate) rng: Option<RngState>,
    pub(crate) auto_micro_step: u64,
    /// Where the attribute's loops over plain collections stood.
    pub(crate) macro_loop: Option<LoopPosition>,
    pub(crate) scaler: Option<LossScaler>,
    /// Per model, per variable: the partial gradient sum of a window saved mid-way.
    pub(crate) sums: Vec<Vec<Option<Tensor>>>,
    pub(crate) custom: Vec<StateDict>,
    /// The saving run's number of processes, when it differs from this run's.
    pub(crate) moved_from: Option<usize>,
}

/// How a model's checked weights reach its variables.
pub(crate) enum ModelLoad {
    /// Read into memory at the check, in this run's layout (see [`Assembled`]).
    Staged(Vec<Tensor>),
    /// A file holding exactly the model's variables: checked without keeping its bytes, read
    /// straight into the variables when the plan is applied.
    Direct(DirectFile),
}

/// What the facade's `classify_checkpoint` found.
pub(crate) enum Checked {
    /// Everything read, checked and ready to apply.
    Ready(Box<Plan>),
    /// A file does not match the manifest (size, checksum, format): the checkpoint is damaged.
    Damaged(Error),
}

/// The one place that decides what a refused load is, from the error's own kind: a
/// checkpoint found damaged or missing (a file that does not match its manifest, or cannot be
/// read) is [`Checked::Damaged`], which an older checkpoint may stand in for
/// (`load_state_if_any` moves on to it); anything else (a sound checkpoint that does not fit
/// this run, or another failure) is an error. Both say nothing was loaded.
pub(crate) fn classify(dir: &Path, planned: Result<Plan>) -> Result<Checked> {
    let e = match planned {
        Ok(plan) => return Ok(Checked::Ready(Box::new(plan))),
        Err(e) => e,
    };
    match e {
        Error::Checkpoint { path, msg, kind } => {
            let e = Error::Checkpoint {
                path,
                msg: format!("{msg} (nothing was loaded)"),
                kind,
            };
            match kind {
                CheckpointErrorKind::Damaged | CheckpointErrorKind::Missing => {
                    Ok(Checked::Damaged(e))
                }
                _ => Err(e),
            }
        }
        // A file the manifest lists that cannot be read makes the checkpoint damaged.
        Error::Io { context, source } => Ok(Checked::Damaged(Error::checkpoint(
            dir,
            CheckpointErrorKind::Damaged,
            format!("{context}: {source} (nothing was loaded)"),
        ))),
        other => Err(other),
    }
}

pub(crate) fn state_of(s: &RankState, name: &str) -> Option<StateDict> {
    s.get(name).map(|c| StateDict {
        tensors: c.tensors.clone(),
        json: c.json.clone(),
    })
}

/// A copy that shares no storage with the live object, to undo a load with.
pub(crate) fn deep_copy(s: StateDict) -> Result<StateDict> {
    let tensors = s
        .tensors
        .into_iter()
        .map(|(n, t)| Ok((n, t.copy()?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(StateDict {
        tensors,
        json: s.json,
    })
}

/// An object a load puts state into, named for errors; `deep_copy` when the state it hands
/// out may share storage with it (so an undo needs a copy).
pub(crate) struct Target<'a> {
    pub object: &'a mut dyn Stateful,
    pub what: String,
    pub deep_copy: bool,
}

/// Loads `states[k]` into `targets[k]`, in order, all or nothing: when one refuses its state
/// (an unfit checkpoint, said naming it and `dir`), those already loaded get back the state
/// they had, taken just before each load.
pub(crate) fn load_all_or_none(
    dir: &Path,
    targets: &mut [Target],
    states: &[&StateDict],
) -> Result<()> {
    let last = targets.len().min(states.len()).saturating_sub(1);
    let mut undo: Vec<(usize, StateDict)> = Vec::new();
    let mut result = Ok(());
    for (k, (t, state)) in targets.iter_mut().zip(states).enumerate() {
        let before = match k < last {
            true => match t.object.state_dict() {
                Ok(b) if t.deep_copy => deep_copy(b).map(Some),
                Ok(b) => Ok(Some(b)),
                Err(e) => Err(e),
            },
            false => Ok(None),
        };
        let before = match before {
            Ok(b) => b,
            Err(e) => {
                result = Err(e);
                break;
            }
        };
        if let Err(e) = t.object.load_state_dict(state) {
            let msg = format!("was refused by {}: {e} (nothing was loaded)", t.what);
            result = Err(crate::checkpoint::format::unfit(dir, msg));
            break;
        }
        undo.extend(before.map(|b| (k, b)));
    }
    if result.is_err() {
        for (k, s) in undo.iter().rev() {
            let _ = targets[*k].object.load_state_dict(s);
        }
    }
    result
}

/// Counts of each kind of component, for comparing a checkpoint with the prepared objects.
#[derive(Debug, PartialEq, Eq, Default)]
pub(crate) struct Counts {
    pub(crate) models: usize,
    pub(crate) optimizers: usize,
    pub(crate) loaders: usize,
    pub(crate) registered: usize,
}

impl Counts {
    pub(crate) fn describe(&self) -> String {
        format!(
            "{} model(s), {} optimizer(s), {} data loader(s) and {} registered object(s)",
            self.models, self.optimizers, self.loaders, self.registered
        )
    }
}

/// What the newest sound checkpoint search found.
pub(crate) enum Newest {
    /// This checkpoint was loaded.
    Loaded(PathBuf),
    /// The folder holds no checkpoint.
    Empty,
    /// There are checkpoints, but every one is damaged: how many, and the newest one's problem
    /// (known on the main process; the others get a pointer to its message).
    NoneSound(usize, String),
}

/// How a rank's check of a checkpoint ended, as ranks exchange it.
pub(crate) const READY: u8 = 0;
pub(crate) const DAMAGED: u8 = 1;
pub(crate) const FAILED: u8 = 2;

/// Warns that `dir` is skipped for `e`, remembering the newest problem.
pub(crate) fn skip(dir: &Path, e: &Error, newest: &mut Option<String>) {
    warn_user!(
        "warning: skipping damaged checkpoint {}: {e}",
        dir.display()
    );
    newest.get_or_insert_with(|| e.to_string());
}

/// What the models and optimizers get from a checkpoint, in this run's layout.
pub(crate) struct Assembled {
    /// Per model: one tensor per variable (unsharded, in name order) or per piece of this
    /// process's slice (sharded, in flat order).
    pub models: Vec<Vec<Tensor>>,
    /// Per optimizer: its state, named as its prepared slot names its variables.
    pub optimizers: Vec<StateDict>,
}
