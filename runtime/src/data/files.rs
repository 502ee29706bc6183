//! Fingerprints of the files a data set reads, kept with each loader's position in a
//! checkpoint, so a resume can tell that the data under it changed (a file appended to,
//! truncated, rewritten, edited anywhere or swapped) instead of reading shifted or other samples.
//!
//! A fingerprint is the file's size, a CRC-32 of its ends, and an xxh3-64 hash of every byte.
//! Hashing a whole corpus at every start would cost a read of it, so the hash is cached beside
//! the file (`<file>.ivme-hash`), keyed by what changes cheaply whenever the file does: its size,
//! modification and change times and inode. Putting the modification time back after an edit
//! does not fool it: the change time (`ctime`) cannot be set back, so the hash is computed again.
//! A folder that cannot take the cache keeps the hash in memory only.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::hash::Hasher as _;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

/// How many bytes at each end of a file the checksum covers: a checksum of the whole of a
/// large corpus would read it all at every start.
const ENDS: u64 = 64 << 10;

/// One file of a data set: where it was, its size, a CRC-32 of its first and last 64 KiB (the
/// whole file when smaller) and a hash of every byte. Any change to the file's bytes changes
/// the fingerprint; a move does not.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct DataFile {
    /// The path it was opened by.
    pub path: String,
    /// Its size in bytes.
    pub size: u64,
    /// CRC-32 of its first and last 64 KiB.
    pub crc: u32,
    /// `xxh3:` and the xxh3-64 hash of every byte, in hex (absent in checkpoints written
    /// before it existed, which compare size and ends only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

impl DataFile {
    /// The cheap part of a fingerprint of the open `file` found at `path`: its size and the
    /// CRC-32 of its first and last 64 KiB, without the content hash (which reads it whole).
    pub(crate) fn ends(path: &Path, file: &File) -> Result<DataFile> {
        let io = |e| {
            Error::io(
                format!("fingerprinting the data file {}", path.display()),
                e,
            )
        };
        let meta = file.metadata().map_err(io)?;
        let size = meta.len();
        let mut hasher = crc32fast::Hasher::new();
        let mut read = |from: u64, len: u64| -> Result<()> {
            let mut buf = vec![0u8; len as usize];
            file.read_exact_at(&mut buf, from).map_err(io)?;
            hasher.update(&buf);
            Ok(())
        };
        if size <= 2 * ENDS {
            read(0, size)?;
        } else {
            read(0, ENDS)?;
            read(size - ENDS, ENDS)?;
        }
        Ok(DataFile {
            path: path.display().to_string(),
            size,
            crc: hasher.finalize(),
            content: None,
        })
    }

    /// Fingerprints the open `file` found at `path`: its size, the CRC-32 of its ends and the
    /// hash of every byte (from the cache beside it when that still describes the file).
    pub fn of(path: &Path, file: &File) -> Result<DataFile> {
        let ends = DataFile::ends(path, file)?;
        let meta = file.metadata().map_err(|e| {
            Error::io(
                format!("fingerprinting the data file {}", path.display()),
                e,
            )
        })?;
        Ok(DataFile {
            content: Some(content_hash(path, file, &meta)?),
            ..ends
        })
    }
}

/// What the cached hash of a file was computed under: anything that changes when the file's
/// bytes do (a write moves `ctime`, which no call can set back; a replaced file has another
/// inode).
#[derive(Debug, PartialEq, Eq)]
struct Stamp([i64; 6]);

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Stamp {
        Stamp([
            meta.len() as i64,
            meta.mtime(),
            meta.mtime_nsec(),
            meta.ctime(),
            meta.ctime_nsec(),
            meta.ino() as i64,
        ])
    }

    fn line(&self) -> String {
        self.0.map(|v| v.to_string()).join(" ")
    }
}

/// Where the hash of `path` is cached.
pub(crate) fn hash_cache_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".ivme-hash");
    PathBuf::from(name)
}

/// The xxh3-64 hash of every byte of `file` (`xxh3:` and 16 hex digits), from its cache when
/// the cache was written under the file's current stamp, else read whole and cached.
fn content_hash(path: &Path, file: &File, meta: &std::fs::Metadata) -> Result<String> {
    let stamp = Stamp::of(meta);
    let cache = hash_cache_path(path);
    if let Ok(text) = std::fs::read_to_string(&cache) {
        if let Some((line, hash)) = text.trim_end().split_once('\n') {
            if line == stamp.line() && hash.starts_with("xxh3:") {
                return Ok(hash.to_string());
            }
        }
    }
    let hash = hash_all(path, file, meta.len())?;
    // Atomically (a temporary file renamed into place); a folder that cannot take it keeps
    // the hash in memory only.
    let mut tmp = cache.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let text = format!("{}\n{hash}\n", stamp.line());
    if std::fs::write(&tmp, text).is_ok() && std::fs::rename(&tmp, &cache).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    Ok(hash)
}

