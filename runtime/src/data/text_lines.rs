//! Text and JSONL files on disk, one sample per line, read line by line, never whole: a line
//! index (the byte offset where each line starts) is built once per file and cached beside it.

use super::{DataFile, Dataset};
use crate::error::io_at;
use crate::{Error, Result};
use candle_core::Device;
use std::fs::File;
use std::io::{BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

/// The first bytes of a line index file, and its layout version.
const MAGIC: &[u8; 8] = b"IVMELIX2";

/// The header: magic, file size, modification time (ns), checksum of the file's ends (as
/// [`DataFile`] takes it, in 8 bytes), line count.
const HEADER: usize = 8 + 8 + 16 + 8 + 8;

/// One file's lines.
#[derive(Debug)]
struct Part {
    path: PathBuf,
    file: File,
    /// Where each line starts, then the file's size.
    starts: Vec<u64>,
    /// Samples before this file's first one.
    first: usize,
    /// With blank lines skipped, the (0-based) numbers of the lines that are samples.
    kept: Option<Vec<u64>>,
}

/// The lines of one or more text files (JSONL included) as samples: sample `i` is line `i`
/// (counted over the files in order) without its line ending, as a `String`; batches are
/// `Vec<String>`, for the program to tokenize or parse.
///
/// Opening a file finds where each line starts once and caches that in `FILE.ivme-lines`
/// beside it (written atomically; kept in memory only when the folder is read-only). The cache
/// is used while the file keeps its size, its modification time (to the nanosecond) and the
/// checksum of its first and last 64 KiB, and is rebuilt when any changed or the cache is
/// damaged. Each line is read with one positioned
/// read when a batch asks for it. A
/// [`DataLoader`](super::DataLoader) over it shuffles, shards across processes and resumes
/// exactly, as for data in memory.
///
/// ```no_run
/// # fn main() -> ivme::Result<()> {
/// use ivme::data::{DataLoader, TextLines};
/// let corpus = TextLines::open(&["data/train.jsonl"])?;
/// let mut loader = DataLoader::new(corpus, 32).shuffle(true);
/// for batch in loader.iter() {
///     let lines: Vec<String> = batch?;
///     // serde_json::from_str(&lines[0]), tokenize, ...
/// #   let _ = lines;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct TextLines {
    parts: Vec<Part>,
    len: usize,
}

impl TextLines {
    /// Opens `paths` in order as one data set of lines; an empty last line (a file ending in
    /// a newline) is not a sample, an empty line in the middle is.
    pub fn open<P: AsRef<Path>>(paths: &[P]) -> Result<TextLines> {
        if paths.is_empty() {
            return Err(Error::Usage(
                "TextLines::open needs at least one file".into(),
            ));
        }
        let mut parts = Vec::with_capacity(paths.len());
        let mut len = 0;
        for p in paths {
            let path = p.as_ref().to_path_buf();
            let file = File::open(&path).map_err(io_at("opening", &path))?;
            let starts = line_index(&path, &file)?;
            let lines = starts.len() - 1;
            parts.push(Part {
                path,
                file,
                starts,
                first: len,
                kept: None,
            });
            len += lines;
        }
        Ok(TextLines { parts, len })
    }

    /// The cache file of `path`'s line index.
    pub fn index_path(path: &Path) -> PathBuf {
        let mut name = path.as_os_str().to_owned();
        name.push(".ivme-lines");
        PathBuf::from(name)
    }

    /// The same lines without the blank ones (empty, or only spaces, tabs and a `\r`) when
    /// `skip` is true: they are then never samples, and sample numbers count the others.
    /// Off by default (every line but an empty last one is a sample); finding them reads
    /// each file once more when they are skipped.
    pub fn skip_blank_lines(mut self, skip: bool) -> Result<TextLines> {
        let mut len = 0;
        for part in &mut self.parts {
            part.first = len;
            part.kept = match skip {
                true => Some(non_blank(&part.file, &part.path, &part.starts)?),
                false => None,
            };
            len += part.kept.as_ref().map_or(part.starts.len() - 1, Vec::len);
        }
        self.len = len;
        Ok(self)
    }

    /// Where sample `index` comes from: its file, its 1-based line in that file and the byte
    /// offset its line starts at, so that a program's own error can name it.
    pub fn origin(&self, index: usize) -> Result<(&Path, usize, u64)> {
        let (part, line) = self.locate(index)?;
        Ok((&part.path, line + 1, part.starts[line]))
    }

    /// The file and the 0-based line of sample `index`.
    fn locate(&self, index: usize) -> Result<(&Part, usize)> {
        if index >= self.len {
            return Err(Error::Usage(format!(
                "line {index} is past the end ({} lines)",
                self.len
            )));
        }
        let k = self.parts.partition_point(|p| p.first <= index) - 1;
        let part = &self.parts[k];
        let at = index - part.first;
        let line = part.kept.as_ref().map_or(at, |kept| kept[at] as usize);
        Ok((part, line))
    }
}

