//! Asynchronous saves from the Accelerator: the state copied to host memory, written on a background thread, committed at the next wait point or when the Accelerator is dropped.

use crate::accelerator::Accelerator;
use crate::checkpoint::background::PendingSave;
use crate::checkpoint::store;
use crate::error::Result;
use std::path::Path;
use std::path::PathBuf;

impl Accelerator {
    /// Starts saving the whole training state to `dir` (or, with `None`, to the next
    /// automatically named checkpoint) and returns as soon as the state is copied into host
    /// memory; a background thread writes and fsyncs the files. Returns the folder the
    /// checkpoint will be committed to. Every rank must call it.
    ///
    /// The checkpoint is committed (with the crash-safe protocol of
    /// [`save_state`](Self::save_state)) at the next wait point on every rank: the next save,
    /// [`wait_for_checkpoint`](Self::wait_for_checkpoint), `load_state`, `load_state_if_any`,
    /// or dropping the Accelerator. An error in the background (a full disk, say) is returned
    /// there, on every rank. Until then a crash leaves the previous checkpoints as they were.
    /// Only one save runs in the background: starting a second one first finishes the first.
    ///
    /// ```no_run
    /// # fn main() -> ivme::Result<()> {
    /// let mut accelerator = ivme::Accelerator::builder().project_dir("runs/demo").build()?;
    /// // ... prepare the model, optimizer and loaders, train a while ...
    /// let dir = accelerator.save_state_async(None)?; // back as soon as the copy is made
    /// // ... training goes on while the files are written ...
    /// accelerator.wait_for_checkpoint()?; // `dir` is committed now, or this is the error
    /// # let _ = dir; Ok(()) }
    /// ```
    pub fn save_state_async(&mut self, dir: Option<&Path>) -> Result<PathBuf> {
        let clock = self.training.window().clock().clone();
        let _timed = clock.saving();
        self.wait_for_checkpoint()?;
        let (target, tmp) = self.start_save(dir)?;
        let started = self
            .rank_state()
            .and_then(|s| self.checkpoints.background_mut().buffers.copy(s))
            .and_then(|state| {
                let meta = self.manifest_meta();
                PendingSave::spawn(
                    target.clone(),
                    tmp.clone(),
                    meta,
                    self.process_index(),
                    state,
                )
            });
        // The ranks agree on a flag, so a writer started here is never left running unseen.
        let (started, outcome) = match started {
            Ok(p) => (Some(p), Ok(())),
            Err(e) => (None, Err(e)),
        };
        match self.agree("copying the state", outcome) {
            Ok(()) => {
                self.checkpoints.background_mut().pending = started;
                Ok(target)
            }
            Err(e) => {
                if let Some(p) = started {
                    let _ = p.join();
                }
                if self.is_main_process() {
                    let _ = store::abandon(&tmp);
                }
                Err(e)
            }
        }
    }

    /// Finishes the save running in the background, if any: waits for this rank's files,
    /// then the ranks agree and the main process commits. Returns the committed folder
    /// (`None` when nothing was pending), or the error of any rank's write or of the commit,
    /// on every rank. Every rank must call it.
    pub fn wait_for_checkpoint(&mut self) -> Result<Option<PathBuf>> {
        let Some(pending) = self.checkpoints.background_mut().pending.take() else {
            return Ok(None);
        };
        let clock = self.training.window().clock().clone();
        let _timed = clock.saving();
        let (target, tmp, meta, wrote) = pending.join();
        self.finish_save(&target, &tmp, meta, wrote)?;
        Ok(Some(target))
    }

    /// The folder a save running in the background will be committed to, if one is running.
    pub fn pending_checkpoint(&self) -> Option<&Path> {
        self.checkpoints
            .background()
            .pending
            .as_ref()
            .map(|p| p.target.as_path())
    }

    /// Whether [`save_state`](Self::save_state) saves in the background (see
    /// [`AcceleratorBuilder::async_checkpoints`](crate::AcceleratorBuilder::async_checkpoints)).
    pub fn async_checkpoints(&self) -> bool {
        self.checkpoints.background().by_default
    }
}

/// The end of training is a wait point: a checkpoint already announced by `save_state_async`
/// is committed before the Accelerator goes, unless the program is panicking.
impl Drop for Accelerator {
    fn drop(&mut self) {
        self.commit_at_drop();
        // After the commit, so that its stall is in the profile too.
        self.write_profile_at_drop();
    }
}

impl Accelerator {
    /// Commits (or, panicking, gives up) a background save still pending at drop.
    fn commit_at_drop(&mut self) {
        let Some(target) = self.pending_checkpoint().map(Path::to_path_buf) else {
            return;
        };
        let rank = self.process_index();
        if std::thread::panicking() {
            // Another rank may never get here, so no collective: the save is given up.
            if let Some(pending) = self.checkpoints.background_mut().pending.take() {
                let (_, tmp, _, _) = pending.join();
                if self.is_main_process() {
                    let _ = store::abandon(&tmp);
                }
            }
            warn_user!(
                "rank {rank}: the checkpoint {} was not committed (a panic ended \
                 training while it was written); the previous checkpoint is the newest",
                target.display()
            );
            return;
        }
        if let Err(e) = self.wait_for_checkpoint() {
            warn_user!(
                "rank {rank}: the checkpoint {} was not committed: {e}; call \
                 wait_for_checkpoint() before the end of training to get this as an error",
                target.display()
            );
        }
    }
}
