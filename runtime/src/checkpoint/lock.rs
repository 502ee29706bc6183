//! One writing job per checkpoint folder: an advisory `flock` on a lock file inside it.
//!
//! The lock file `.ivme-lock` holds the holder's identity (host, pid, program, since when) for
//! the error a second job gets. The kernel releases a `flock` when its holder exits in any way
//! (a crash, `SIGKILL`, a lost node's processes ending), so a dead job never blocks the next.
//!
//! Within one process the lock is shared: every [`FolderLock`] of the same folder is a handle
//! to one lock, released when the last handle is dropped. The Accelerator takes one at its
//! first automatic save into a project's `checkpoints` folder and keeps it until it is dropped.
//! On network file systems the lock works where the mount supports POSIX locks (NFSv4, Lustre
//! with `flock`); a mount that refuses locks is an error that says so.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::io_at;
use crate::error::{CheckpointErrorKind, Error, Result};
use crate::setup::state::host_name;

/// Name of the lock file inside a locked folder.
pub const LOCK_FILE: &str = ".ivme-lock";

/// Who holds (or held) a lock: written into the lock file by the holder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// The holder's host name.
    pub host: String,
    /// The holder's process id on that host.
    pub pid: u32,
    /// The holder's program (its first argument).
    pub program: String,
    /// When the lock was taken, in seconds since the Unix epoch.
    pub since: u64,
}

impl Holder {
    /// This process, now.
    pub fn current() -> Holder {
        Holder {
            host: host_name(),
            pid: std::process::id(),
            program: std::env::args().next().unwrap_or_default(),
            since: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }
}

/// A UTC time as `YYYY-MM-DD HH:MM:SS UTC`.
pub(crate) fn utc(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (proleptic Gregorian calendar).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Tries an exclusive, non-blocking flock: `Ok(true)` taken, `Ok(false)` held elsewhere.
pub(crate) fn try_flock(f: &File) -> std::io::Result<bool> {
    loop {
        // SAFETY: flock on a file descriptor we own has no memory-safety preconditions.
        let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => return Ok(false),
            Some(libc::EINTR) => continue,
            _ => return Err(e),
        }
    }
}

/// The open, locked lock file of one folder.
#[derive(Debug)]
struct Inner {
    file: File,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Clear the identity before the kernel drops the lock with the descriptor, so the file
        // of a folder nobody holds names nobody. A crashed holder leaves its name; that is
        // harmless, as the name is only shown while the lock is held.
        let _ = self.file.set_len(0);
    }
}

fn registry() -> &'static Mutex<HashMap<PathBuf, Weak<Inner>>> {
    static HELD: OnceLock<Mutex<HashMap<PathBuf, Weak<Inner>>>> = OnceLock::new();
    HELD.get_or_init(Default::default)
}

/// A handle to this process's exclusive lock on a folder; the lock goes with the last handle.
#[derive(Debug, Clone)]
pub struct FolderLock {
    dir: PathBuf,
    _inner: Arc<Inner>,
}

impl FolderLock {
    /// Takes the lock on `dir` (which must exist), or returns an error naming the job that
    /// holds it. Never waits: two jobs writing one folder is a mistake to report, not to queue.
    pub fn acquire(dir: &Path) -> Result<FolderLock> {
        let key = dir.canonicalize().map_err(io_at("resolving", dir))?;
        let mut held = registry().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(inner) = held.get(&key).and_then(Weak::upgrade) {
            return Ok(FolderLock {
                dir: key,
                _inner: inner,
            });
        }
        let path = key.join(LOCK_FILE);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io_at("opening the lock file", &path))?;
        // A process checking whether the folder is free holds the lock for an instant, and a
        // holder that is exiting has cleared its name but not yet lost the lock: only a lock
        // that stays taken, or is taken by a named job, belongs to another job.
        let mut holder = None;
        let mut taken = false;
        'rounds: for _ in 0..10 {
            for _ in 0..25 {
                taken = try_flock(&file).map_err(|e| {
                    Error::io(
                        format!(
                            "locking {} (the file system must support flock so that two jobs \
                             cannot write one checkpoint folder)",
                            path.display()
                        ),
                        e,
                    )
                })?;
                if taken {
                    break 'rounds;
                }
                std::thread::sleep(Duration::from_millis(8));
            }
            holder = read_holder(&path);
            if holder.is_some() {
                break;
            }
        }
        if !taken {
            return Err(held_by_other(&key, holder));
        }
        let me = serde_json::to_vec(&Holder::current())?;
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| file.write_all(&me))
            .map_err(io_at("writing", &path))?;
        let inner = Arc::new(Inner { file });
        held.insert(key.clone(), Arc::downgrade(&inner));
        Ok(FolderLock {
            dir: key,
            _inner: inner,
        })
    }

    /// The locked folder (resolved).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether this process holds the lock on `dir`.
    pub fn held_here(dir: &Path) -> bool {
        let Ok(key) = dir.canonicalize() else {
            return false;
        };
        let held = registry().lock().unwrap_or_else(|p| p.into_inner());
        held.get(&key).is_some_and(|w| w.strong_count() > 0)
    }

    /// Whether another process holds the lock on `dir` right now (false when there is no lock
    /// file, or it cannot be inspected).
    pub fn held_elsewhere(dir: &Path) -> bool {
        if Self::held_here(dir) {
            return false;
        }
        let path = dir.join(LOCK_FILE);
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(f) => matches!(try_flock(&f), Ok(false)),
            Err(_) => false,
        }
    }

    /// Fails with the holder's identity when another process holds the lock on `dir`.
    pub fn check_free(dir: &Path) -> Result<()> {
        if !Self::held_elsewhere(dir) {
            return Ok(());
        }
        // The holder writes its name right after locking; give it a moment if it is empty.
        let lock_file = dir.join(LOCK_FILE);
        let mut holder = None;
        for _ in 0..20 {
            holder = read_holder(&lock_file);
            if holder.is_some() || !Self::held_elsewhere(dir) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        match holder {
            None if !Self::held_elsewhere(dir) => Ok(()),
            h => Err(held_by_other(dir, h)),
        }
    }
}

