//! Temporary folders of saves in progress: a unique name per save, a claim that shows the save
//! is alive, and recovery of what crashed saves leave behind.
//!
//! A save of `parent/name` is written into `parent/.name.save-<host>-<pid>-<time>-<n>.tmp`.
//! Before creating that folder the saving process creates `parent/.name.save-<...>.claim` and
//! holds a `flock` on it until the save is committed or abandoned. The kernel drops the flock
//! when the process dies, so a temporary folder whose claim can be locked belongs to a dead
//! save, and one whose claim cannot be locked is never touched by anyone else.
//!
//! [`clean_stale`] finishes dead saves that had written a verified manifest (renames them into
//! place, never over an existing folder) and removes incomplete ones, but removes only when no
//! other live job holds the folder's [lock](super::lock).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use super::faults::crash_point;
use super::format::bad;
use super::fsio::{parent_of, remove_tree, rename_noreplace, sync_dir};
use super::lock::{try_flock, FolderLock, Holder};
use super::manifest::verify;
use crate::error::io_at;
use crate::error::{Error, Result};
use crate::setup::state::host_name;

const SAVE_TAG: &str = ".save-";

/// What a dot-name in a checkpoints parent folder is.
#[derive(Debug, PartialEq, Eq)]
enum Entry {
    /// `.name.save-TAG.tmp`: a save's temporary folder (claimed), for `name`.
    Temp { stem: String, base: String },
    /// `.name.save-TAG.claim`: a save's claim file.
    Claim { base: String },
    /// `.name.tmp`: the temporary folder of a save by an older ivme (never claimed).
    LegacyTemp { stem: String },
    /// `.name.del`: a folder moved aside to be deleted.
    Deleted,
}

fn classify(file_name: &str) -> Option<Entry> {
    let rest = file_name.strip_prefix('.')?;
    if let Some(base) = rest.strip_suffix(".tmp") {
        return Some(match base.rsplit_once(SAVE_TAG) {
            Some((stem, tag)) if !stem.is_empty() && !tag.is_empty() => Entry::Temp {
                stem: stem.into(),
                base: base.into(),
            },
            _ if !base.is_empty() => Entry::LegacyTemp { stem: base.into() },
            _ => return None,
        });
    }
    if let Some(base) = rest.strip_suffix(".claim") {
        return base
            .contains(SAVE_TAG)
            .then(|| Entry::Claim { base: base.into() });
    }
    rest.strip_suffix(".del")
        .filter(|b| !b.is_empty())
        .map(|_| Entry::Deleted)
}

/// The checkpoint name a temporary folder made by [`begin`] will be renamed to.
pub(crate) fn target_of(tmp: &Path) -> Option<PathBuf> {
    let name = tmp.file_name()?.to_str()?;
    match classify(name)? {
        Entry::Temp { stem, .. } | Entry::LegacyTemp { stem } => Some(parent_of(tmp).join(stem)),
        _ => None,
    }
}

fn claim_path_of(tmp: &Path) -> Option<PathBuf> {
    let name = tmp.file_name()?.to_str()?;
    let base = name.strip_prefix('.')?.strip_suffix(".tmp")?;
    base.contains(SAVE_TAG)
        .then(|| parent_of(tmp).join(format!(".{base}.claim")))
}

fn claims() -> &'static Mutex<HashMap<PathBuf, File>> {
    static HELD: OnceLock<Mutex<HashMap<PathBuf, File>>> = OnceLock::new();
    HELD.get_or_init(Default::default)
}

/// A tag no other save, on this host or another, can pick: host, pid, time and a counter.
fn unique_tag() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let host: String = host_name()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(32)
        .collect();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{host}-{}-{nanos:x}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Creates and locks a fresh claim file; `None` when the name was taken (try another).
