//! The Accelerator's side of saving and resuming: it gathers every piece of training state,
//! hands it to [`checkpoint`](crate::checkpoint) with barriers between the ranks' steps, and
//! puts it back on load.
//!
//! What is saved: the models' f32 masters and the optimizers' state (from rank 0, as they are
//! identical everywhere; under sharding every rank writes its own slice, see
//! [`checkpoint::layout`](crate::checkpoint::layout)), and on every rank its RNG, its loaders' positions, the fp16 loss
//! scaler, the accumulation micro-step with the partial gradient sums of a window saved
//! mid-way, and every object registered with
//! [`register_for_checkpointing`](crate::Accelerator::register_for_checkpointing).
//!
//! Saving takes the project folder's lock and a temporary folder unique to the save (see
//! [`checkpoint::lock`](crate::checkpoint::lock) and
//! [`checkpoint::staging`](crate::checkpoint::staging)); loading checks everything before it
//! changes anything (see `accelerator/restore.rs`).

use crate::accelerator::Accelerator;
use crate::checkpoint::fsio::parent_of;
use crate::checkpoint::layout::Layout;
use crate::checkpoint::names::{self, Kind};
use crate::checkpoint::plan::Newest;
use crate::checkpoint::project::{rotate, ProjectConfiguration};
use crate::checkpoint::store::{self, Component, ManifestMeta, RankState};
use crate::checkpoint::FolderLock;
use crate::error::CheckpointErrorKind;
use crate::error::{Error, Result};
use crate::setup::config::Sharding;
use crate::stateful::{Shared, StateDict, Stateful};
use serde_json::json;
use std::path::{Path, PathBuf};

fn component(name: String, s: StateDict) -> Component {
    Component {
        name,
        tensors: s.tensors,
        json: s.json,
    }
}

impl Accelerator {
    /// Sets where automatically named checkpoints go and how many are kept.
    pub fn set_project_configuration(&mut self, config: ProjectConfiguration) -> Result<()> {
        config.validate()?;
        self.checkpoints.set_project(config);
        Ok(())
    }

    /// The project configuration, if one was set.
    pub fn project_configuration(&self) -> Option<&ProjectConfiguration> {
        self.checkpoints.project()
    }

