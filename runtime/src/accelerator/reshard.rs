//! Loading model weights and optimizer state saved in any layout (any number of processes,
//! sharded or not) into this run's layout, and carrying each rank's own state (data positions,
//! random streams) over to a run on another number of processes.
//!
//! The model and optimizer state carry over exactly: every element is copied from the saved
//! run that holds it. A rank's own state cannot always: ranks that exist in both runs continue
//! their saved random streams, new ranks keep the streams they started with, and data positions
//! move by samples (the samples of the epoch all ranks had used are skipped; the rest of the
//! epoch is split among the new ranks).

use crate::accelerator::Accelerator;
use crate::checkpoint::direct::DirectFile;
use crate::checkpoint::format::unfit;
use crate::checkpoint::layout::Layout;
use crate::checkpoint::layout::Runs;
use crate::checkpoint::names::Kind;
use crate::checkpoint::plan::Assembled;
use crate::checkpoint::read;
use crate::checkpoint::store::{Listing, Manifest};
use crate::checkpoint::RankState;
use crate::error::Result;
use crate::stateful::StateDict;
use candle_core::Tensor;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::path::PathBuf;

impl Accelerator {
    /// Elements `from..to` of model `i`'s flat parameter space that this process loads: its
    /// slice under sharding, everything otherwise.
    fn wanted_range(&self, i: usize) -> (usize, usize) {
        self.training.models()[i].wanted_range(self.process_index())
    }

    /// The saved ranks whose folders hold model or optimizer state this process loads.
    pub(crate) fn source_ranks(&self, layout: &Layout) -> BTreeSet<usize> {
        if !layout.is_sharded() {
            return BTreeSet::from([0]);
        }
        (0..self.training.models().len())
            .flat_map(|i| {
                let (a, b) = self.wanted_range(i);
                layout.ranks_holding(i, a, b)
            })
            .collect()
    }

    /// Puts the model and optimizer state of the saved ranks `states` (each read with at least
    /// its `model_*` and `optimizer_*` components) into this run's layout, checking every name,
    /// shape and dtype against the prepared objects. The tensors are moved out of `states`.
    ///
    /// Models with a `direct` file are skipped (their entry is empty): their weights are read
    /// straight into the variables when the load is applied.
    pub(crate) fn assemble(
        &self,
        dir: &Path,
        layout: &Layout,
        states: &mut [&mut RankState],
        direct: &[Option<DirectFile>],
    ) -> Result<Assembled> {
        let files = |kind: &str| -> PathBuf {
            let rank = if layout.is_sharded() {
                "rank*"
            } else {
                "rank0"
            };
            dir.join(format!("{rank}/{kind}.safetensors"))
        };
        let mut models = Vec::with_capacity(self.training.models().len());
        for (i, model) in self.training.models().iter().enumerate() {
            if direct.get(i).is_some_and(Option::is_some) {
                models.push(Vec::new());
                continue;
            }
            let name = Kind::Model.name(i);
            let (runs, json) = take_runs(states, &name, &files(&name))?;
            let shapes = json.map_or(Value::Null, |j| j["shapes"].clone());
            model.check_shapes(&files(&name), &shapes)?;
            models.push(model.assemble(&files(&name), i, runs, layout)?);
        }
        let mut optimizers = Vec::with_capacity(self.training.optimizers().len());
        for j in 0..self.training.optimizers().len() {
            let name = Kind::Optimizer.name(j);
            let (runs, json) = take_runs(states, &name, &files(&name))?;
            let json = json.ok_or_else(|| unfit(dir, format!("has no `{name}`")))?;
            optimizers.push(self.assemble_optimizer(&files(&name), runs, json)?);
        }
        Ok(Assembled { models, optimizers })
    }

    /// For each model, the name of its component when its weights may be read straight into
    /// its variables: saved whole (rank 0's file holds every variable) and loaded whole.
    pub(crate) fn direct_candidates(&self, layout: &Layout) -> Vec<Option<String>> {
        self.training
            .models()
            .iter()
            .enumerate()
            .map(|(i, m)| (!layout.is_sharded() && !m.is_sharded()).then(|| Kind::Model.name(i)))
            .collect()
    }