fn claim(path: &Path) -> Result<Option<File>> {
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(None),
        Err(e) => return Err(Error::io(format!("creating {}", path.display()), e)),
    };
    if !try_flock(&f).map_err(io_at("locking", path))? {
        // A cleaner is looking at it this very moment; leave it to them and pick another name.
        return Ok(None);
    }
    // A cleaner may have removed the file between our create and our lock; then the lock
    // guards nothing and we start over under another name.
    let (ours, now) = (
        f.metadata().map_err(io_at("inspecting", path))?,
        std::fs::symlink_metadata(path),
    );
    match now {
        Ok(m) if m.ino() == ours.ino() && m.dev() == ours.dev() => {}
        _ => return Ok(None),
    }
    let _ = serde_json::to_writer(&f, &Holder::current());
    Ok(Some(f))
}

/// Starts a save of `final_dir`: creates a claimed temporary sibling under a name unique to
/// this save and returns it. The main process calls it once per save and hands the path to
/// the other ranks; each then calls `write_rank` into it.
///
/// The claim is held until [`commit`](super::store::commit) or [`abandon`] (or the process
/// ends), so no cleaner, in this or another job, removes a save that is still alive.
pub fn begin(final_dir: &Path) -> Result<PathBuf> {
    let name = final_dir
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| !n.starts_with('.'))
        .ok_or_else(|| {
            Error::Usage(format!(
                "{} does not name a checkpoint folder (use a plain UTF-8 name not starting with `.`)",
                final_dir.display()
            ))
        })?;
    let parent = parent_of(final_dir);
    std::fs::create_dir_all(&parent).map_err(io_at("creating", &parent))?;
    for _ in 0..16 {
        let base = format!("{name}{SAVE_TAG}{}", unique_tag());
        let claim_path = parent.join(format!(".{base}.claim"));
        let Some(file) = claim(&claim_path)? else {
            continue;
        };
        crash_point(&format!("claimed {}", claim_path.display()));
        let tmp = parent.join(format!(".{base}.tmp"));
        if let Err(e) = std::fs::create_dir(&tmp) {
            let _ = std::fs::remove_file(&claim_path);
            return Err(Error::io(format!("creating {}", tmp.display()), e));
        }
        crash_point(&format!("created folder {}", tmp.display()));
        claims()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(tmp.clone(), file);
        return Ok(tmp);
    }
    Err(bad(
        &parent,
        "could not create a uniquely named temporary folder for the save; is something \
         else creating files here?",
    ))
}

/// Drops this process's claim on a temporary folder, removing the claim file.
pub(crate) fn release(tmp: &Path) {
    let held = claims()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(tmp);
    if let (Some(_file), Some(path)) = (held, claim_path_of(tmp)) {
        // Removed while still locked, so no cleaner can mistake it for a dead save's claim.
        let _ = std::fs::remove_file(path);
    }
}

/// Gives up a save: removes its temporary folder and its claim. Checkpoints already committed
/// are untouched.
pub fn abandon(tmp: &Path) -> Result<()> {
    let gone = remove_tree(tmp);
    release(tmp);
    gone
}

/// Whether a live save (in any process, this one included) holds the claim of `base`.
fn claimed(parent: &Path, base: &str) -> bool {
    let path = parent.join(format!(".{base}.claim"));
    if claims()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains_key(&parent.join(format!(".{base}.tmp")))
    {
        return true;
    }
    match File::open(&path) {
        // Locking it proves the holder is gone; the descriptor (and lock) close right away.
        Ok(f) => !try_flock(&f).unwrap_or(false),
        Err(_) => false,
    }
}

/// What [`clean_stale`] did in a folder.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cleaned {
    /// Temporary folders of crashed saves (and folders moved aside) that were deleted.
    pub removed: Vec<PathBuf>,
    /// Saves that crashed after writing a verified manifest but before their rename, now
    /// renamed into place.
    pub recovered: Vec<PathBuf>,
    /// Leftovers that could not be removed because another live job holds the folder.
    pub kept: Vec<PathBuf>,
}

