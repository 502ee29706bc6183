//! File-system steps that make saves durable: fsynced writes, atomic replacement and checksums.

use std::fs::{File, FileType};
use std::io::{BufWriter, Read, Write};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::faults::crash_point;
use crate::error::{io_at, CheckpointErrorKind, Error, Result};

/// Buffer large enough that tensor writes reach the kernel in big pieces.
const BUF: usize = 1 << 20;

/// Flushes a folder's entries to disk, so a rename or a new file inside it survives a crash.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    let d = File::open(dir).map_err(io_at("opening folder", dir))?;
    d.sync_all().map_err(io_at("syncing folder", dir))?;
    crash_point(&format!("synced folder {}", dir.display()));
    Ok(())
}

/// What a non-regular file is, in words for an error message.
pub(crate) fn kind_name(t: FileType) -> &'static str {
    if t.is_symlink() {
        "a symbolic link"
    } else if t.is_dir() {
        "a folder"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else if t.is_file() {
        "a regular file"
    } else {
        "not a regular file"
    }
}

fn not_regular(path: &Path, t: FileType) -> Error {
    Error::checkpoint(
        path,
        CheckpointErrorKind::Damaged,
        format!(
            "is {}, not a regular file; checkpoint and model folders hold only regular files: \
             remove it or replace it with the file it stands for",
            kind_name(t)
        ),
    )
}

/// Opens `path` for reading only if it is a regular file, without ever blocking on a FIFO or a
/// device (it is opened non-blocking and checked before any read). With `follow_links` false a
/// symbolic link is refused too; with it true the link's target must be a regular file.
pub(crate) fn open_regular(path: &Path, follow_links: bool) -> Result<File> {
    #[cfg(test)]
    opened::record(path);
    if !follow_links {
        let meta = std::fs::symlink_metadata(path).map_err(io_at("inspecting", path))?;
        if !meta.file_type().is_file() {
            return Err(not_regular(path, meta.file_type()));
        }
    }
    let mut flags = libc::O_NONBLOCK | libc::O_NOCTTY;
    if !follow_links {
        flags |= libc::O_NOFOLLOW;
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
        .map_err(io_at("opening", path))?;
    let t = f.metadata().map_err(io_at("inspecting", path))?.file_type();
    if !t.is_file() {
        return Err(not_regular(path, t));
    }
    Ok(f)
}

/// Counts of the files [`open_regular`] opened, by path, so tests can check how often a load
/// reads each file (every read in the checkpoint code opens through it).
#[cfg(test)]
pub(crate) mod opened {
    use std::collections::HashMap;
    use std::path::{Path, PathBuf};
    use std::sync::Mutex;

    static COUNTS: Mutex<Option<HashMap<PathBuf, usize>>> = Mutex::new(None);

    pub(crate) fn record(path: &Path) {
        let mut counts = COUNTS.lock().unwrap_or_else(|p| p.into_inner());
        *counts
            .get_or_insert_with(HashMap::new)
            .entry(path.to_path_buf())
            .or_default() += 1;
    }

    /// How many times each file under `dir` was opened, and forgets them.
    pub(crate) fn take_under(dir: &Path) -> HashMap<PathBuf, usize> {
        let mut counts = COUNTS.lock().unwrap_or_else(|p| p.into_inner());
        let all = counts.get_or_insert_with(HashMap::new);
        let mine: Vec<PathBuf> = all.keys().filter(|p| p.starts_with(dir)).cloned().collect();
        mine.into_iter()
            .filter_map(|p| all.remove_entry(&p))
            .collect()
    }
}

/// Reads a whole regular file (see [`open_regular`]).
pub(crate) fn read_regular(path: &Path, follow_links: bool) -> Result<Vec<u8>> {
    let mut f = open_regular(path, follow_links)?;
    let mut out = Vec::new();
    f.read_to_end(&mut out).map_err(io_at("reading", path))?;
    Ok(out)
}

/// Renames `from` to `to` only if nothing is at `to` (never replacing or merging into what a
/// concurrent writer put there); an existing `to` is an error of kind `AlreadyExists`.
pub(crate) fn rename_noreplace(from: &Path, to: &Path) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::ffi::CString;
        use std::os::unix::ffi::OsStrExt;
        let c = |p: &Path| {
            CString::new(p.as_os_str().as_bytes())
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
        };
        let (a, b) = (c(from)?, c(to)?);
        // SAFETY: both pointers are valid NUL-terminated strings for the duration of the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_renameat2,
                libc::AT_FDCWD,
                a.as_ptr(),
                libc::AT_FDCWD,
                b.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            // Kernels or file systems without RENAME_NOREPLACE: fall through to the check below.
            Some(libc::ENOSYS) | Some(libc::EINVAL) => {}
            _ => return Err(e),
        }
    }
    if std::fs::symlink_metadata(to).is_ok() {
        return Err(std::io::Error::from(std::io::ErrorKind::AlreadyExists));
    }
    // A folder appearing between the check and the rename makes rename fail (ENOTEMPTY) unless
    // it is empty, and an empty folder is not a checkpoint: nothing is ever merged.
    std::fs::rename(from, to)
}