/// The numbers of the lines of `file` (which start at `starts`) that hold more than blanks,
/// read in one pass.
fn non_blank(file: &File, path: &Path, starts: &[u64]) -> Result<Vec<u64>> {
    let size = *starts.last().unwrap_or(&0);
    let mut buf = vec![0u8; (1 << 20).min(size as usize).max(1)];
    let (mut kept, mut line, mut at, mut filled) = (Vec::new(), 0usize, 0u64, false);
    let lines = starts.len() - 1;
    // Positioned reads: the file's own offset is shared with whoever read it before.
    while at < size {
        let n = (size - at).min(buf.len() as u64) as usize;
        file.read_exact_at(&mut buf[..n], at)
            .map_err(io_at("reading", path))?;
        for &b in &buf[..n] {
            while line < lines && at >= starts[line + 1] {
                if filled {
                    kept.push(line as u64);
                }
                (line, filled) = (line + 1, false);
            }
            filled |= !matches!(b, b' ' | b'\t' | b'\r' | b'\n');
            at += 1;
        }
    }
    if line < lines && filled {
        kept.push(line as u64);
    }
    Ok(kept)
}

impl Dataset for TextLines {
    type Item = String;
    type Batch = Vec<String>;

    fn len(&self) -> usize {
        self.len
    }

    fn files(&self) -> Result<Vec<DataFile>> {
        self.parts
            .iter()
            .map(|p| DataFile::of(&p.path, &p.file))
            .collect()
    }

    fn get(&self, index: usize) -> Result<String> {
        let (part, line) = self.locate(index)?;
        let (start, end) = (part.starts[line], part.starts[line + 1]);
        let mut bytes = vec![0u8; (end - start) as usize];
        part.file
            .read_exact_at(&mut bytes, start)
            .map_err(io_at("reading a line of", &part.path))?;
        while matches!(bytes.last(), Some(b'\n' | b'\r')) {
            bytes.pop();
        }
        String::from_utf8(bytes).map_err(|e| {
            Error::Usage(format!(
                "line {} of {} (byte {}) is not UTF-8 text: {e}",
                line + 1,
                part.path.display(),
                start
            ))
        })
    }

    fn collate(&self, items: Vec<String>, _device: &Device) -> Result<Vec<String>> {
        Ok(items)
    }
}

/// What identifies a file's content cheaply: its size, modification time and the CRC-32 of its
/// first and last 64 KiB (a rewrite that keeps the size and restores the time, as `cp -p` or
/// `rsync -t` of another file do, still changes the ends).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    size: u64,
    mtime: u128,
    crc: u32,
}

fn stamp(file: &File, path: &Path) -> Result<Stamp> {
    let meta = file
        .metadata()
        .map_err(io_at("reading the metadata of", path))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let ends = DataFile::ends(path, file)?;
    Ok(Stamp {
        size: ends.size,
        mtime,
        crc: ends.crc,
    })
}

/// Reads the whole file once: where each line starts, then the size.
fn scan(file: &File, path: &Path) -> Result<Vec<u64>> {
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut buf = vec![0u8; 1 << 20];
    let mut starts = vec![0u64];
    let mut at = 0u64;
    loop {
        let n = reader.read(&mut buf).map_err(io_at("reading", path))?;
        if n == 0 {
            break;
        }
        for (i, b) in buf[..n].iter().enumerate() {
            if *b == b'\n' {
                starts.push(at + i as u64 + 1);
            }
        }
        at += n as u64;
    }
    // A last line without a newline is a line; the end of a file that ends in one is not.
    if starts.last() != Some(&at) {
        starts.push(at);
    }
    Ok(starts)
}

/// The cached index of `path` when it still describes the file, else a fresh one (cached when
/// the folder allows).
fn line_index(path: &Path, file: &File) -> Result<Vec<u64>> {
    let now = stamp(file, path)?;
    let cache = TextLines::index_path(path);
    if let Some((cached, starts)) = std::fs::read(&cache).ok().and_then(|b| parse(&b)) {
        if cached == now {
            return Ok(starts);
        }
    }
    let starts = scan(file, path)?;
    write_cache(&cache, now, &starts);
    Ok(starts)
}

fn parse(bytes: &[u8]) -> Option<(Stamp, Vec<u64>)> {
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return None;
    }
    let size = u64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?);
    let mtime = u128::from_le_bytes(bytes.get(16..32)?.try_into().ok()?);
    let crc = u32::try_from(u64::from_le_bytes(bytes.get(32..40)?.try_into().ok()?)).ok()?;
    let lines = usize::try_from(u64::from_le_bytes(bytes.get(40..48)?.try_into().ok()?)).ok()?;
    let body = bytes.get(HEADER..)?;
    if body.len() != lines.checked_add(1)?.checked_mul(8)? {
        return None;
    }
    let starts = body
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect::<Vec<_>>();
    let stamp = Stamp { size, mtime, crc };
    (starts.last() == Some(&size)).then_some((stamp, starts))
}