/// Finishes the saves in `parent` that crashed between writing a verified manifest and their
/// rename, and removes the temporary folders of saves that crashed earlier.
///
/// Saves still in progress (claimed) are never touched. A finished save is renamed into place
/// only where nothing has that name; removals happen only when no other live job holds the
/// folder's lock (otherwise they are listed in `kept`). Call it before choosing the next
/// automatic name and before picking the latest checkpoint.
pub fn clean_stale(parent: &Path) -> Result<Cleaned> {
    let mut done = Cleaned::default();
    if !parent.is_dir() {
        return Ok(done);
    }
    // Claims protect every live save; the folder lock is the policy on top: a folder another
    // live job holds is that job's to clean.
    let may_remove = !FolderLock::held_elsewhere(parent);
    let mut names: Vec<String> = Vec::new();
    for entry in std::fs::read_dir(parent).map_err(io_at("listing", parent))? {
        let entry = entry.map_err(io_at("listing", parent))?;
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    for name in &names {
        let path = parent.join(name);
        let stem = match classify(name) {
            Some(Entry::Temp { base, .. }) if claimed(parent, &base) => continue,
            Some(Entry::Temp { stem, .. }) | Some(Entry::LegacyTemp { stem }) => Some(stem),
            Some(Entry::Deleted) => None,
            Some(Entry::Claim { .. }) | None => continue,
        };
        // A link under a temporary name is not a save of ours: leave it alone.
        if !std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
            continue;
        }
        if let Some(stem) = stem {
            if verify(&path).is_ok() {
                match rename_noreplace(&path, &parent.join(&stem)) {
                    Ok(()) => {
                        crash_point(&format!("recovered {}", path.display()));
                        done.recovered.push(parent.join(stem));
                        continue;
                    }
                    // The name is taken: this copy is a duplicate to remove.
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                    Err(e) => {
                        return Err(Error::io(
                            format!("renaming {} into place", path.display()),
                            e,
                        ))
                    }
                }
            }
        }
        if !may_remove {
            done.kept.push(path);
            continue;
        }
        remove_tree(&path)?;
        crash_point(&format!("removed stale {}", path.display()));
        done.removed.push(path);
    }
    // Claims whose save is gone (committed, recovered or removed) and whose holder is dead.
    for name in &names {
        if let Some(Entry::Claim { base }) = classify(name) {
            let tmp = parent.join(format!(".{base}.tmp"));
            if may_remove && !tmp.exists() && !claimed(parent, &base) {
                let _ = std::fs::remove_file(parent.join(name));
            }
        }
    }
    if !done.removed.is_empty() || !done.recovered.is_empty() {
        sync_dir(parent)?;
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_classified() {
        let t = classify(".checkpoint_3.save-h-1-ff-0.tmp").unwrap();
        assert_eq!(
            t,
            Entry::Temp {
                stem: "checkpoint_3".into(),
                base: "checkpoint_3.save-h-1-ff-0".into()
            }
        );
        assert_eq!(
            classify(".a.b.tmp"),
            Some(Entry::LegacyTemp { stem: "a.b".into() })
        );
        assert!(matches!(
            classify(".x.save-t.claim"),
            Some(Entry::Claim { .. })
        ));
        assert_eq!(classify(".checkpoint_1.del"), Some(Entry::Deleted));
        assert_eq!(classify("checkpoint_1"), None);
        assert_eq!(classify(".ivme-lock"), None);
        assert_eq!(classify(".tmp"), None);
        assert_eq!(
            target_of(Path::new("/p/.state.save-h-1-2-3.tmp")),
            Some(PathBuf::from("/p/state"))
        );
    }

    #[test]
    fn every_save_gets_its_own_claimed_folder() {
        let dir = std::env::temp_dir().join(format!("ivme-staging-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = begin(&dir.join("ck")).unwrap();
        let b = begin(&dir.join("ck")).unwrap();
        assert_ne!(a, b);
        let cleaned = clean_stale(&dir).unwrap();
        assert!(
            a.is_dir() && b.is_dir(),
            "claimed saves are left alone: {cleaned:?}"
        );
        abandon(&a).unwrap();
        assert!(!a.exists() && !claim_path_of(&a).unwrap().exists());
        // A dead save: its claim is no longer locked by anyone.
        claims().lock().unwrap().remove(&b);
        let cleaned = clean_stale(&dir).unwrap();
        assert_eq!(cleaned.removed, vec![b.clone()]);
        let left = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(left, 0, "the dead save's claim went with its folder");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
