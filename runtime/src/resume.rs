//! The Accelerator's side of saving and resuming: it gathers every piece of training state,
//! hands it to [`checkpoint`](crate::checkpoint) with barriers between the ranks' steps, and
//! puts it back on load.
//!
//! What is saved: the models' f32 masters and the optimizers' state (from rank 0: they are
//! identical everywhere), and on every rank its RNG, its loaders' positions, the fp16 loss
//! scaler, the accumulation micro-step with the partial gradient sums of a window saved
//! mid-way, and every object registered with
//! [`register_for_checkpointing`](crate::Accelerator::register_for_checkpointing).

use crate::accelerator::Accelerator;
use crate::checkpoint::model::{load_checkpoint_in_model, save_model, LoadReport, ShardSize};
use crate::checkpoint::project::{latest_valid, rotate, ProjectConfiguration};
use crate::checkpoint::store::{self, Component, ManifestMeta, RankState};
use crate::data::LoaderPosition;
use crate::error::{Error, Result};
use crate::rng::RngState;
use crate::stateful::{Shared, StateDict, Stateful};
use candle_core::{DType, Tensor};
use serde_json::json;
use std::path::{Path, PathBuf};

fn component(name: String, s: StateDict) -> Component {
    Component {
        name,
        tensors: s.tensors,
        json: s.json,
    }
}

fn as_state(c: &Component) -> StateDict {
    StateDict {
        tensors: c.tensors.clone(),
        json: c.json.clone(),
    }
}

fn missing(dir: &Path, what: &str) -> Error {
    Error::Checkpoint {
        path: dir.to_path_buf(),
        msg: format!("it has no `{what}`: it was saved by a program that prepared or registered different objects"),
    }
}

impl Accelerator {
    /// Sets where automatically named checkpoints go and how many are kept.
    pub fn set_project_configuration(&mut self, config: ProjectConfiguration) -> Result<()> {
        config.validate()?;
        self.project = Some(config);
        Ok(())
    }

    /// The project configuration, if one was set.
    pub fn project_configuration(&self) -> Option<&ProjectConfiguration> {
        self.project.as_ref()
    }

