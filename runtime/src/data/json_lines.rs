//! JSONL files as records: each non-blank line parsed into the program's `serde` type (or a
//! `serde_json::Value`), with the file, line and byte offset it came from.

use super::{DataFile, Dataset, TextLines};
use crate::{Error, Result};
use candle_core::Device;
use serde::de::DeserializeOwned;
use std::marker::PhantomData;
use std::path::Path;
use std::sync::Arc;

/// One record of a [`JsonLines`] data set and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Record<T> {
    /// The parsed record.
    pub value: T,
    /// The file it was read from, as opened.
    pub file: Arc<str>,
    /// Its 1-based line in that file.
    pub line: usize,
    /// The byte offset its line starts at.
    pub offset: u64,
}

/// The records of one or more JSONL files as samples: sample `i` is the `i`-th non-blank line
/// (counted over the files in order) parsed into `T`, as a [`Record`] that says where it came
/// from; batches are `Vec<Record<T>>`.
///
/// Blank lines (empty, or only spaces, tabs and a `\r`) are never samples, and CRLF line
/// endings are read as LF ones. A line that is not UTF-8, not JSON, or not a `T` (a record cut
/// short, say) fails the batch that holds it, naming the file, the 1-based line and the byte
/// offset where the line starts. Lines are found as [`TextLines`] finds them (an index cached
/// beside each file) and read one positioned read each when a batch asks for them; finding the
/// blank ones reads each file once more at open.
///
/// ```no_run
/// # fn main() -> ivme::Result<()> {
/// use ivme::data::{DataLoader, JsonLines};
/// #[derive(serde::Deserialize)]
/// struct Example { text: String, label: u32 }
/// let records = JsonLines::<Example>::open(&["data/train.jsonl"])?;
/// let mut loader = DataLoader::new(records, 32).shuffle(true);
/// for batch in loader.iter() {
///     for r in batch? {
///         if r.value.text.is_empty() {
///             eprintln!("{} line {}: an empty text", r.file, r.line);
///         }
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct JsonLines<T = serde_json::Value> {
    lines: TextLines,
    fields: Option<Vec<String>>,
    record: PhantomData<fn() -> T>,
}

impl<T: DeserializeOwned> JsonLines<T> {
    /// Opens `paths` in order as one data set of records.
    pub fn open<P: AsRef<Path>>(paths: &[P]) -> Result<JsonLines<T>> {
        Ok(JsonLines {
            lines: TextLines::open(paths)?.skip_blank_lines(true)?,
            fields: None,
            record: PhantomData,
        })
    }

    /// Keeps only the fields `fields` of each record (each must be an object that has them)
    /// before it becomes a `T`: the columns of the data set.
    pub fn fields<S: AsRef<str>>(mut self, fields: &[S]) -> JsonLines<T> {
        self.fields = Some(fields.iter().map(|f| f.as_ref().to_string()).collect());
        self
    }

    /// Where sample `index` comes from: its file, its 1-based line and the byte offset its
    /// line starts at.
    pub fn origin(&self, index: usize) -> Result<(&Path, usize, u64)> {
        self.lines.origin(index)
    }

    /// The record of line `text`, or why it is none (`line`, `offset` and `file` name it).
    fn parse(&self, text: &str, file: &Path, line: usize, offset: u64) -> Result<T> {
        let at = || format!("{}: line {line} (byte {offset})", file.display());
        let bad = |e: serde_json::Error| {
            let why = match e.classify() {
                serde_json::error::Category::Eof => "a record cut short",
                serde_json::error::Category::Syntax => "not JSON",
                _ => "not a record of the expected shape",
            };
            Error::Usage(format!("{}: {why}: {e}", at()))
        };
        let Some(fields) = &self.fields else {
            return serde_json::from_str(text).map_err(bad);
        };
        let mut whole: serde_json::Value = serde_json::from_str(text).map_err(bad)?;
        let Some(object) = whole.as_object_mut() else {
            return Err(Error::Usage(format!(
                "{}: the record is not an object, so it has no fields {fields:?}",
                at()
            )));
        };
        let mut chosen = serde_json::Map::new();
        for f in fields {
            let v = object
                .remove(f)
                .ok_or_else(|| Error::Usage(format!("{}: the record has no field `{f}`", at())))?;
            chosen.insert(f.clone(), v);
        }
        serde_json::from_value(serde_json::Value::Object(chosen)).map_err(bad)
    }
}

impl<T: DeserializeOwned + Send + Sync> Dataset for JsonLines<T> {
    type Item = Record<T>;
    type Batch = Vec<Record<T>>;

    fn len(&self) -> usize {
        self.lines.len()
    }

    fn files(&self) -> Result<Vec<DataFile>> {
        self.lines.files()
    }

    fn get(&self, index: usize) -> Result<Record<T>> {
        let text = self.lines.get(index)?;
        let (file, line, offset) = self.lines.origin(index)?;
        let value = self.parse(&text, file, line, offset)?;
        Ok(Record {
            value,
            file: file.display().to_string().into(),
            line,
            offset,
        })
    }

