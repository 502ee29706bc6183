//! Pre-tokenized corpora on disk: the flat token files of nanoGPT (`np.uint16` ids, no header)
//! and llm.c (a 1 KiB header, then u16 or u32 ids), read window by window, never whole.

use super::{DataFile, Dataset};
use crate::{Error, Result};
use candle_core::{Device, Tensor};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// llm.c's magic number, the first little-endian `i32` of its token files.
const LLMC_MAGIC: i32 = 20240520;

/// The size of llm.c's header: 256 little-endian `i32`s.
const LLMC_HEADER: u64 = 1024;

/// How wide each token id is in a file without a header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenWidth {
    /// Two bytes, little-endian (nanoGPT's `np.uint16`; vocabularies up to 65,536).
    U16,
    /// Four bytes, little-endian.
    U32,
}

impl TokenWidth {
    fn bytes(self) -> u64 {
        match self {
            TokenWidth::U16 => 2,
            TokenWidth::U32 => 4,
        }
    }
}

/// One file's tokens: where they start, how many, how wide.
#[derive(Debug)]
struct Part {
    path: PathBuf,
    file: File,
    start: u64,
    tokens: u64,
    width: TokenWidth,
    /// Windows before this file's first one.
    first_window: usize,
}

/// Fixed-length windows of a pre-tokenized corpus, as `(inputs, targets)`: window `i` holds
/// `seq_len` token ids and the same ids shifted by one (the next-token targets), both `u32`.
///
/// Windows start every `stride` tokens (`seq_len` unless [`with_stride`](Self::with_stride)
/// says otherwise) and never cross from one file into the next. Each window is read from disk
/// when a batch asks for it, with one positioned read: a corpus far larger than memory costs
/// the page cache, not the process. A [`DataLoader`](super::DataLoader) over it shuffles,
/// shards across processes and resumes exactly, as it does for data in memory.
///
/// ```no_run
/// # fn main() -> ivme::Result<()> {
/// use ivme::data::{DataLoader, TokenFile, TokenWidth};
/// let corpus = TokenFile::open(&["data/train.bin"], Some(TokenWidth::U16), 1024)?;
/// let loader = DataLoader::new(corpus, 8);
/// # let _ = loader; Ok(()) }
/// ```
#[derive(Debug)]
pub struct TokenFile {
    parts: Vec<Part>,
    seq_len: usize,
    stride: usize,
    windows: usize,
}

impl TokenFile {
    /// Opens `paths` as one corpus of windows of `seq_len` tokens. A file that starts with
    /// llm.c's header says its own width (version 1: u16, version 2: u32) and token count;
    /// any other file is raw ids of `width` (required then). Files too short for one window
    /// add none; a size that is not a whole number of ids, a header that disagrees with the
    /// file's size, or an unknown llm.c version is an error naming the file.
    pub fn open<P: AsRef<Path>>(
        paths: &[P],
        width: Option<TokenWidth>,
        seq_len: usize,
    ) -> Result<Self> {
        if seq_len == 0 {
            return Err(Error::Usage("a token window needs seq_len ≥ 1".into()));
        }
        if paths.is_empty() {
            return Err(Error::Usage("TokenFile::open got no file".into()));
        }
        let parts = paths
            .iter()
            .map(|p| open_part(p.as_ref(), width))
            .collect::<Result<Vec<_>>>()?;
        let mut corpus = TokenFile {
            parts,
            seq_len,
            stride: seq_len,
            windows: 0,
        };
        corpus.count_windows();
        Ok(corpus)
    }

    /// The same corpus with windows starting every `stride` tokens (overlapping when
    /// `stride < seq_len`).
    pub fn with_stride(mut self, stride: usize) -> Result<Self> {
        if stride == 0 {
            return Err(Error::Usage("a token window stride must be ≥ 1".into()));
        }
        self.stride = stride;
        self.count_windows();
        Ok(self)
    }

    /// The number of tokens in all files.
    pub fn tokens(&self) -> u64 {
        self.parts.iter().map(|p| p.tokens).sum()
    }

    fn count_windows(&mut self) {
        let need = self.seq_len as u64 + 1;
        let mut at = 0;
        for p in &mut self.parts {
            p.first_window = at;
            if p.tokens >= need {
                at += ((p.tokens - need) / self.stride as u64) as usize + 1;
            }
        }
        self.windows = at;
    }

