//! Arrow IPC files (the file format and the stream format a Hugging Face `datasets` cache
//! holds), mapped into memory and decoded without copying: a row is read where it lies.

use super::{hf, same_types, Columns, Offsets, Row};
use crate::data::{DataFile, Dataset};
use crate::error::io_at;
use crate::{Error, Result};
use arrow_array::RecordBatch;
use arrow_buffer::Buffer;
use arrow_ipc::convert::fb_to_schema;
use arrow_ipc::reader::{read_footer_length, FileDecoder, StreamDecoder};
use arrow_schema::{ArrowError, SchemaRef};
use candle_core::Device;
use std::fs::File;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;

/// The first and last bytes of an Arrow IPC file (the stream format has none).
const MAGIC: &[u8; 6] = b"ARROW1";

/// One file's record batches.
#[derive(Debug)]
struct Part {
    path: PathBuf,
    name: Arc<str>,
    file: File,
    batches: Vec<RecordBatch>,
    /// Where each batch's rows start in the file.
    rows: Offsets,
}

/// The rows of one or more Arrow IPC files as samples: sample `i` is row `i` (counted over the
/// files in order) of the chosen columns, as a [`Row`]; batches are `Vec<Row>`.
///
/// Both Arrow IPC layouts open: the file format (`.arrow`/`.feather` v2 written by
/// `pyarrow.ipc.new_file` or `pyarrow.feather`, uncompressed) and the stream format, which is
/// what a Hugging Face `datasets` cache holds ([`open_hf`](ArrowFiles::open_hf) opens such a
/// folder by its path). Each file is mapped into memory and its batches decoded where they
/// lie: opening reads only the batches' headers, a row is read when a batch asks for it, and a
/// data set larger than memory costs the page cache, not the process. The files must not be
/// rewritten while a job reads them (a file truncated under the mapping ends the process).
///
/// ```no_run
/// # fn main() -> ivme::Result<()> {
/// use ivme::data::{ArrowFiles, DataLoader};
/// let rows = ArrowFiles::open(&["data/train.arrow"], &["input_ids", "label"])?;
/// let mut loader = DataLoader::new(rows, 16).shuffle(true);
/// for batch in loader.iter() {
///     for row in batch? {
///         let (ids, label) = (row.ids("input_ids")?, row.int("label")?);
/// #       let _ = (ids, label);
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct ArrowFiles {
    parts: Vec<Part>,
    offsets: Offsets,
    columns: Columns,
}

impl ArrowFiles {
    /// Opens `paths` in order as one data set of the rows of `columns`.
    ///
    /// Refused, naming the file: a file that is not Arrow IPC or is truncated or damaged, a
    /// missing column, a column of a type a [`Value`](super::Value) cannot hold, and a column
    /// whose type differs from the first file's.
    pub fn open<P: AsRef<Path>, S: AsRef<str>>(paths: &[P], columns: &[S]) -> Result<ArrowFiles> {
        let columns = Columns::new(columns, "ArrowFiles")?;
        if paths.is_empty() {
            return Err(Error::Usage(
                "ArrowFiles::open needs at least one file".into(),
            ));
        }
        let mut parts: Vec<Part> = Vec::with_capacity(paths.len());
        let mut offsets = Offsets::default();
        let mut first: Option<(SchemaRef, PathBuf)> = None;
        for p in paths {
            let path = p.as_ref().to_path_buf();
            let file = File::open(&path).map_err(io_at("opening", &path))?;
            let (schema, batches) = decode(&file, &path)?;
            let at = columns.find_in(&schema, &path)?;
            let batches = batches
                .iter()
                .map(|b| b.project(&at))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| damaged(&path, e))?;
            let chosen = Arc::new(schema.project(&at).map_err(|e| damaged(&path, e))?);
            match &first {
                None => first = Some((chosen, path.clone())),
                Some((schema0, path0)) => same_types(schema0, path0, &chosen, &path)?,
            }
            let mut rows = Offsets::default();
            for b in &batches {
                rows.push(b.num_rows());
            }
            offsets.push(rows.len());
            parts.push(Part {
                name: path.display().to_string().into(),
                path,
                file,
                batches,
                rows,
            });
        }
        Ok(ArrowFiles {
            parts,
            offsets,
            columns,
        })
    }

    /// Opens a split of a Hugging Face `datasets` folder by its path: a cache folder that
    /// `load_dataset` wrote (`NAME-SPLIT.arrow`, `NAME-SPLIT-00000-of-00004.arrow`, ...), or a
    /// folder of `save_to_disk` (its `state.json`, or `dataset_dict.json` and one folder per
    /// split). A split the folder lacks is refused, naming the splits it has.
    pub fn open_hf<S: AsRef<str>>(
        folder: impl AsRef<Path>,
        split: &str,
        columns: &[S],
    ) -> Result<ArrowFiles> {
        let files = hf::split_files(folder.as_ref(), split)?;
        ArrowFiles::open(&files, columns)
    }

    /// Returns the chosen column names.
    pub fn columns(&self) -> &[String] {
        self.columns.names()
    }
}

impl Dataset for ArrowFiles {
    type Item = Row;
    type Batch = Vec<Row>;

    fn len(&self) -> usize {
        self.offsets.len()
    }

