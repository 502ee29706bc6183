//! File-system steps that make saves durable: fsynced writes, atomic replacement and checksums.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Buffer large enough that tensor writes reach the kernel in big pieces.
const BUF: usize = 1 << 20;

pub(crate) fn io_at(what: &str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let context = format!("{what} {}", path.display());
    move |e| Error::io(context, e)
}

/// Flushes a folder's entries to disk, so a rename or a new file inside it survives a crash.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    let d = File::open(dir).map_err(io_at("opening folder", dir))?;
    d.sync_all().map_err(io_at("syncing folder", dir))
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
    let mut w = Hashing {
        inner: BufWriter::with_capacity(BUF, f),
        hasher: crc32fast::Hasher::new(),
        size: 0,
    };
    fill(&mut w)?;
    w.flush().map_err(io_at("writing", path))?;
    let f = w
        .inner
        .into_inner()
        .map_err(|e| Error::io(format!("writing {}", path.display()), e.into_error()))?;
    f.sync_all().map_err(io_at("syncing", path))?;
    Ok((w.size, w.hasher.finalize()))
}

/// Replaces `path` atomically: readers see the old file or the complete new one, never a mix.
pub(crate) fn write_atomic(path: &Path, fill: impl FnOnce(&mut Sink) -> Result<()>) -> Result<u64> {
    let dir = parent_of(path);
    let name = path
        .file_name()
        .ok_or_else(|| Error::Usage(format!("{} does not name a file", path.display())))?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    let size = match write_synced(&tmp, fill) {
        Ok((size, _)) => size,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    std::fs::rename(&tmp, path).map_err(io_at("renaming into place", path))?;
    sync_dir(&dir)?;
    Ok(size)
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
    let mut f = File::open(path).map_err(io_at("opening", path))?;
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
        std::fs::remove_dir_all(&aside).map_err(io_at("removing", &aside))?;
    }
    std::fs::rename(dir, &aside).map_err(io_at("moving aside", dir))?;
    sync_dir(&parent)?;
    std::fs::remove_dir_all(&aside).map_err(io_at("removing", &aside))
}