    fn collate(&self, items: Vec<Record<T>>, _device: &Device) -> Result<Vec<Record<T>>> {
        Ok(items)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::DataLoader;
    use serde::Deserialize;
    use std::path::PathBuf;

    fn folder(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ivme-jsonl-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[derive(Deserialize, Clone, Debug, PartialEq)]
    struct Example {
        text: String,
        label: u32,
    }

    /// 12 records with blank, whitespace-only and CRLF lines among them; line numbers in the
    /// file are 1-based: record k sits on `lines[k]`.
    fn write_set(path: &Path) -> Vec<usize> {
        let mut text = Vec::new();
        let mut lines = Vec::new();
        let mut line = 0;
        for k in 0..12 {
            line += 1;
            if k == 3 {
                text.extend_from_slice(b"\n");
                line += 1;
            }
            if k == 7 {
                text.extend_from_slice(b"   \t\r\n");
                line += 1;
            }
            let end: &[u8] = if k % 2 == 0 { b"\r\n" } else { b"\n" };
            text.extend_from_slice(format!("{{\"text\": \"t{k}\", \"label\": {k}}}").as_bytes());
            text.extend_from_slice(end);
            lines.push(line);
        }
        text.extend_from_slice(b"\n\n");
        std::fs::write(path, text).unwrap();
        lines
    }

    #[test]
    fn records_skip_blank_lines_read_crlf_and_say_where_they_came_from() -> Result<()> {
        let d = folder("ok");
        let path = d.join("train.jsonl");
        let lines = write_set(&path);
        let records = JsonLines::<Example>::open(&[&path])?;
        assert_eq!(
            records.len(),
            12,
            "blank and whitespace-only lines are no samples"
        );
        for (k, &line) in lines.iter().enumerate() {
            let r = records.get(k)?;
            assert_eq!(
                r.value,
                Example {
                    text: format!("t{k}"),
                    label: k as u32
                }
            );
            assert_eq!((r.file.as_ref(), r.line), (path.to_str().unwrap(), line));
            let bytes = std::fs::read(&path).unwrap();
            assert!(bytes[r.offset as usize..].starts_with(b"{\"text\""));
        }
        // A field selection into a Value.
        let values = JsonLines::<serde_json::Value>::open(&[&path])?.fields(&["label"]);
        assert_eq!(values.get(2)?.value, serde_json::json!({ "label": 2 }));
        let e = JsonLines::<serde_json::Value>::open(&[&path])?
            .fields(&["id"])
            .get(0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 1") && e.contains("no field `id`"), "{e}");
        // TextLines keeps blank lines unless asked: 12 records, 2 blank lines among them and
        // 2 empty lines at the end.
        assert_eq!(TextLines::open(&[&path])?.len(), 16);
        let skipping = TextLines::open(&[&path])?.skip_blank_lines(true)?;
        assert_eq!(skipping.len(), 12);
        assert_eq!(skipping.origin(3)?.1, lines[3]);
        let _ = std::fs::remove_dir_all(&d);
        Ok(())
    }

    /// The loader's batches of 4 records in order until the first error: (records read,
    /// the failing batch and its message).
    fn until_error(path: &Path, prefetch: usize) -> (usize, Option<(usize, String)>) {
        let records = JsonLines::<Example>::open(&[path]).unwrap();
        let mut loader = DataLoader::new(records, 4);
        if prefetch > 0 {
            loader = loader.prefetch(prefetch);
        }
        let mut read = 0;
        for (b, batch) in loader.iter().enumerate() {
            match batch {
                Ok(rs) => read += rs.len(),
                Err(e) => return (read, Some((b, e.to_string()))),
            }
        }
        (read, None)
    }

    #[test]
    fn a_cut_record_or_a_line_that_is_not_utf8_fails_its_batch_naming_file_line_and_byte() {
        let d = folder("bad");
        let path = d.join("cut.jsonl");
        let lines = write_set(&path);
        let mut bytes = std::fs::read(&path).unwrap();
        // Record 9 cut short: its closing brace gone.
        let at = bytes
            .windows(4)
            .position(|w| w == b"\": 9")
            .map(|p| p + 4)
            .unwrap();
        assert_eq!(bytes[at], b'}');
        bytes[at] = b' ';
        std::fs::write(&path, &bytes).unwrap();
        let offset = bytes[..at].iter().rposition(|&b| b == b'\n').unwrap() + 1;
        for prefetch in [0, 2] {
            let (read, err) = until_error(&path, prefetch);
            let (batch, msg) = err.expect("the cut record is refused");
            assert_eq!((read, batch), (8, 2), "prefetch {prefetch}: {msg}");
            let want = format!(
                "cut.jsonl: line {} (byte {offset}): a record cut short",
                lines[9]
            );
            assert!(
                msg.contains(&want),
                "prefetch {prefetch}: no `{want}` in: {msg}"
            );
        }
        // Invalid UTF-8 in record 1's text.
        let path = d.join("latin1.jsonl");
        write_set(&path);
        let mut bytes = std::fs::read(&path).unwrap();
        let at = bytes.windows(2).position(|w| w == b"t1").unwrap();
        bytes[at] = 0xe9;
        std::fs::write(&path, &bytes).unwrap();
        let records = JsonLines::<Example>::open(&[&path]).unwrap();
        let e = records.get(1).unwrap_err().to_string();
        let start = bytes[..at].iter().rposition(|&b| b == b'\n').unwrap() + 1;
        assert!(
            e.contains(&format!("line {} of", lines[1]))
                && e.contains(&format!("(byte {start})"))
                && e.contains("not UTF-8"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