/// The identity written in a lock file, if it holds one.
fn read_holder(lock_file: &Path) -> Option<Holder> {
    let mut text = String::new();
    File::open(lock_file).ok()?.read_to_string(&mut text).ok()?;
    serde_json::from_str(&text).ok()
}

/// The error a second job gets: who holds the folder, since when, and what to do.
fn held_by_other(dir: &Path, holder: Option<Holder>) -> Error {
    let who = match holder {
        Some(h) => {
            let now = Holder::current().since;
            format!(
                "host {}, pid {} ({}), since {} ({} s ago)",
                h.host,
                h.pid,
                h.program,
                utc(h.since),
                now.saturating_sub(h.since)
            )
        }
        None => "a process that has not written its name yet".into(),
    };
    Error::checkpoint(
        dir,
        CheckpointErrorKind::Locked,
        format!(
            "is locked by another job that saves checkpoints here ({who}); two jobs writing \
             one checkpoint folder would destroy each other's checkpoints. Wait for that job to \
             finish or stop it, or give this run its own project_dir (the lock is released \
             automatically when its holder exits, even by a crash)"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_civil_utc() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_700_000_000), "2023-11-14 22:13:20 UTC");
    }

    #[test]
    fn handles_share_one_lock_and_release_it_with_the_last() {
        let dir = std::env::temp_dir().join(format!("ivme-lock-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = FolderLock::acquire(&dir).unwrap();
        let b = FolderLock::acquire(&dir).unwrap();
        assert!(FolderLock::held_here(&dir) && !FolderLock::held_elsewhere(&dir));
        // Another open file description conflicts, as another process's would.
        let f = File::open(dir.join(LOCK_FILE)).unwrap();
        assert!(!try_flock(&f).unwrap());
        let text = std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap();
        let h: Holder = serde_json::from_str(&text).unwrap();
        assert_eq!(h.pid, std::process::id());
        drop(a);
        assert!(!try_flock(&f).unwrap(), "b still holds it");
        drop(b);
        assert!(try_flock(&f).unwrap(), "released with the last handle");
        let e = held_by_other(&dir, read_holder(&dir.join(LOCK_FILE))).to_string();
        assert!(e.contains("project_dir"), "{e}");
        // `f` holds it now, as another job would: the refusal says it is a lock.
        let refused = FolderLock::check_free(&dir).unwrap_err();
        assert_eq!(
            refused.checkpoint_kind(),
            Some(crate::CheckpointErrorKind::Locked),
            "{refused}"
        );
        drop(f);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_holder_that_is_exiting_does_not_refuse_the_next_job() {
        // A holder that exits cleanly clears its name, then loses the lock when its process
        // ends; a job trying the folder in between must wait for the lock, not give up.
        let dir = std::env::temp_dir().join(format!("ivme-lock-exit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = File::create(dir.join(LOCK_FILE)).unwrap();
        assert!(try_flock(&f).unwrap());
        let exiting = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(400));
            drop(f);
        });
        let lock = FolderLock::acquire(&dir);
        exiting.join().unwrap();
        assert!(lock.is_ok(), "{:?}", lock.err());
        drop(lock);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