/// Writes the cache atomically (a temporary file renamed into place); a folder that cannot
/// take it keeps the index in memory only.
fn write_cache(cache: &Path, stamp: Stamp, starts: &[u64]) {
    let mut bytes = Vec::with_capacity(HEADER + starts.len() * 8);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&stamp.size.to_le_bytes());
    bytes.extend_from_slice(&stamp.mtime.to_le_bytes());
    bytes.extend_from_slice(&u64::from(stamp.crc).to_le_bytes());
    bytes.extend_from_slice(&((starts.len() - 1) as u64).to_le_bytes());
    for s in starts {
        bytes.extend_from_slice(&s.to_le_bytes());
    }
    let mut tmp = cache.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    if std::fs::write(&tmp, &bytes).is_ok() && std::fs::rename(&tmp, cache).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::DataLoader;

    fn folder(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ivme-lines-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn lines_of_several_files_are_one_data_set_with_endings_removed() -> Result<()> {
        let d = folder("read");
        let (a, b) = (d.join("a.jsonl"), d.join("b.txt"));
        std::fs::write(&a, "{\"x\": 1}\n\n{\"x\": 3}\r\n").unwrap();
        std::fs::write(&b, "last one\nno newline at the end").unwrap();
        let lines = TextLines::open(&[&a, &b])?;
        let got: Vec<String> = (0..lines.len())
            .map(|i| lines.get(i))
            .collect::<Result<_>>()?;
        assert_eq!(
            got,
            [
                "{\"x\": 1}",
                "",
                "{\"x\": 3}",
                "last one",
                "no newline at the end"
            ]
        );
        assert!(lines.get(5).is_err());
        assert!(
            TextLines::index_path(&a).is_file(),
            "the index is cached beside the file"
        );
        std::fs::write(d.join("bad.txt"), b"ok\n\xff\xfe\n").unwrap();
        let bad = TextLines::open(&[d.join("bad.txt")])?;
        let e = bad.get(1).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("not UTF-8"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
        Ok(())
    }

    #[test]
    fn a_changed_file_gets_a_new_index_and_an_unchanged_one_keeps_it() -> Result<()> {
        let d = folder("cache");
        let f = d.join("c.txt");
        std::fs::write(&f, "one\ntwo\n").unwrap();
        assert_eq!(TextLines::open(&[&f])?.len(), 2);
        let cache = TextLines::index_path(&f);
        let before = std::fs::read(&cache).unwrap();
        assert_eq!(TextLines::open(&[&f])?.len(), 2);
        assert_eq!(std::fs::read(&cache).unwrap(), before, "reused as it was");
        // Same size, other lines: the new modification time marks it.
        std::thread::sleep(std::time::Duration::from_millis(10));
        std::fs::write(&f, "on\netwo\n").unwrap();
        let lines = TextLines::open(&[&f])?;
        assert_eq!((lines.get(0)?, lines.get(1)?), ("on".into(), "etwo".into()));
        std::fs::write(&f, "one\ntwo\nthree\n").unwrap();
        assert_eq!(TextLines::open(&[&f])?.get(2)?, "three");
        // Same size, other lines, and the old modification time put back (as `cp -p` of
        // another file would): the checksum of the file's ends marks it.
        let time = std::fs::metadata(&f).unwrap().modified().unwrap();
        std::fs::write(&f, "one\ntwothree\n\n").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&f)
            .unwrap()
            .set_modified(time)
            .unwrap();
        let lines = TextLines::open(&[&f])?;
        assert_eq!(
            (lines.get(1)?, lines.get(2)?),
            ("twothree".into(), "".into())
        );
        // A damaged cache is rebuilt, not trusted.
        std::fs::write(&cache, b"IVMELIX2 garbage").unwrap();
        assert_eq!(TextLines::open(&[&f])?.len(), 3);
        std::fs::remove_dir_all(&d).unwrap();
        Ok(())
    }

    #[test]
    fn a_sharded_shuffled_loader_hands_out_every_line_once() -> Result<()> {
        let d = folder("shard");
        let f = d.join("many.txt");
        let text: String = (0..37).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&f, text).unwrap();
        let mut seen = Vec::new();
        for rank in 0..2 {
            let mut l = DataLoader::new(TextLines::open(&[&f])?, 4)
                .shuffle(true)
                .seed(3)
                .even_batches(false)
                .shard(rank, 2)?;
            for batch in l.iter() {
                seen.extend(batch?);
            }
        }
        seen.sort();
        let mut want: Vec<String> = (0..37).map(|i| format!("line {i}")).collect();
        want.sort();
        assert_eq!(seen, want);
        std::fs::remove_dir_all(&d).unwrap();
        Ok(())
    }
}