/// Reads `file` (`size` bytes) whole through the hash.
fn hash_all(path: &Path, file: &File, size: u64) -> Result<String> {
    let mut hasher = twox_hash::XxHash3_64::new();
    let mut buf = vec![0u8; (4 << 20).min(size as usize).max(1)];
    let mut at = 0u64;
    while at < size {
        let n = (size - at).min(buf.len() as u64) as usize;
        file.read_exact_at(&mut buf[..n], at)
            .map_err(|e| Error::io(format!("hashing the data file {}", path.display()), e))?;
        hasher.write(&buf[..n]);
        at += n as u64;
    }
    Ok(format!("xxh3:{:016x}", hasher.finish()))
}

/// Checks that the files a checkpoint's loader read (`saved`) are the files this loader reads
/// (`now`), in order: the same count, and each of the same size and checksum (a file may have
/// moved). The error names the file and what differs.
pub(crate) fn same_files(saved: &[DataFile], now: &[DataFile]) -> std::result::Result<(), String> {
    let list = |files: &[DataFile]| {
        files
            .iter()
            .map(|f| f.path.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if saved.len() != now.len() {
        return Err(format!(
            "the checkpoint's data loader read {} file(s) ({}), this one reads {} ({}); resume \
             with the data the run was trained on, or start a new run",
            saved.len(),
            list(saved),
            now.len(),
            list(now)
        ));
    }
    for (s, n) in saved.iter().zip(now) {
        let what = if s.size != n.size {
            format!(
                "it holds {} bytes, {} when the checkpoint was taken",
                n.size, s.size
            )
        } else if s.crc != n.crc {
            "its bytes differ from those the checkpoint was trained on (same size, other checksum)"
                .to_string()
        } else if let (Some(a), Some(b)) = (&s.content, &n.content) {
            if a == b {
                continue;
            }
            format!(
                "its bytes differ from those the checkpoint was trained on (same size and ends, \
                 content hash {b}, {a} when the checkpoint was taken)"
            )
        } else {
            continue;
        };
        let moved = match s.path == n.path {
            true => String::new(),
            false => format!(" (then at {})", s.path),
        };
        return Err(format!(
            "the data file {}{moved} changed since the checkpoint was taken: {what}; the saved \
             position would read other samples. Resume with the data the run was trained on, \
             or start a new run",
            n.path
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn print(dir: &Path, name: &str, bytes: &[u8]) -> DataFile {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        DataFile::of(&path, &File::open(&path).unwrap()).unwrap()
    }

    #[test]
    fn a_fingerprint_sees_size_and_end_changes_but_not_a_move() {
        let dir = std::env::temp_dir().join(format!("ivme-datafile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let big: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let a = print(&dir, "a.bin", &big);
        let moved = print(&dir, "moved.bin", &big);
        assert_eq!((a.size, a.crc), (moved.size, moved.crc));
        assert!(same_files(std::slice::from_ref(&a), &[moved]).is_ok());
        let mut tail = big.clone();
        *tail.last_mut().unwrap() ^= 1;
        let t = print(&dir, "a.bin", &tail);
        let e = same_files(std::slice::from_ref(&a), &[t]).unwrap_err();
        assert!(
            e.contains("a.bin changed") && e.contains("same size"),
            "{e}"
        );
        let mut longer = big.clone();
        longer.push(0);
        let l = print(&dir, "a.bin", &longer);
        let e = same_files(std::slice::from_ref(&a), &[l]).unwrap_err();
        assert!(e.contains("holds 300001 bytes, 300000 when"), "{e}");
        let e = same_files(&[a.clone(), a.clone()], &[a]).unwrap_err();
        assert!(e.contains("read 2 file(s)"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_fingerprint_without_a_content_hash_compares_size_and_ends() {
        // As checkpoints written before the content hash saved it.
        let old: DataFile = serde_json::from_str(r#"{"path":"a.bin","size":10,"crc":7}"#).unwrap();
        assert_eq!(old.content, None);
        let now = DataFile {
            content: Some("xxh3:0000000000000001".into()),
            ..old.clone()
        };
        assert!(same_files(std::slice::from_ref(&old), std::slice::from_ref(&now)).is_ok());
        let other = DataFile {
            content: Some("xxh3:0000000000000002".into()),
            ..old.clone()
        };
        let e = same_files(&[now], &[other]).unwrap_err();
        assert!(e.contains("content hash xxh3:0000000000000002"), "{e}");
    }
}