    /// Saves and restores `object` with the training state; returns the handle to use it by.
    /// Registration order names the files, so register the same objects in the same order
    /// before loading.
    pub fn register_for_checkpointing<T: Stateful + 'static>(&mut self, object: T) -> Shared<T> {
        let shared = Shared::new(object);
        self.checkpoints.register(Box::new(shared.clone()));
        shared
    }

    /// Agrees on one outcome across ranks: if any rank failed, every rank returns an error
    /// (instead of the others waiting forever at the next collective).
    pub(crate) fn agree<T>(&self, what: &str, local: Result<T>) -> Result<T> {
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

    pub(crate) fn broadcast_path(&self, path: Option<PathBuf>) -> Result<Option<PathBuf>> {
        let bytes = path
            .map(|p| p.to_string_lossy().into_owned().into_bytes())
            .unwrap_or_default();
        let bytes = self.comm().broadcast_bytes(bytes, 0)?;
        Ok(
            (!bytes.is_empty())
                .then(|| PathBuf::from(String::from_utf8_lossy(&bytes).into_owned())),
        )
    }

    /// This rank's saved state, each part's from its own state methods: the models'
    /// weights and the optimizers' state (rank 0's, or every rank's slice under sharding),
    /// the loaders' positions, the generator, the window and the registered objects.
    pub(crate) fn rank_state(&self) -> Result<RankState> {
        let named = |kind: Kind, states: Vec<StateDict>| {
            let states = states.into_iter().enumerate();
            states.map(move |(i, s)| component(kind.name(i), s))
        };
        let mut components = Vec::new();
        // Without sharding the masters and optimizer state are the same everywhere and rank 0
        // writes them; under sharding every rank writes its slice (nothing is gathered).
        if self.is_main_process() || self.sync.sharding() != Sharding::No {
            components.extend(named(Kind::Model, self.training.model_states()?));
            components.extend(named(Kind::Optimizer, self.training.optimizer_states()?));
        }
        components.extend(named(Kind::Loader, self.data.loader_states()?));
        components.push(component(names::RNG.into(), self.data.rng_state()?));
        components.push(Component {
            name: names::TRAINING.into(),
            // Partial sums of a window saved mid-way are this rank's own.
            tensors: self.training.window_sums()?,
            json: json!({
                "auto_micro_step": self.training.window().auto_index(),
                "macro_loop": self.data.loop_cursor().lock().position(),
                "scaler": self.mixed.scaler(),
                "checkpoints_saved": self.checkpoints.project().map(|p| p.iteration),
            }),
        });
        components.extend(named(Kind::Custom, self.checkpoints.registered_states()?));
        Ok(RankState { components })
    }

    /// Saves the whole training state to `dir`, or (with `None`) to the next automatically
    /// named checkpoint of the project configuration. Every rank must call it. Returns the
    /// committed folder. A crash at any moment leaves the previous checkpoints intact.
    ///
    /// One job writes a project's checkpoints: the first automatic save takes an exclusive
    /// lock on `project_dir/checkpoints` (on the main process; the other ranks write under
    /// its decision) and keeps it until this Accelerator is dropped, so a second job saving
    /// there gets an error naming the holder (host, pid, since when). The lock dies with its
    /// process, so a crashed job never blocks the restarted one. Each save is written into a
    /// temporary folder of its own; a save to an explicit `dir` that another process commits
    /// first fails with an error instead of merging the two. Any write error (a full disk
    /// included) names the file and leaves the previous checkpoints as they were.
    ///
    /// With [`async_checkpoints(true)`](crate::AcceleratorBuilder::async_checkpoints) this is
    /// [`save_state_async`](Self::save_state_async): it returns the folder it *will* commit.
    /// Otherwise it first finishes a save still running in the background.
    pub fn save_state(&mut self, dir: Option<&Path>) -> Result<PathBuf> {
        let clock = self.training.window().clock().clone();
        let _timed = clock.saving();
        if self.checkpoints.background().by_default {
            return self.save_state_async(dir);
        }
        self.wait_for_checkpoint()?;
        let (target, tmp) = self.start_save(dir)?;
        let wrote = self
            .rank_state()
            .and_then(|s| store::write_rank(&tmp, self.process_index(), &s));
        let meta = self.manifest_meta();
        self.finish_save(&target, &tmp, meta, wrote)?;
        Ok(target)
    }

    /// The first half of every save, on the caller's thread: checks the request on every rank,
    /// then the main process prepares the folder and every rank learns the (checkpoint,
    /// temporary folder) pair to write into.
    pub(crate) fn start_save(&mut self, dir: Option<&Path>) -> Result<(PathBuf, PathBuf)> {
        // Every rank checks the request, so a bad one fails everywhere instead of leaving
        // the other ranks waiting for rank 0's path.
        let auto = self
            .checkpoints
            .project()
            .filter(|p| p.automatic_checkpoint_naming);
        if dir.is_none() && auto.is_none() {
            return Err(Error::Usage(
                "save_state(None) needs a ProjectConfiguration with automatic_checkpoint_naming; \
                 set one with set_project_configuration (or project_dir) or pass a folder"
                    .into(),
            ));
        }
        // The main process takes (or checks) the folder's lock, recovers crashed saves, picks
        // the name and creates this save's own temporary folder; every rank writes into it.
        let prepared = if self.is_main_process() {
            self.prepare_save(dir).map(Some)
        } else {
            Ok(None)
        };
        let prepared = self.agree("preparing the checkpoint folder", prepared)?;
        self.broadcast_paths(prepared)
    }

    /// What the manifest records about the state as it is now.
    pub(crate) fn manifest_meta(&self) -> ManifestMeta {
        let counts: Vec<Vec<usize>> = self
            .training
            .models()
            .iter()
            .filter_map(|m| m.slice_counts().map(<[usize]>::to_vec))
            .collect();
        let layout = Layout {
            sharding: self.sync.sharding().to_string(),
            world_size: self.num_processes(),
            counts,
        };
        ManifestMeta {
            world_size: self.num_processes(),
            step: self.optimizer_steps(),
            extra: json!({
                (ivme_settings::PRECISION.name): self.precision().as_str(),
                "layout": layout,
                // A fine-tune's base, checked on resume (finetune::BaseRecord).
                "base": self.finetune.base.lock().clone(),
            }),
        }
    }

    /// The second half of every save, on the caller's thread: the ranks agree on `wrote` (this
    /// rank's `write_rank` outcome); then the main process commits and rotates, and the ranks
    /// agree on that too. On any failure the temporary folder is removed and every rank
    /// returns an error; the previous checkpoints were never touched.
    pub(crate) fn finish_save(
        &mut self,
        target: &Path,
        tmp: &Path,
        meta: ManifestMeta,
        wrote: Result<()>,
    ) -> Result<()> {
        if let Err(e) = self.agree("writing the state", wrote) {
            if self.is_main_process() {
                // The previous checkpoints were never touched; free the space this one took.
                let _ = store::abandon(tmp);
            }
            return Err(e);
        }
        let committed = if self.is_main_process() {
            store::commit(tmp, target, meta).and_then(|_| {
                if let Some(p) = self.checkpoints.count_committed() {
                    if let Some(limit) = p.total_limit {
                        rotate(&p.checkpoints_dir(), limit)?;
                    }
                }
                Ok(())
            })
        } else {
            self.checkpoints.count_committed();
            Ok(())
        };
        self.agree("committing the checkpoint", committed)
    }

    /// The main process's part of starting a save: the folder, its lock, recovery of crashed
    /// saves, the name (chosen after recovery, so a finished-but-unrenamed save is counted)
    /// and a temporary folder unique to this save.
    ///
    /// Automatic saves lock the project's `checkpoints` folder from the first save until the
    /// Accelerator is dropped; a save to an explicit folder takes no lock but is refused when
    /// another job holds the folder it would be written into.
    fn prepare_save(&mut self, dir: Option<&Path>) -> Result<(PathBuf, PathBuf)> {
        let parent = match (dir, self.checkpoints.project()) {
            (Some(d), _) => parent_of(d),
            (None, Some(p)) => p.checkpoints_dir(),
            (None, None) => return Err(Error::Usage("no checkpoint folder".into())),
        };
        std::fs::create_dir_all(&parent)
            .map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
        if dir.is_none() {
            self.checkpoints.hold_lock(&parent)?;
        } else {
            FolderLock::check_free(&parent)?;
        }
        store::clean_stale(&parent)?;
        let target = match (dir, self.checkpoints.project()) {
            (Some(d), _) => d.to_path_buf(),
            (None, Some(p)) => p.next_checkpoint_dir()?,
            (None, None) => unreachable!("checked above"),
        };
        let tmp = store::begin(&target)?;
        Ok((target, tmp))
    }

    /// Sends the main process's (checkpoint, temporary folder) pair to every rank.
    fn broadcast_paths(&self, pair: Option<(PathBuf, PathBuf)>) -> Result<(PathBuf, PathBuf)> {
        let bytes = pair
            .map(|(a, b)| format!("{}\0{}", a.display(), b.display()).into_bytes())
            .unwrap_or_default();
        let bytes = self.comm().broadcast_bytes(bytes, 0)?;
        let text = String::from_utf8_lossy(&bytes);
        match text.split_once('\0') {
            Some((a, b)) => Ok((PathBuf::from(a), PathBuf::from(b))),
            None => Err(Error::Comm(
                "the main process sent no checkpoint folder".into(),
            )),
        }
    }

    /// Finishes or clears what crashed saves left in the project's checkpoints folder before a
    /// load picks the newest; a problem here only warns (a read-only copy can still be loaded).
    pub(crate) fn recover_for_load(&self, checkpoints_dir: &Path) {
        match store::clean_stale(checkpoints_dir) {
            Ok(c) => {
                for r in &c.recovered {
                    warn_user!(
                        "finished a save that crashed before its rename: {}",
                        r.display()
                    );
                }
            }
            Err(e) => warn_user!("warning: could not tidy {}: {e}", checkpoints_dir.display()),
        }
    }

    pub(crate) fn optimizer_steps(&self) -> u64 {
        self.training.steps()
    }

    /// Restores the state saved by [`save_state`](Self::save_state) from `dir`, or (with
    /// `None`) from the newest project checkpoint whose files verify, after finishing or
    /// clearing what crashed saves left behind. Call it after preparing and registering the
    /// same objects as the saving run. Returns the folder. A save still running in the
    /// background ([`save_state_async`](Self::save_state_async)) is committed first.
    ///
    /// All or nothing: every rank first reads and checks everything it would load (checksums,
    /// component counts, tensor shapes and dtypes against the live model and optimizers, the
    /// JSON of RNG, scaler, loader positions and registered objects); only when every rank's
    /// check passed does anything change, and an object that still refuses its state has the
    /// ones loaded before it put back. On an error, the training state is as it was. (A model
    /// saved and loaded whole is read straight into its variables after the check, checksummed
    /// again: only if its file changes in between does a load fail half done, and it says so.)
    pub fn load_state(&mut self, dir: Option<&Path>) -> Result<PathBuf> {
        let rank = self.process_index();
        self.load_state_inner(dir)
            .map_err(|e| crate::setup::status::note_final(rank, e))
    }

    /// The work of [`load_state`](Self::load_state).
    fn load_state_inner(&mut self, dir: Option<&Path>) -> Result<PathBuf> {
        // A save still being written must land first: it may be the one asked for.
        self.wait_for_checkpoint()?;
        match (dir, self.checkpoints.project().cloned()) {
            (Some(d), _) => self.load_folder(d),
            (None, Some(p)) => self.load_project_newest(&p.checkpoints_dir()),
            (None, None) => Err(Error::Usage(
                "load_state(None) needs a ProjectConfiguration to find checkpoints; pass a folder"
                    .into(),
            )),
        }
    }

    /// Loads the checkpoint folder `d` the main process found a manifest in, on every rank.
    fn load_folder(&mut self, d: &Path) -> Result<PathBuf> {
        let chosen = if self.is_main_process() {
            // Each rank checks every file it reads against the manifest while loading.
            store::read_manifest(d).map(|_| Some(d.to_path_buf()))
        } else {
            Ok(None)
        };
        let chosen = self.agree("finding the checkpoint", chosen)?;
        let dir = self
            .broadcast_path(chosen)?
            .ok_or_else(|| Error::Usage("no checkpoint chosen".into()))?;
        self.load_checked(&dir)?;
        Ok(dir)
    }

    /// Loads the newest sound checkpoint of the project's `checkpoints` folder.
    fn load_project_newest(&mut self, checkpoints: &Path) -> Result<PathBuf> {
        match self.load_newest(&[checkpoints.to_path_buf()])? {
            Newest::Loaded(dir) => Ok(dir),
            Newest::Empty => Err(Error::checkpoint(
                checkpoints,
                CheckpointErrorKind::Missing,
                "holds no complete checkpoint to resume from",
            )),
            Newest::NoneSound(n, newest) => Err(Error::checkpoint(
                checkpoints,
                CheckpointErrorKind::Damaged,
                format!(
                    "holds no complete checkpoint to resume from ({n} checkpoint(s), none \
                     verifies; newest: {newest})"
                ),
            )),
        }
    }

    /// Checks `dir` on every rank, and applies it only if every rank's check passed.
    fn load_checked(&mut self, dir: &Path) -> Result<()> {
        let plan = self.check_checkpoint(dir);
        let plan = self.agree("checking the checkpoint", plan)?;
        self.apply_checked(plan)
    }

    /// Resumes from the newest complete checkpoint of the project folder, or says there is none.
    ///
    /// For automatic restarts: call it once after preparing and registering everything.
    /// Leftovers of a crashed save are recovered first (a save that crashed after writing its
    /// manifest is finished; an incomplete one is removed when no other job holds the folder).
    /// A damaged newest checkpoint is skipped, with a warning on the main process, in favour of
    /// the newest one that verifies.
    ///
    /// Returns `Ok(Some(folder))` after loading, `Ok(None)` when the project folder holds no
    /// checkpoint at all (start fresh), and an error when there are checkpoints but none
    /// verifies, when the newest valid one does not fit the prepared objects (nothing is
    /// changed then), or when no [`ProjectConfiguration`] is set. Every rank must call it.
    /// A save still running in the background is committed first.
    ///
    /// ```no_run
    /// # fn main() -> ivme::Result<()> {
    /// use ivme::checkpoint::ProjectConfiguration;
    /// let mut accelerator = ivme::Accelerator::new()?;
    /// accelerator.set_project_configuration(
    ///     ProjectConfiguration::new("runs/demo").automatic_checkpoint_naming(true),
    /// )?;
    /// // ... prepare the model, optimizer and loaders here ...
    /// match accelerator.load_state_if_any()? {
    ///     Some(dir) => accelerator.print(format!("resumed from {}", dir.display())),
    ///     None => accelerator.print("starting fresh"),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn load_state_if_any(&mut self) -> Result<Option<PathBuf>> {
        let rank = self.process_index();
        self.load_state_if_any_inner()
            .map_err(|e| crate::setup::status::note_final(rank, e))
    }

    /// The work of [`load_state_if_any`](Self::load_state_if_any).
    fn load_state_if_any_inner(&mut self) -> Result<Option<PathBuf>> {
        self.wait_for_checkpoint()?;
        let Some(project) = self.checkpoints.project().cloned() else {
            return Err(Error::Usage(
                "load_state_if_any needs a ProjectConfiguration to find checkpoints; set one with \
                 set_project_configuration (or project_dir)"
                    .into(),
            ));
        };
        // In-memory snapshots (snapshot_every) count too: the newest step wins.
        let folders = self.resume_folders(project.checkpoints_dir());
        match self.load_newest(&folders)? {
            Newest::Loaded(dir) => Ok(Some(dir)),
            Newest::Empty => Ok(None),
            Newest::NoneSound(n, newest) => Err(Error::checkpoint(
                project.checkpoints_dir(),
                CheckpointErrorKind::Damaged,
                format!(
                    "holds {n} checkpoint(s) but none verifies (newest: {newest}); delete the \
                     damaged folders to start fresh, or load an intact copy"
                ),
            )),
        }
    }
}