    /// The files of the `candidates` whose `listed` tensors are exactly the model's variables.
    /// A candidate that does not fit is read into memory now, into its component of the saved
    /// rank 0 in `states`, so that assembling it gives the usual refusal.
    pub(crate) fn fit_direct(
        &self,
        dir: &Path,
        manifest: &Manifest,
        candidates: &[Option<String>],
        listed: &BTreeMap<String, Listing>,
        states: &mut [&mut RankState],
    ) -> Result<Vec<Option<DirectFile>>> {
        let mut out = Vec::with_capacity(candidates.len());
        for (m, name) in self.training.models().iter().zip(candidates) {
            let Some(name) = name else {
                out.push(None);
                continue;
            };
            let rel = format!("rank0/{name}.safetensors");
            let Some(entry) = manifest.files.iter().find(|e| e.path == rel) else {
                // No such file: assembling the model says what is missing.
                out.push(None);
                continue;
            };
            let path = dir.join(&rel);
            let expect = (entry.size, entry.crc32);
            if let Some(file) = listed
                .get(name)
                .and_then(|l| m.direct_file(l, path.clone(), expect))
            {
                out.push(Some(file));
                continue;
            }
            stage_whole(states, name, &path, expect)?;
            out.push(None);
        }
        Ok(out)
    }

    /// An optimizer's saved state in this run's naming: `name::state` whole, or one
    /// `name[from..to]::state` per piece of this process's slice.
    fn assemble_optimizer(&self, file: &Path, mut runs: Runs, json: Value) -> Result<StateDict> {
        let mut tensors = Vec::new();
        for key in runs.keys() {
            let Some((name, state)) = key.split_once("::") else {
                return Err(unfit(
                    file,
                    format!(
                        "has `{key}`, which is not `variable::key`: was it saved by an ivme \
                         optimizer?"
                    ),
                ));
            };
            let mut found = None;
            for m in self.training.models() {
                found = m.assemble_optimizer_key(file, &mut runs, &key, (name, state))?;
                if found.is_some() {
                    break;
                }
            }
            let Some(found) = found else {
                return Err(unfit(
                    file,
                    format!(
                        "has state for `{name}`, which no prepared model has: was it saved by \
                         this model?"
                    ),
                ));
            };
            tensors.extend(found);
        }
        Ok(StateDict { tensors, json })
    }

    /// After a load into sharded models: every process's loaded slice is gathered into every
    /// process's model weights. Every rank calls it, after all of them applied the load.
    pub(crate) fn gather_loaded_slices(&self) -> Result<()> {
        for m in self.training.models() {
            m.gather_slice(&*self.comm, self.sync.bucket_bytes())?;
        }
        Ok(())
    }

    /// Says once, on the main process, what a load onto another number of processes cannot
    /// carry over exactly.
    pub(crate) fn warn_moved(&self, saved_world: usize) {
        if self.is_main_process() {
            warn_user!(
                "warning: resuming a checkpoint of {saved_world} process(es) on {}: the \
                 model and optimizer state carry over exactly and each data loader continues \
                 with the samples of the epoch not yet used, but random streams are per process: \
                 processes 0..{} continue the saved streams of the same ranks{} (docs/sharding.md)",
                self.num_processes(),
                saved_world.min(self.num_processes()),
                if self.num_processes() > saved_world {
                    ", the others keep the streams they started with"
                } else {
                    ", the other saved streams are dropped"
                }
            );
        }
    }
}

/// The tensors of component `name` taken out of every saved rank of `states` (read from
/// `file`, named in errors) as runs, with the first rank's JSON.
fn take_runs(
    states: &mut [&mut RankState],
    name: &str,
    file: &Path,
) -> Result<(Runs, Option<Value>)> {
    let (mut runs, mut json) = (Runs::default(), None);
    for s in states.iter_mut() {
        if let Some(c) = s.components.iter_mut().find(|c| c.name == name) {
            runs.add(file, std::mem::take(&mut c.tensors))?;
            json.get_or_insert_with(|| c.json.clone());
        }
    }
    Ok((runs, json))
}

/// Reads the model file at `path` (checked against `expect`) into component `name` of the
/// first saved rank in `states` that has it, so that assembling it gives the usual refusal.
fn stage_whole(
    states: &mut [&mut RankState],
    name: &str,
    path: &Path,
    expect: (u64, u32),
) -> Result<()> {
    let (header, tensors) = read::read_checked(path, expect)?;
    let named: Vec<(String, Tensor)> = header
        .tensors
        .iter()
        .map(|t| t.name.clone())
        .zip(tensors)
        .collect();
    if let Some(c) = states
        .iter_mut()
        .find_map(|s| s.components.iter_mut().find(|c| c.name == name))
    {
        c.tensors = named;
    }
    Ok(())
}
