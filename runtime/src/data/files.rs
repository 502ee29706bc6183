//! Fingerprints of the files a data set reads, kept with each loader's position in a
//! checkpoint, so a resume can tell that the data under it changed (a file appended to,
//! truncated, rewritten or swapped) instead of reading shifted or other samples.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// How many bytes at each end of a file the checksum covers: a checksum of the whole of a
/// large corpus would read it all at every start.
const ENDS: u64 = 64 << 10;

/// One file of a data set: where it was, its size, and a CRC-32 of its first and last 64 KiB
/// (the whole file when smaller). A size change or an edit near either end changes the
/// fingerprint; an edit in the middle of a large file that keeps its size does not.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct DataFile {
    /// The path it was opened by.
    pub path: String,
    /// Its size in bytes.
    pub size: u64,
    /// CRC-32 of its first and last 64 KiB.
    pub crc: u32,
}

impl DataFile {
    /// Fingerprints the open `file` found at `path`.
    pub fn of(path: &Path, file: &File) -> Result<DataFile> {
        let io = |e| {
            Error::io(
                format!("fingerprinting the data file {}", path.display()),
                e,
            )
        };
        let size = file.metadata().map_err(io)?.len();
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
        })
    }
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
}