    /// The file holding window `index` and the byte offset where the window starts.
    fn place(&self, index: usize) -> Result<(&Part, u64)> {
        if index >= self.windows {
            return Err(Error::Usage(format!(
                "token window {index} is past the end ({} windows)",
                self.windows
            )));
        }
        let k = self.parts.partition_point(|p| p.first_window <= index) - 1;
        let p = &self.parts[k];
        let first = (index - p.first_window) as u64 * self.stride as u64;
        Ok((p, p.start + first * p.width.bytes()))
    }

    /// The `seq_len + 1` token ids of window `index`.
    fn window(&self, index: usize) -> Result<Vec<u32>> {
        let (p, at) = self.place(index)?;
        let n = self.seq_len + 1;
        let w = p.width.bytes();
        let mut bytes = vec![0u8; n * w as usize];
        p.file
            .read_exact_at(&mut bytes, at)
            .map_err(|e| Error::io(format!("reading tokens from {}", p.path.display()), e))?;
        Ok(match p.width {
            TokenWidth::U16 => bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]) as u32)
                .collect(),
            TokenWidth::U32 => bytes
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        })
    }
}

/// Opens one token file, reading llm.c's header when it has one.
fn open_part(path: &Path, width: Option<TokenWidth>) -> Result<Part> {
    let io = |what: &str| {
        let context = format!("{what} {}", path.display());
        move |e| Error::io(context, e)
    };
    let file = File::open(path).map_err(io("opening token file"))?;
    let size = file.metadata().map_err(io("reading the size of"))?.len();
    let bad = |msg: String| Error::Usage(format!("{}: {msg}", path.display()));
    let mut head = [0u8; 12];
    let headed = size >= LLMC_HEADER
        && file.read_exact_at(&mut head, 0).is_ok()
        && i32::from_le_bytes([head[0], head[1], head[2], head[3]]) == LLMC_MAGIC;
    let (start, width, tokens) = if headed {
        let version = i32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        let count = i32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        let width = match version {
            1 => TokenWidth::U16,
            2 => TokenWidth::U32,
            v => {
                return Err(bad(format!(
                    "has llm.c's header with version {v}; versions 1 (u16 ids) and 2 (u32 ids) \
                     are known"
                )))
            }
        };
        let tokens = u64::try_from(count)
            .map_err(|_| bad(format!("has llm.c's header with {count} tokens")))?;
        if LLMC_HEADER + tokens * width.bytes() > size {
            return Err(bad(format!(
                "has llm.c's header saying {tokens} tokens of {} bytes, but holds {} bytes \
                 after its header",
                width.bytes(),
                size - LLMC_HEADER
            )));
        }
        (LLMC_HEADER, width, tokens)
    } else {
        let width = width.ok_or_else(|| bad(no_header(&file, size)))?;
        if size % width.bytes() != 0 {
            return Err(bad(format!(
                "holds {size} bytes, not a whole number of {}-byte ids",
                width.bytes()
            )));
        }
        (0, width, size / width.bytes())
    };
    Ok(Part {
        path: path.to_path_buf(),
        file,
        start,
        tokens,
        width,
        first_window: 0,
    })
}

/// Why a file opened without a width is not an llm.c file: what its first bytes read, against
/// llm.c's magic number, and whether nanoGPT's raw layout (u16 ids, no header) fits its size.
fn no_header(file: &File, size: u64) -> String {
    let mut magic = [0u8; 4];
    if size < 4 || file.read_exact_at(&mut magic, 0).is_err() {
        return format!(
            "is {size} bytes, too short for llm.c's header (which starts with the magic number \
             {LLMC_MAGIC}), so say how wide its ids are: Some(TokenWidth::U16) for nanoGPT's \
             files"
        );
    }
    let read = i32::from_le_bytes(magic);
    if read == LLMC_MAGIC {
        return format!(
            "starts with llm.c's magic number {LLMC_MAGIC} but is {size} bytes, shorter than \
             llm.c's {LLMC_HEADER}-byte header: the file is cut short"
        );
    }
    let raw = match size % 2 {
        0 => format!(
            "its {size} bytes are a whole number of u16 ids, as in nanoGPT's raw files (no \
             header)"
        ),
        _ => format!("its {size} bytes are not a whole number of u16 ids either"),
    };
    format!(
        "has no llm.c header: its first 4 bytes read {read} (a little-endian i32) where llm.c's \
         token files start with the magic number {LLMC_MAGIC}; {raw}; say how wide its ids \
         are: Some(TokenWidth::U16) for nanoGPT's files, Some(TokenWidth::U32) for ids past \
         65535"
    )
}