    fn get(&self, index: usize) -> Result<Row> {
        self.offsets.check(index, "ArrowFiles")?;
        let (k, row) = self.offsets.locate(index);
        let part = &self.parts[k];
        let (b, at) = part.rows.locate(row);
        self.columns.row_of(&part.batches[b], at, &part.name, row)
    }

    fn files(&self) -> Result<Vec<DataFile>> {
        self.parts
            .iter()
            .map(|p| DataFile::of(&p.path, &p.file))
            .collect()
    }

    fn collate(&self, items: Vec<Row>, _device: &Device) -> Result<Vec<Row>> {
        Ok(items)
    }
}

/// Maps `file` and decodes its schema and record batches (the data stays in the mapping).
fn decode(file: &File, path: &Path) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    let len = file
        .metadata()
        .map_err(io_at("reading the size of", path))?
        .len();
    if len == 0 {
        return Err(Error::Usage(format!(
            "{} is empty, not an Arrow IPC file",
            path.display()
        )));
    }
    // SAFETY: the mapping is read-only and lives as long as the buffers that point into it
    // (the Arc below owns it). Another process truncating the file while it is mapped makes
    // reads past the new end fault; the type's documentation says the files must not change.
    let map = unsafe { memmap2::Mmap::map(file) }.map_err(io_at("mapping", path))?;
    let ptr = NonNull::new(map.as_ptr() as *mut u8)
        .ok_or_else(|| Error::Usage(format!("mapping {} gave a null address", path.display())))?;
    let size = map.len();
    // SAFETY: `ptr` points to `size` readable bytes owned by `map`, which the buffer keeps.
    let buffer = unsafe { Buffer::from_custom_allocation(ptr, size, Arc::new(map)) };
    // A damaged file can trip an assertion inside the decoder: it becomes this file's error.
    let decoded = catch_unwind(AssertUnwindSafe(|| {
        if buffer.len() >= 8 && buffer[..6] == MAGIC[..] {
            decode_file_format(&buffer)
        } else {
            decode_stream(buffer.clone())
        }
    }));
    match decoded {
        Ok(Ok(decoded)) => Ok(decoded),
        Ok(Err(e)) => Err(damaged(path, e)),
        Err(_) => Err(damaged(
            path,
            ArrowError::IpcError("the decoder stopped on inconsistent data".into()),
        )),
    }
}

/// Decodes the Arrow IPC file format through its footer (the batches' places).
fn decode_file_format(
    buf: &Buffer,
) -> std::result::Result<(SchemaRef, Vec<RecordBatch>), ArrowError> {
    let ipc = |why: &str| ArrowError::IpcError(why.to_string());
    let n = buf.len();
    if n < 8 + 10 || buf[n - 6..] != MAGIC[..] {
        return Err(ipc(
            "it starts as an Arrow IPC file but has no footer (truncated?)",
        ));
    }
    let trailer: [u8; 10] = buf[n - 10..].try_into().map_err(|_| ipc("short trailer"))?;
    let footer_len = read_footer_length(trailer)?;
    if footer_len > n - 10 - 8 {
        return Err(ipc("its footer's length points outside the file"));
    }
    let footer = arrow_ipc::root_as_footer(&buf[n - 10 - footer_len..n - 10])
        .map_err(|e| ArrowError::IpcError(format!("its footer cannot be read: {e}")))?;
    let schema = Arc::new(fb_to_schema(
        footer
            .schema()
            .ok_or_else(|| ipc("its footer has no schema"))?,
    ));
    let mut decoder = FileDecoder::new(schema.clone(), footer.version());
    let block_of = |b: &arrow_ipc::Block| -> std::result::Result<Buffer, ArrowError> {
        let (at, len) = (b.offset(), b.metaDataLength() as i64 + b.bodyLength());
        if at < 0 || len < 0 || (at + len) as usize > n {
            return Err(ipc("a batch's place in the footer lies outside the file"));
        }
        Ok(buf.slice_with_length(at as usize, len as usize))
    };
    for block in footer.dictionaries().iter().flatten() {
        decoder.read_dictionary(block, &block_of(block)?)?;
    }
    let mut batches = Vec::new();
    for block in footer.recordBatches().iter().flatten() {
        if let Some(batch) = decoder.read_record_batch(block, &block_of(block)?)? {
            batches.push(batch);
        }
    }
    Ok((schema, batches))
}

/// Decodes the Arrow IPC stream format, message after message.
fn decode_stream(
    mut buf: Buffer,
) -> std::result::Result<(SchemaRef, Vec<RecordBatch>), ArrowError> {
    let mut decoder = StreamDecoder::new();
    let mut batches = Vec::new();
    while !buf.is_empty() {
        if let Some(batch) = decoder.decode(&mut buf)? {
            batches.push(batch);
        }
    }
    decoder
        .finish()
        .map_err(|_| ArrowError::IpcError("its last message is cut short (truncated?)".into()))?;
    let schema = decoder
        .schema()
        .ok_or_else(|| ArrowError::IpcError("it holds no schema".into()))?;
    Ok((schema, batches))
}

/// The error for a file Arrow cannot read.
fn damaged(path: &Path, e: ArrowError) -> Error {
    Error::Usage(format!(
        "{} cannot be read as an Arrow IPC file: {e}; {}",
        path.display(),
        super::what_it_is(path)
    ))
}