    /// Saves and restores `object` with the training state; returns the handle to use it by.
    /// Registration order names the files, so register the same objects in the same order
    /// before loading.
    pub fn register_for_checkpointing<T: Stateful + 'static>(&mut self, object: T) -> Shared<T> {
        let shared = Shared::new(object);
        self.registered.push(Box::new(shared.clone()));
        shared
    }

    /// Agrees on one outcome across ranks: if any rank failed, every rank returns an error
    /// (instead of the others waiting forever at the next collective).
    fn agree<T>(&self, what: &str, local: Result<T>) -> Result<T> {
        let flag = [u8::from(local.is_err())];
        let all = self.comm().all_gather_bytes(&flag)?;
        match local {
            Err(e) => Err(e),
            Ok(_) if all.iter().any(|f| f.first() == Some(&1)) => {
                let ranks: Vec<usize> = all
                    .iter()
                    .enumerate()
                    .filter(|(_, f)| f.first() == Some(&1))
                    .map(|(r, _)| r)
                    .collect();
                Err(Error::Comm(format!(
                    "{what} failed on rank(s) {ranks:?}; see their error messages"
                )))
            }
            Ok(v) => Ok(v),
        }
    }

    fn broadcast_path(&self, path: Option<PathBuf>) -> Result<Option<PathBuf>> {
        let bytes = path
            .map(|p| p.to_string_lossy().into_owned().into_bytes())
            .unwrap_or_default();
        let bytes = self.comm().broadcast_bytes(bytes, 0)?;
        Ok(
            (!bytes.is_empty())
                .then(|| PathBuf::from(String::from_utf8_lossy(&bytes).into_owned())),
        )
    }

    fn rank_state(&self) -> Result<RankState> {
        let mut components = Vec::new();
        if self.is_main_process() {
            for (i, m) in self.models.iter().enumerate() {
                let tensors = m
                    .names
                    .iter()
                    .cloned()
                    .zip(m.master.iter().map(|v| v.as_tensor().clone()))
                    .collect();
                components.push(Component {
                    name: format!("model_{i}"),
                    tensors,
                    json: json!(null),
                });
            }
            for (i, o) in self.optimizers.iter().enumerate() {
                components.push(component(format!("optimizer_{i}"), o.state_dict()?));
            }
        }
        for (i, l) in self.loaders.iter().enumerate() {
            components.push(Component {
                name: format!("loader_{i}"),
                tensors: vec![],
                json: serde_json::to_value(*l.lock())?,
            });
        }
        components.push(Component {
            name: "rng".into(),
            tensors: vec![],
            json: serde_json::to_value(self.rng.lock().state())?,
        });
        // Partial sums of a window saved mid-way are this rank's own.
        let mut sums = Vec::new();
        for (i, m) in self.models.iter().enumerate() {
            for (name, s) in m.names.iter().zip(&m.sums) {
                if let Some(s) = s {
                    sums.push((format!("{i}::{name}"), s.clone()));
                }
            }
        }
        components.push(Component {
            name: "training".into(),
            tensors: sums,
            json: json!({
                "auto_micro_step": self.grad_state.auto_index(),
                "scaler": self.scaler,
                "checkpoints_saved": self.project.as_ref().map(|p| p.iteration),
            }),
        });
        for (i, r) in self.registered.iter().enumerate() {
            components.push(component(format!("custom_{i}"), r.state_dict()?));
        }
        Ok(RankState { components })
    }

    /// Saves the whole training state to `dir`, or (with `None`) to the next automatically
    /// named checkpoint of the project configuration. Every rank must call it. Returns the
    /// committed folder. A crash at any moment leaves the previous checkpoints intact.
    pub fn save_state(&mut self, dir: Option<&Path>) -> Result<PathBuf> {
        // Every rank checks the request, so a bad one fails everywhere instead of leaving
        // the other ranks waiting for rank 0's path.
        let auto = self
            .project
            .as_ref()
            .filter(|p| p.automatic_checkpoint_naming);
        if dir.is_none() && auto.is_none() {
            return Err(Error::Usage(
                "save_state(None) needs a ProjectConfiguration with automatic_checkpoint_naming; \
                 set one with set_project_configuration (or project_dir) or pass a folder"
                    .into(),
            ));
        }
        let chosen = match (self.is_main_process(), dir, auto) {
            (false, _, _) => Ok(None),
            (true, Some(d), _) => Ok(Some(d.to_path_buf())),
            (true, None, Some(p)) => p.next_checkpoint_dir().map(Some),
            (true, None, None) => Ok(None),
        };
        let chosen = self.agree("naming the checkpoint", chosen)?;
        let target = self
            .broadcast_path(chosen)?
            .ok_or_else(|| Error::Usage("no checkpoint folder".into()))?;
        let parent = target
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let prepared = self.agree(
            "preparing the checkpoint folder",
            (|| {
                if self.is_main_process() {
                    std::fs::create_dir_all(&parent)
                        .map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
                    store::clean_stale(&parent)?;
                }
                Ok(())
            })(),
        );
        prepared?;
        let tmp = self.agree("starting the save", store::begin(&target))?;
        let wrote = self
            .rank_state()
            .and_then(|s| store::write_rank(&tmp, self.process_index(), &s));
        self.agree("writing the state", wrote)?;
        let step = self.optimizer_steps();
        let committed = if self.is_main_process() {
            let meta = ManifestMeta {
                world_size: self.num_processes(),
                step,
                extra: json!({ "precision": self.precision().as_str() }),
            };
            store::commit(&tmp, &target, meta).and_then(|_| {
                if let Some(p) = &mut self.project {
                    p.iteration += 1;
                    if let Some(limit) = p.total_limit {
                        rotate(&p.checkpoints_dir(), limit)?;
                    }
                }
                Ok(())
            })
        } else {
            if let Some(p) = &mut self.project {
                p.iteration += 1;
            }
            Ok(())
        };
        self.agree("committing the checkpoint", committed)?;
        Ok(target)
    }

    fn optimizer_steps(&self) -> u64 {
        self.optimizers
            .first()
            .and_then(|o| o.state_dict().ok())
            .and_then(|s| s.json.get("step").and_then(|v| v.as_u64()))
            .unwrap_or(0)
    }

    /// Restores the state saved by [`save_state`](Self::save_state) from `dir`, or (with
    /// `None`) from the newest project checkpoint whose files verify. Call it after
    /// preparing and registering the same objects as the saving run. Returns the folder.
    pub fn load_state(&mut self, dir: Option<&Path>) -> Result<PathBuf> {
        let chosen = if self.is_main_process() {
            let found = match (dir, &self.project) {
                // Each rank checks every file it reads against the manifest while loading.
                (Some(d), _) => store::read_manifest(d).map(|_| d.to_path_buf()),
                (None, Some(p)) => latest_valid(&p.checkpoints_dir()).and_then(|f| {
                    f.map(|(d, _)| d).ok_or_else(|| Error::Checkpoint {
                        path: p.checkpoints_dir(),
                        msg: "holds no complete checkpoint to resume from".into(),
                    })
                }),
                (None, None) => Err(Error::Usage(
                    "load_state(None) needs a ProjectConfiguration to find checkpoints; pass a folder".into(),
                )),
            };
            Some(found)
        } else {
            None
        };
        let chosen = match chosen {
            Some(Ok(p)) => Ok(Some(p)),
            Some(Err(e)) => Err(e),
            None => Ok(None),
        };
        let chosen = self.agree("finding the checkpoint", chosen)?;
        let dir = self
            .broadcast_path(chosen)?
            .ok_or_else(|| Error::Usage("no checkpoint chosen".into()))?;
        let loaded = self.apply_checkpoint(&dir);
        self.agree("loading the checkpoint", loaded)?;
        Ok(dir)
    }

    fn apply_checkpoint(&mut self, dir: &Path) -> Result<()> {
        let manifest = store::read_manifest(dir)?;
        if manifest.world_size != self.num_processes() {
            return Err(Error::Checkpoint {
                path: dir.to_path_buf(),
                msg: format!(
                    "was saved by {} processes but this run has {}; resume with `ivme launch --num_processes {}`",
                    manifest.world_size,
                    self.num_processes(),
                    manifest.world_size
                ),
            });
        }
        // Model weights stream straight into the variables (memory stays near one tensor);
        // everything else is small enough to read whole.
        let is_model = |c: &str| c.starts_with("model_");
        let shared = store::read_rank_with(dir, 0, |c| !is_model(c))?;
        let mine = if self.process_index() == 0 {
            shared.clone()
        } else {
            store::read_rank(dir, self.process_index())?
        };
        let get =
            |s: &RankState, name: &str| s.get(name).cloned().ok_or_else(|| missing(dir, name));

        for i in 0..self.models.len() {
            let component = format!("model_{i}");
            get(&shared, &component)?;
            let m = &self.models[i];
            let check = |listing: &[(String, DType, Vec<usize>)]| -> Result<()> {
                for (name, master) in m.names.iter().zip(&m.master) {
                    match listing.iter().find(|(n, _, _)| n == name) {
                        None => return Err(missing(dir, name)),
                        Some((_, _, shape)) if shape.as_slice() != master.dims() => {
                            return Err(Error::Checkpoint {
                                path: dir.to_path_buf(),
                                msg: format!(
                                    "has `{name}` with shape {shape:?} but the model's is {:?}; \
                                     was it saved by this model?",
                                    master.dims()
                                ),
                            })
                        }
                        Some(_) => {}
                    }
                }
                Ok(())
            };
            let set = |name: &str, t: Tensor| -> Result<()> {
                let Some(i) = m.names.iter().position(|n| n == name) else {
                    return Ok(());
                };
                let (master, compute) = (&m.master[i], &m.compute[i]);
                master.set(&t.to_dtype(DType::F32)?.to_device(master.device())?)?;
                if compute.as_tensor().id() != master.as_tensor().id() {
                    compute.set(&master.as_tensor().to_dtype(compute.dtype())?)?;
                }
                Ok(())
            };
            store::stream_tensors(dir, 0, &component, check, set)?;
        }
        for i in 0..self.optimizers.len() {
            let c = get(&shared, &format!("optimizer_{i}"))?;
            self.optimizers[i].load_state_dict(&as_state(&c))?;
        }
        for i in 0..self.loaders.len() {
            let c = get(&mine, &format!("loader_{i}"))?;
            let pos: LoaderPosition = serde_json::from_value(c.json)?;
            *self.loaders[i].lock() = pos;
        }
        let rng: RngState = serde_json::from_value(get(&mine, "rng")?.json)?;
        *self.rng.lock() = crate::rng::Rng::from_state(rng);
        let t = get(&mine, "training")?;
        self.grad_state
            .set_auto_index(t.json["auto_micro_step"].as_u64().unwrap_or(0));
        self.scaler = serde_json::from_value(t.json["scaler"].clone())?;
        for (i, m) in self.models.iter_mut().enumerate() {
            for (name, s) in m.names.iter().zip(m.sums.iter_mut()) {
                let key = format!("{i}::{name}");
                *s = t
                    .tensors
                    .iter()
                    .find(|(n, _)| *n == key)
                    .map(|(_, t)| t.clone());
            }
        }
        let saved_custom = mine
            .components
            .iter()
            .filter(|c| c.name.starts_with("custom_"))
            .count();
        if saved_custom != self.registered.len() {
            return Err(Error::Checkpoint {
                path: dir.to_path_buf(),
                msg: format!(
                    "holds {saved_custom} registered object(s) but {} are registered now; register the same \
                     objects, in the same order, before load_state",
                    self.registered.len()
                ),
            });
        }
        for i in 0..self.registered.len() {
            let c = get(&mine, &format!("custom_{i}"))?;
            self.registered[i].load_state_dict(&as_state(&c))?;
        }
        Ok(())
    }

    /// Waits for every process, then the main process writes the models' f32 weights as
    /// `model.safetensors`, or as shards of at most `max_shard_size` ("500MB", "1GB", bytes)
    /// with an index json: the Hugging Face layout.
    pub fn save_model(&self, dir: &Path, max_shard_size: Option<&str>) -> Result<()> {
        let shard = max_shard_size.map(ShardSize::parse).transpose()?;
        self.wait_for_everyone()?;
        let written = if self.is_main_process() {
            let tensors: Vec<(String, Tensor)> = self
                .named_master_vars()
                .into_iter()
                .map(|(n, v)| (n, v.as_tensor().clone()))
                .collect();
            save_model(&tensors, dir, shard).map(|_| ())
        } else {
            Ok(())
        };
        self.agree("saving the model", written)
    }

    /// Loads a model file or folder (single or sharded) into the prepared models' weights on
    /// every rank, refreshing their low-precision copies.
    pub fn load_model(&self, path: &Path) -> Result<LoadReport> {
        let vars = self.named_master_vars();
        let report = load_checkpoint_in_model(&vars, path, self.device())?;
        for m in &self.models {
            for (c, master) in m.compute.iter().zip(&m.master) {
                if c.as_tensor().id() != master.as_tensor().id() {
                    c.set(&master.as_tensor().to_dtype(c.dtype())?)?;
                }
            }
        }
        Ok(report)
    }
}
