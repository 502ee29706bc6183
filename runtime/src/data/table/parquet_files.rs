//! Parquet files as a data set: the footer read once per file, and for each batch only the
//! rows it asks for, row group by row group.

use super::{same_types, Columns, Offsets, Row};
use crate::data::{DataFile, Dataset};
use crate::error::io_at;
use crate::{Error, Result};
use arrow_array::RecordBatch;
use bytes::Bytes;
use candle_core::Device;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowSelection,
};
use parquet::arrow::ProjectionMask;
use parquet::file::reader::{ChunkReader, Length};
use parquet::file::serialized_reader::SerializedPageReader;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// One file: its footer, the columns to read, where its row groups start.
#[derive(Debug)]
struct Part {
    path: PathBuf,
    name: Arc<str>,
    file: Pread,
    meta: ArrowReaderMetadata,
    mask: ProjectionMask,
    groups: Offsets,
}

/// The rows of one or more Parquet files as samples: sample `i` is row `i` (counted over the
/// files in order) of the chosen columns, as a [`Row`]; batches are `Vec<Row>`.
///
/// Opening reads each file's footer (its schema and row groups) and nothing else. A batch
/// reads, for each row group its rows fall in, only the chosen columns and only the pages
/// those rows need, with positioned reads (several prefetch workers can read one file at
/// once). Snappy, zstd and LZ4 compression are read. Shuffled batches over large row groups
/// decode more than they keep: `DataLoader::prefetch` hides that cost behind the step.
///
/// ```no_run
/// # fn main() -> ivme::Result<()> {
/// use ivme::data::{DataLoader, ParquetFiles};
/// let rows = ParquetFiles::open(&["train-00000.parquet", "train-00001.parquet"], &["text"])?;
/// let mut loader = DataLoader::new(rows, 32).shuffle(true).prefetch(2);
/// for batch in loader.iter() {
///     let texts: Vec<String> = batch?.iter().map(|r| r.text("text").map(String::from))
///         .collect::<ivme::Result<_>>()?;
/// #   let _ = texts;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct ParquetFiles {
    parts: Vec<Part>,
    offsets: Offsets,
    columns: Columns,
    /// Row groups decoded whole and kept for later batches, when they all fit its budget.
    cache: Mutex<GroupCache>,
}

/// The default budget of the decoded row groups a [`ParquetFiles`] keeps.
const CACHE_BYTES: u64 = 1 << 30;

/// Row groups decoded whole (the chosen columns), by (file, group).
#[derive(Debug, Default)]
struct GroupCache {
    on: bool,
    groups: HashMap<(usize, usize), Arc<Vec<RecordBatch>>>,
}

impl ParquetFiles {
    /// Opens `paths` in order as one data set of the rows of `columns`.
    ///
    /// Refused, naming the file: a file that is not Parquet or whose footer is damaged or cut
    /// off, a missing column, a column of a type a [`Value`](super::Value) cannot hold, and a
    /// column whose type differs from the first file's. A damaged page is found when a batch
    /// reads it, and that batch fails naming the file and row group.
    pub fn open<P: AsRef<Path>, S: AsRef<str>>(paths: &[P], columns: &[S]) -> Result<ParquetFiles> {
        let columns = Columns::new(columns, "ParquetFiles")?;
        if paths.is_empty() {
            return Err(Error::Usage(
                "ParquetFiles::open needs at least one file".into(),
            ));
        }
        let mut parts = Vec::with_capacity(paths.len());
        let mut offsets = Offsets::default();
        let mut first: Option<(arrow_schema::SchemaRef, PathBuf)> = None;
        for p in paths {
            let path = p.as_ref().to_path_buf();
            let file = Pread(Arc::new(
                File::open(&path).map_err(io_at("opening", &path))?,
            ));
            let meta = guarded(|| ArrowReaderMetadata::load(&file, ArrowReaderOptions::new()))
                .map_err(|e| {
                    Error::Usage(format!(
                        "{} cannot be read as a Parquet file: {e}; {}",
                        path.display(),
                        super::what_it_is(&path)
                    ))
                })?;
            let schema = meta.schema().clone();
            let at = columns.find_in(&schema, &path)?;
            let chosen = Arc::new(
                schema
                    .project(&at)
                    .map_err(|e| Error::Usage(format!("{}: {e}", path.display())))?,
            );
            match &first {
                None => first = Some((chosen, path.clone())),
                Some((schema0, path0)) => same_types(schema0, path0, &chosen, &path)?,
            }
            let descr = meta.metadata().file_metadata().schema_descr();
            let mask = ProjectionMask::roots(descr, at);
            let mut groups = Offsets::default();
            for g in meta.metadata().row_groups() {
                groups.push(g.num_rows().max(0) as usize);
            }
            offsets.push(groups.len());
            parts.push(Part {
                name: path.display().to_string().into(),
                path,
                file,
                meta,
                mask,
                groups,
            });
        }
        let mut files = ParquetFiles {
            parts,
            offsets,
            columns,
            cache: Mutex::new(GroupCache::default()),
        };
        files = files.cache_bytes(CACHE_BYTES);
        Ok(files)
    }

