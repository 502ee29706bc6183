//! In-memory snapshots: the training state every few optimizer steps, in a folder on the
//! machine's memory-backed file system (`/dev/shm`) that `ivme launch` names for all its
//! attempts (`IVME_SNAPSHOT_DIR`) and removes when it ends. A snapshot is a checkpoint like any
//! other (`checkpoint_{step}`: checksummed files, a manifest, committed by one rename), so a
//! restart after a crash resumes from it when it is newer than the newest checkpoint on disk.
//!
//! Only the newest committed snapshot and the one being written are kept. Snapshots need every
//! rank on one machine (one `/dev/shm`); on several machines they are off, with a warning.

use super::project::newest_first;
use std::path::{Path, PathBuf};

/// When and where this process takes snapshots.
#[derive(Debug, Default)]
pub(crate) struct Snapshots {
    /// Take one every this many optimizer steps (0: never).
    every: u64,
    /// The folder they go in, when snapshots are on.
    dir: Option<PathBuf>,
    /// The step of the last snapshot taken.
    last: Option<u64>,
}

impl Snapshots {
    /// Snapshots every `every` steps in `dir` (both needed; `every` 0 turns them off).
    pub(crate) fn new(every: u64, dir: Option<PathBuf>) -> Self {
        Snapshots {
            every,
            dir: dir.filter(|_| every > 0),
            last: None,
        }
    }

    /// The folder snapshots go in, when they are on.
    pub(crate) fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The snapshot due after optimizer step `step`, if one is: its folder.
    pub(crate) fn due(&self, step: u64) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        let due = step > 0 && step % self.every == 0 && self.last != Some(step);
        due.then(|| dir.join(format!("checkpoint_{step}")))
    }

    /// Records that the snapshot of `step` was started.
    pub(crate) fn taken(&mut self, step: u64) {
        self.last = Some(step);
    }

    /// Whether `target` (a save's folder) is a snapshot.
    pub(crate) fn holds(&self, target: &Path) -> bool {
        self.dir
            .as_deref()
            .is_some_and(|d| target.parent() == Some(d))
    }
}

/// Removes every snapshot in `dir` but the newest committed one older than `step` (the one a
/// restart would use until the snapshot of `step` is committed). Run by the main process.
pub(crate) fn rotate(dir: &Path, step: u64) -> std::io::Result<()> {
    let Ok(all) = newest_first(dir) else {
        return Ok(());
    };
    let mut kept = false;
    for snapshot in all {
        let older = super::project::checkpoint_number(&snapshot).is_some_and(|n| n < step);
        if older && !kept && super::store::verify_listing(&snapshot).is_ok() {
            kept = true;
            continue;
        }
        std::fs::remove_dir_all(&snapshot)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_fall_due_every_k_steps_once() {
        let mut s = Snapshots::new(3, Some(PathBuf::from("/dev/shm/x")));
        assert_eq!(s.due(0), None);
        assert_eq!(s.due(2), None);
        assert_eq!(s.due(3), Some(PathBuf::from("/dev/shm/x/checkpoint_3")));
        s.taken(3);
        assert_eq!(s.due(3), None, "a second call at the same step takes none");
        assert!(s.due(6).is_some());
        assert!(s.holds(Path::new("/dev/shm/x/checkpoint_6")));
        assert!(!s.holds(Path::new("/runs/checkpoints/checkpoint_6")));
        assert_eq!(Snapshots::new(0, Some(PathBuf::from("/x"))).due(5), None);
        assert_eq!(Snapshots::new(1, None).due(5), None);
    }
}
