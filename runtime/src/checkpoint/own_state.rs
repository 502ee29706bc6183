//! A saved rank's own small state, read back for a load: its data loaders' positions (checked
//! against the files they count in, moved to the new number of processes when that changed),
//! its random stream, the window's micro-step, the attribute's loop position, the fp16 loss
//! scaler, the window's partial sums and the registered objects' states. Each piece is checked
//! against what this run expects; a piece that does not fit is refused as unfit.

use crate::checkpoint::checks::check_scaler;
use crate::checkpoint::format::unfit;
use crate::checkpoint::names::{self, Kind};
use crate::checkpoint::plan::state_of;
use crate::checkpoint::RankState;
use crate::data::{same_files, DataFile, LoaderPosition, LoopPosition};
use crate::error::Result;
use crate::precision::scaler::LossScaler;
use crate::rng::RngState;
use crate::stateful::StateDict;
use candle_core::Tensor;
use serde_json::Value;
use std::path::Path;

/// What this run expects of a saved rank's own state.
pub(crate) struct Expected<'a> {
    /// The files each live data loader counts in, one list per loader.
    pub loader_files: &'a [Vec<DataFile>],
    /// How many objects are registered for checkpointing.
    pub registered: usize,
    /// Whether this run scales its loss (fp16), so needs a scaler.
    pub scales_loss: bool,
    /// How many processes saved the checkpoint.
    pub saved_world: usize,
    /// Whether this run has another number of processes.
    pub moved: bool,
}

/// A saved rank's own state, parsed and checked.
pub(crate) struct OwnState {
    /// Each loader's position (moved to the new world when it changed).
    pub loaders: Vec<LoaderPosition>,
    /// The saved random stream.
    pub rng: RngState,
    /// Where the window's automatic micro-step counter stood.
    pub auto_micro_step: u64,
    /// The attribute's loop position, if the run was inside one.
    pub macro_loop: Option<LoopPosition>,
    /// The fp16 loss scaler, if the run scaled its loss.
    pub scaler: Option<LossScaler>,
    /// The window's partial sums, `{model}::{variable}`, saved mid-window.
    pub sums: Vec<(String, Tensor)>,
    /// The registered objects' states, in registration order.
    pub custom: Vec<StateDict>,
}

/// Reads saved rank `own`'s small state out of `mine` (read from checkpoint `dir`), checking
/// each piece against `expected`.
pub(crate) fn read_own(
    dir: &Path,
    own: usize,
    mine: &RankState,
    expected: &Expected,
) -> Result<OwnState> {
    let file = |name: &str| dir.join(format!("rank{own}/{name}.json"));
    let parse = |name: &str, what: &str| -> Result<Value> {
        mine.get(name)
            .map(|c| c.json.clone())
            .ok_or_else(|| unfit(&file(name), format!("is missing: it should hold {what}")))
    };
    let typed = |name: &str, what: &str, err: serde_json::Error| {
        unfit(&file(name), format!("is not {what} ({err})"))
    };
    let mut loaders = Vec::new();
    for (i, files) in expected.loader_files.iter().enumerate() {
        let name = Kind::Loader.name(i);
        let what = "a data loader position (epoch, seed, consumed)";
        let json = parse(&name, what)?;
        let pos: LoaderPosition =
            serde_json::from_value(json.clone()).map_err(|e| typed(&name, what, e))?;
        // Checkpoints from before data files were fingerprinted have none to compare.
        if let Some(saved) = json.get("files") {
            let what = "a list of data file fingerprints";
            let saved: Vec<DataFile> =
                serde_json::from_value(saved.clone()).map_err(|e| typed(&name, what, e))?;
            same_files(&saved, files).map_err(|msg| {
                let msg = format!("data loader {i}: {msg}");
                unfit(dir, msg)
            })?;
        }
        loaders.push(if expected.moved {
            pos.for_new_world()?
        } else {
            pos
        });
    }
    let what = "an RNG state (a 32-byte seed and a word position)";
    let rng: RngState =
        serde_json::from_value(parse(names::RNG, what)?).map_err(|e| typed(names::RNG, what, e))?;
    let training = mine
        .get(names::TRAINING)
        .ok_or_else(|| unfit(&file(names::TRAINING), "is missing"))?;
    let auto_micro_step = training.json["auto_micro_step"].as_u64().ok_or_else(|| {
        unfit(
            &file(names::TRAINING),
            "has no `auto_micro_step` (a non-negative integer)",
        )
    })?;
    let what = "a loss scaler (scale, growth_factor, backoff_factor, growth_interval, good_steps, skipped_steps) or null";
    let scaler: Option<LossScaler> =
        serde_json::from_value(training.json.get("scaler").cloned().unwrap_or(Value::Null))
            .map_err(|e| {
                unfit(
                    &file(names::TRAINING),
                    format!("`scaler` is not {what} ({e})"),
                )
            })?;
    check_scaler(
        &file(names::TRAINING),
        scaler.as_ref(),
        expected.scales_loss,
    )?;
    // Absent from checkpoints written before the attribute's loops were resumable.
    let what = "a loop position (pass, next)";
    let macro_loop: Option<LoopPosition> = match training.json.get("macro_loop") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let p: LoopPosition = serde_json::from_value(v.clone()).map_err(|e| {
                unfit(
                    &file(names::TRAINING),
                    format!("`macro_loop` is not {what} ({e})"),
                )
            })?;
            Some(if expected.moved {
                p.for_new_world()?
            } else {
                p
            })
        }
    };
    let sums_file = dir.join(format!("rank{own}/training.safetensors"));
    if expected.moved && !training.tensors.is_empty() {
        return Err(unfit(
            &sums_file,
            format!(
                "holds the partial gradient sums of an accumulation window saved mid-way; \
                     they belong to the {} processes that saved them, so this checkpoint resumes \
                     only on {} processes (`ivme launch --num_processes {}`); to move to another \
                     number, save at the end of a window",
                expected.saved_world, expected.saved_world, expected.saved_world
            ),
        ));
    }
    let mut custom = Vec::new();
    for i in 0..expected.registered {
        let name = Kind::Custom.name(i);
        custom.push(state_of(mine, &name).ok_or_else(|| unfit(&file(&name), "is missing"))?);
    }
    Ok(OwnState {
        loaders,
        rng,
        auto_micro_step,
        macro_loop,
        scaler,
        sums: training.tensors.clone(),
        custom,
    })
}