    /// Keeps every row group a batch decodes, decoded, for the batches after it, when the
    /// files' row groups together (uncompressed, as their footers give it) fit in `bytes`;
    /// off otherwise, or with 0. On by default up to 1 GiB: a shuffled epoch then decodes each
    /// row group once instead of once per batch that touches it. The samples, their order and
    /// the resume do not change.
    pub fn cache_bytes(self, bytes: u64) -> ParquetFiles {
        let total: i64 = self
            .parts
            .iter()
            .flat_map(|p| p.meta.metadata().row_groups())
            .map(|g| g.total_byte_size().max(0))
            .sum();
        let on = bytes > 0 && (total as u64) <= bytes;
        *self.cache.lock().unwrap_or_else(|e| e.into_inner()) = GroupCache {
            on,
            groups: HashMap::new(),
        };
        self
    }

    /// Returns the chosen column names.
    pub fn columns(&self) -> &[String] {
        self.columns.names()
    }

    /// Reads rows `rows` (ascending, distinct) of row group `g` of file `k`: from the cache of
    /// decoded groups when it is on (decoding the whole group on its first use), else only
    /// the pages those rows need.
    fn read_group(&self, k: usize, g: usize, rows: &[usize]) -> Result<Vec<Row>> {
        let on = self.cache.lock().unwrap_or_else(|e| e.into_inner()).on;
        if !on {
            return self.read_rows(k, g, rows);
        }
        let cached = {
            let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            cache.groups.get(&(k, g)).cloned()
        };
        let batches = match cached {
            Some(b) => b,
            None => {
                let part = &self.parts[k];
                let in_group = part.groups.firsts[g + 1] - part.groups.firsts[g];
                let all: Vec<usize> = (0..in_group).collect();
                let b = Arc::new(self.decode(k, g, &all)?);
                let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
                cache.groups.insert((k, g), b.clone());
                b
            }
        };
        let part = &self.parts[k];
        let first = part.groups.firsts[g];
        // The group's batches hold its rows in order: row r is at (batch, place) by counting.
        let mut out = Vec::with_capacity(rows.len());
        let (mut b, mut base) = (0, 0);
        for &r in rows {
            while b < batches.len() && r >= base + batches[b].num_rows() {
                base += batches[b].num_rows();
                b += 1;
            }
            let Some(batch) = batches.get(b) else {
                return Err(Error::Usage(format!(
                    "row group {g} of {} has no row {r}",
                    part.path.display()
                )));
            };
            out.push(
                self.columns
                    .row_of(batch, r - base, &part.name, first + r)?,
            );
        }
        Ok(out)
    }

    /// Reads rows `rows` (ascending, distinct) of row group `g` of file `k`, only the pages
    /// they need.
    fn read_rows(&self, k: usize, g: usize, rows: &[usize]) -> Result<Vec<Row>> {
        let part = &self.parts[k];
        let first = part.groups.firsts[g];
        let batches = self.decode(k, g, rows)?;
        let mut out = Vec::with_capacity(rows.len());
        let mut next = rows.iter();
        for batch in &batches {
            for at in 0..batch.num_rows() {
                let Some(&r) = next.next() else { break };
                out.push(self.columns.row_of(batch, at, &part.name, first + r)?);
            }
        }
        if out.len() != rows.len() {
            let e = format!("it gave {} of the {} rows asked for", out.len(), rows.len());
            return Err(self.read_error(k, g, e));
        }
        Ok(out)
    }

    /// Decodes rows `rows` (ascending, distinct) of row group `g` of file `k`: the chosen
    /// columns, only the pages those rows need.
    fn decode(&self, k: usize, g: usize, rows: &[usize]) -> Result<Vec<RecordBatch>> {
        let part = &self.parts[k];
        let in_group = part.groups.firsts[g + 1] - part.groups.firsts[g];
        guarded(|| {
            let selection =
                RowSelection::from_consecutive_ranges(rows.iter().map(|&r| r..r + 1), in_group);
            let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(
                part.file.clone(),
                part.meta.clone(),
            )
            .with_row_groups(vec![g])
            .with_projection(part.mask.clone())
            .with_row_selection(selection)
            .with_batch_size(rows.len().max(1))
            .build()?;
            reader
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(parquet::errors::ParquetError::from)
        })
        .map_err(|e| self.read_error(k, g, e))
    }

