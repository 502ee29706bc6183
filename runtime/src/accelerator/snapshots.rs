//! In-memory snapshots (checkpoint/snapshots.rs): taken in the background at the loop's
//! preemption point every few optimizer steps, committed at the next window's gradient sync,
//! and offered to `load_state_if_any` beside the checkpoints on disk.

use crate::accelerator::Accelerator;
use crate::checkpoint::snapshots::rotate;
use crate::error::Result;
use std::path::PathBuf;

impl Accelerator {
    /// Starts the snapshot due after the optimizer step just taken, if one is: the previous
    /// one is committed first and older ones removed; the files are written in the background.
    pub(crate) fn snapshot_if_due(&mut self) -> Result<()> {
        let step = self.optimizer_steps();
        let Some(target) = self.checkpoints.snapshots().due(step) else {
            return Ok(());
        };
        self.wait_for_checkpoint()?;
        if self.is_main_process() {
            if let Some(dir) = self.checkpoints.snapshots().dir() {
                if let Err(e) = rotate(dir, step) {
                    warn_user!("could not remove old snapshots in {}: {e}", dir.display());
                }
            }
        }
        self.checkpoints.snapshots_mut().taken(step);
        self.save_state_async(Some(&target))?;
        Ok(())
    }

    /// Commits a snapshot still being written (run at a window's gradient sync, the same
    /// point on every rank): by then its files are usually written, and a crash during the
    /// next optimizer step finds it.
    pub(crate) fn commit_pending_snapshot(&mut self) -> Result<()> {
        let snapshot = self
            .pending_checkpoint()
            .is_some_and(|p| self.checkpoints.snapshots().holds(p));
        if snapshot {
            self.wait_for_checkpoint()?;
        }
        Ok(())
    }

    /// The folders a resume looks in: the project's checkpoints, then the snapshots.
    pub(crate) fn resume_folders(&self, checkpoints_dir: PathBuf) -> Vec<PathBuf> {
        let mut folders = vec![checkpoints_dir];
        folders.extend(self.checkpoints.snapshots().dir().map(PathBuf::from));
        folders
    }
}

/// Where this process keeps in-memory snapshots: the launcher's folder, when every process
/// runs on this machine.
pub(super) fn snapshots_of(
    every: u64,
    state: &crate::setup::state::ProcessState,
) -> crate::checkpoint::snapshots::Snapshots {
    use crate::checkpoint::snapshots::Snapshots;
    if every == 0 {
        return Snapshots::default();
    }
    let Some(dir) = crate::setup::env::SNAPSHOT_DIR.get() else {
        if state.is_main_process() {
            warn_user!(
                "in-memory snapshots need `ivme launch`, which keeps their folder across \
                 restarts; this run takes none"
            );
        }
        return Snapshots::default();
    };
    if state.local_world_size != state.world_size {
        if state.is_main_process() {
            warn_user!(
                "in-memory snapshots need every process on one machine; this run on several \
                 takes none (its checkpoints on disk are unaffected)"
            );
        }
        return Snapshots::default();
    }
    Snapshots::new(every, Some(dir.into()))
}