impl Dataset for TokenFile {
    type Item = Vec<u32>;
    type Batch = (Tensor, Tensor);

    fn len(&self) -> usize {
        self.windows
    }

    fn get(&self, index: usize) -> Result<Vec<u32>> {
        if index >= self.windows {
            return Err(Error::Usage(format!(
                "token window {index} asked of a corpus of {} windows",
                self.windows
            )));
        }
        self.window(index)
    }

    fn files(&self) -> Result<Vec<DataFile>> {
        self.parts
            .iter()
            .map(|p| DataFile::of(&p.path, &p.file))
            .collect()
    }

    fn collate(&self, items: Vec<Vec<u32>>, device: &Device) -> Result<(Tensor, Tensor)> {
        next_token_batch(&items, self.seq_len, device)
    }

    /// Reads the batch's windows, one read for each run of consecutive windows that lie next
    /// to or over each other in one file (a whole batch, read in order), into one reused
    /// buffer, and decodes them straight into the inputs and targets: no vector per window.
    fn get_batch(&self, indices: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
        let (b, t, stride) = (indices.len(), self.seq_len, self.stride);
        let mut inputs = Vec::with_capacity(b * t);
        let mut targets = Vec::with_capacity(b * t);
        let (mut bytes, mut ids) = (Vec::new(), Vec::new());
        let mut k = 0;
        while k < b {
            let (p, at) = self.place(indices[k])?;
            // The run: windows index, index + 1, ... of the same file, read as one span when
            // no gap lies between them.
            let mut n = 1;
            while stride <= t + 1
                && k + n < b
                && indices[k + n] == indices[k] + n
                && self
                    .place(indices[k + n])
                    .is_ok_and(|(q, _)| std::ptr::eq(p, q))
            {
                n += 1;
            }
            let w = p.width.bytes() as usize;
            bytes.resize(((n - 1) * stride + t + 1) * w, 0);
            p.file
                .read_exact_at(&mut bytes, at)
                .map_err(|e| Error::io(format!("reading tokens from {}", p.path.display()), e))?;
            let decode = |bytes: &[u8], into: &mut Vec<u32>| match p.width {
                TokenWidth::U16 => into.extend(
                    bytes
                        .chunks_exact(2)
                        .map(|b| u16::from_le_bytes([b[0], b[1]]) as u32),
                ),
                TokenWidth::U32 => into.extend(
                    bytes
                        .chunks_exact(4)
                        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                ),
            };
            if stride == t {
                // Windows that tile the span: the inputs are its first n * t ids, the targets
                // the same shifted by one, each decoded straight from the bytes.
                decode(&bytes[..n * t * w], &mut inputs);
                decode(&bytes[w..], &mut targets);
            } else {
                // Window j's t + 1 ids start at j * stride: the first t are inputs, the last t
                // the targets.
                ids.clear();
                decode(&bytes, &mut ids);
                for j in 0..n {
                    let from = j * stride;
                    inputs.extend_from_slice(&ids[from..from + t]);
                    targets.extend_from_slice(&ids[from + 1..from + t + 1]);
                }
            }
            k += n;
        }
        Ok((
            Tensor::from_vec(inputs, (b, t), device)?,
            Tensor::from_vec(targets, (b, t), device)?,
        ))
    }
}

/// Windows of `seq_len + 1` ids as a batch: the first `seq_len` of each as inputs, the last
/// `seq_len` as their next-token targets, both `(batch, seq_len)`.
pub(super) fn next_token_batch(
    windows: &[Vec<u32>],
    seq_len: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let (b, t) = (windows.len(), seq_len);
    let mut inputs = Vec::with_capacity(b * t);
    let mut targets = Vec::with_capacity(b * t);
    for w in windows {
        inputs.extend_from_slice(&w[..t]);
        targets.extend_from_slice(&w[1..]);
    }
    Ok((
        Tensor::from_vec(inputs, (b, t), device)?,
        Tensor::from_vec(targets, (b, t), device)?,
    ))
}

#[cfg(test)]
#[path = "token_file_tests.rs"]
mod tests;