    /// The error of a read of row group `g` of file `k` that failed with `e`: a page that
    /// fails its checksum is named.
    fn read_error(&self, k: usize, g: usize, e: String) -> Error {
        let path = self.parts[k].path.display();
        if e.contains("CRC checksum mismatch") {
            return Error::Usage(format!(
                "{path}: row group {g}, {}: the page does not match its CRC-32 checksum, so the \
                 file is damaged (nothing of this batch was used); re-download or re-write the \
                 file",
                self.damaged_page(k, g)
                    .unwrap_or_else(|| "a column's data page".to_string())
            ));
        }
        Error::Usage(format!("row group {g} of {path} cannot be read: {e}"))
    }

    /// Which chosen column's page of row group `g` of file `k` fails its checksum, read page
    /// by page (only after a read of the group failed): "column `id`, page 2 of its chunk
    /// (bytes 4..1700 of the file)".
    fn damaged_page(&self, k: usize, g: usize) -> Option<String> {
        let part = &self.parts[k];
        let group = part.meta.metadata().row_group(g);
        let rows = group.num_rows().max(0) as usize;
        for (i, column) in group.columns().iter().enumerate() {
            if !part.mask.leaf_included(i) {
                continue;
            }
            let file = Arc::new(part.file.clone());
            let Ok(pages) = SerializedPageReader::new(file, column, rows, None) else {
                continue;
            };
            let failed = pages.enumerate().find_map(|(n, p)| p.err().map(|e| (n, e)));
            if let Some((n, _)) = failed.filter(|(_, e)| e.to_string().contains("CRC")) {
                let (start, len) = column.byte_range();
                return Some(format!(
                    "column `{}`, page {} of its chunk (bytes {start}..{} of the file)",
                    column.column_path().string(),
                    n + 1,
                    start + len
                ));
            }
        }
        None
    }
}

impl Dataset for ParquetFiles {
    type Item = Row;
    type Batch = Vec<Row>;

    fn len(&self) -> usize {
        self.offsets.len()
    }

    fn get(&self, index: usize) -> Result<Row> {
        let mut rows = self.get_batch(&[index], &Device::Cpu)?;
        rows.pop()
            .ok_or_else(|| Error::Usage(format!("ParquetFiles: row {index} was not read")))
    }

    fn files(&self) -> Result<Vec<DataFile>> {
        self.parts
            .iter()
            .map(|p| DataFile::of(&p.path, &p.file.0))
            .collect()
    }

    fn collate(&self, items: Vec<Row>, _device: &Device) -> Result<Vec<Row>> {
        Ok(items)
    }

    /// Reads each row group the batch touches once, for just the rows it needs.
    fn get_batch(&self, indices: &[usize], _device: &Device) -> Result<Vec<Row>> {
        // (file, row group) -> the rows wanted there, and the batch places that want each.
        let mut wanted: BTreeMap<(usize, usize), BTreeMap<usize, Vec<usize>>> = BTreeMap::new();
        for (place, &index) in indices.iter().enumerate() {
            self.offsets.check(index, "ParquetFiles")?;
            let (k, row) = self.offsets.locate(index);
            let (g, r) = self.parts[k].groups.locate(row);
            wanted
                .entry((k, g))
                .or_default()
                .entry(r)
                .or_default()
                .push(place);
        }
        let mut out: Vec<Option<Row>> = vec![None; indices.len()];
        for ((k, g), rows) in wanted {
            let numbers: Vec<usize> = rows.keys().copied().collect();
            let read = self.read_group(k, g, &numbers)?;
            for (row, places) in read.into_iter().zip(rows.into_values()) {
                for place in places {
                    out[place] = Some(row.clone());
                }
            }
        }
        out.into_iter()
            .map(|r| r.ok_or_else(|| Error::Usage("ParquetFiles: a row was not read".into())))
            .collect()
    }
}

/// Runs a Parquet read, turning an error or a panic on damaged data into a message.
fn guarded<T>(read: impl FnOnce() -> parquet::errors::Result<T>) -> std::result::Result<T, String> {
    match catch_unwind(AssertUnwindSafe(read)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("the decoder stopped on inconsistent data".into()),
    }
}

/// A file read with positioned reads only, so that threads reading it at once never share a
/// file offset (the `File` reader of the parquet crate seeks a shared one).
#[derive(Clone, Debug)]
struct Pread(Arc<File>);

/// A reader from one place of a [`Pread`] file onwards.
struct PreadFrom {
    file: Arc<File>,
    at: u64,
}

impl Read for PreadFrom {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.file.read_at(buf, self.at)?;
        self.at += n as u64;
        Ok(n)
    }
}

impl Length for Pread {
    fn len(&self) -> u64 {
        self.0.metadata().map(|m| m.len()).unwrap_or(0)
    }
}

impl ChunkReader for Pread {
    type T = PreadFrom;

    fn get_read(&self, start: u64) -> parquet::errors::Result<PreadFrom> {
        Ok(PreadFrom {
            file: self.0.clone(),
            at: start,
        })
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        let mut buf = vec![0u8; length];
        self.0.read_exact_at(&mut buf, start)?;
        Ok(buf.into())
    }
}