/// Puts the file's name into an I/O error that does not name it yet (a full disk while a
/// tensor was being written says which file).
fn naming(path: &Path, e: Error) -> Error {
    match e {
        Error::Io { context, source } if !context.contains(&path.display().to_string()) => {
            Error::io(format!("{context} into {}", path.display()), source)
        }
        other => other,
    }
}

/// A writer that checksums and counts what passes through it, so a file's CRC is known
/// without reading it back.
pub(crate) struct Hashing<W> {
    inner: W,
    hasher: crc32fast::Hasher,
    size: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.size += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Where [`write_synced`] lets its caller write.
pub(crate) type Sink = Hashing<BufWriter<File>>;

/// Creates (or truncates) `path`, lets `fill` write it, then fsyncs it; returns the size and
/// CRC-32 of what was written.
pub(crate) fn write_synced(
    path: &Path,
    fill: impl FnOnce(&mut Sink) -> Result<()>,
) -> Result<(u64, u32)> {
    let f = File::create(path).map_err(io_at("creating", path))?;
    crash_point(&format!("created {}", path.display()));
    let mut w = Hashing {
        inner: BufWriter::with_capacity(BUF, f),
        hasher: crc32fast::Hasher::new(),
        size: 0,
    };
    fill(&mut w).map_err(|e| naming(path, e))?;
    w.flush().map_err(io_at("writing", path))?;
    let f = w
        .inner
        .into_inner()
        .map_err(|e| Error::io(format!("writing {}", path.display()), e.into_error()))?;
    crash_point(&format!("written {}", path.display()));
    f.sync_all().map_err(io_at("syncing", path))?;
    crash_point(&format!("synced {}", path.display()));
    Ok((w.size, w.hasher.finalize()))
}

/// Files written beside their final names and renamed into place only once every one of them
/// is written and fsynced, so a failed write (a full disk) replaces nothing: readers see the
/// old files or the new ones. Temporary files left by an error are removed on drop.
#[derive(Default)]
pub(crate) struct Staged {
    pending: Vec<(PathBuf, PathBuf)>,
}

impl Staged {
    /// Writes what will become `path`; returns its size.
    pub(crate) fn write(
        &mut self,
        path: &Path,
        fill: impl FnOnce(&mut Sink) -> Result<()>,
    ) -> Result<u64> {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let name = path
            .file_name()
            .ok_or_else(|| Error::Usage(format!("{} does not name a file", path.display())))?;
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = parent_of(path).join(format!(
            ".{}.{}-{n}.tmp",
            name.to_string_lossy(),
            std::process::id()
        ));
        // Registered first, so a failed write's partial file is removed too.
        self.pending.push((tmp.clone(), path.to_path_buf()));
        let (size, _) = write_synced(&tmp, fill)?;
        Ok(size)
    }

    /// Renames every written file into place, in the order written, and syncs their folders.
    pub(crate) fn commit(mut self) -> Result<()> {
        let mut dirs = Vec::new();
        for (tmp, path) in std::mem::take(&mut self.pending) {
            std::fs::rename(&tmp, &path).map_err(io_at("renaming into place", &path))?;
            let dir = parent_of(&path);
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
        for d in dirs {
            sync_dir(&d)?;
        }
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        for (tmp, _) in &self.pending {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// The folder holding `path` (`.` for a bare file name).
pub(crate) fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Size and CRC-32 of a file, streamed so memory stays flat for large files.
pub(crate) fn size_and_crc(path: &Path) -> Result<(u64, u32)> {
    size_and_crc_of(path, false)
}

/// [`size_and_crc`], also through a symbolic link to a regular file when `follow_links` (a
/// Hugging Face cache's snapshot folders are links to its blobs).
pub(crate) fn size_and_crc_of(path: &Path, follow_links: bool) -> Result<(u64, u32)> {
    let mut f = open_regular(path, follow_links)?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; BUF];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(io_at("reading", path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((size, hasher.finalize()))
}

/// Removes a folder by first renaming it aside, so a crash mid-delete never leaves a half
/// folder under its old name (the aside name is one that cleanup recognises).
pub(crate) fn remove_dir_atomic(dir: &Path) -> Result<()> {
    let parent = parent_of(dir);
    let name = dir
        .file_name()
        .ok_or_else(|| Error::Usage(format!("{} does not name a folder", dir.display())))?;
    let aside = parent.join(format!(".{}.del", name.to_string_lossy()));
    if aside.exists() {
        remove_tree(&aside)?;
    }
    std::fs::rename(dir, &aside).map_err(io_at("moving aside", dir))?;
    crash_point(&format!("moved aside {}", dir.display()));
    sync_dir(&parent)?;
    remove_tree(&aside)?;
    crash_point(&format!("removed {}", dir.display()));
    Ok(())
}

/// Removes a folder tree; one that is already gone (another cleaner got there first) is fine.
pub(crate) fn remove_tree(dir: &Path) -> Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(Error::io(format!("removing {}", dir.display()), e))
        }
        _ => Ok(()),
    }
}
