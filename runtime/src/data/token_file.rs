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
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ivme-tokens-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn raw_u16(path: &Path, ids: impl Iterator<Item = u16>) {
        let bytes: Vec<u8> = ids.flat_map(u16::to_le_bytes).collect();
        std::fs::write(path, bytes).unwrap();
    }

    fn llmc_u32(path: &Path, ids: &[u32]) {
        let mut header = [0i32; 256];
        header[0] = LLMC_MAGIC;
        header[1] = 2;
        header[2] = ids.len() as i32;
        let mut bytes: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
        bytes.extend(ids.iter().flat_map(|i| i.to_le_bytes()));
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn windows_and_their_next_token_targets_come_from_every_file_in_order() {
        let d = scratch("windows");
        raw_u16(&d.join("a.bin"), 0..10); // windows of 4: [0..5), [4..9)
        raw_u16(&d.join("b.bin"), 100..103); // too short for a window of 4 (needs 5)
        raw_u16(&d.join("c.bin"), 200..206); // [200..205)
        let paths = [d.join("a.bin"), d.join("b.bin"), d.join("c.bin")];
        let corpus = TokenFile::open(&paths, Some(TokenWidth::U16), 4).unwrap();
        assert_eq!(corpus.len(), 3);
        assert_eq!(corpus.tokens(), 19);
        assert_eq!(corpus.get(0).unwrap(), [0, 1, 2, 3, 4]);
        assert_eq!(corpus.get(1).unwrap(), [4, 5, 6, 7, 8]);
        assert_eq!(corpus.get(2).unwrap(), [200, 201, 202, 203, 204]);
        assert!(corpus.get(3).is_err());
        let (x, y) = corpus.get_batch(&[2, 0], &Device::Cpu).unwrap();
        assert_eq!(
            x.to_vec2::<u32>().unwrap(),
            [[200, 201, 202, 203], [0, 1, 2, 3]]
        );
        assert_eq!(
            y.to_vec2::<u32>().unwrap(),
            [[201, 202, 203, 204], [1, 2, 3, 4]]
        );
        let overlapping = TokenFile::open(&paths[..1], Some(TokenWidth::U16), 4)
            .unwrap()
            .with_stride(2)
            .unwrap();
        assert_eq!(overlapping.len(), 3); // starts 0, 2, 4
        assert_eq!(overlapping.get(2).unwrap(), [4, 5, 6, 7, 8]);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn an_llmc_file_says_its_own_width_and_count() {
        let d = scratch("llmc");
        let ids: Vec<u32> = (0..9).map(|i| 70_000 + i).collect();
        llmc_u32(&d.join("train.bin"), &ids);
        let corpus = TokenFile::open(&[d.join("train.bin")], None, 3).unwrap();
        assert_eq!((corpus.len(), corpus.tokens()), (2, 9));
        assert_eq!(corpus.get(1).unwrap(), [70_003, 70_004, 70_005, 70_006]);
        let (x, y) = corpus.get_batch(&[1, 0, 1], &Device::Cpu).unwrap();
        let w = |i| corpus.get(i).unwrap();
        let (ex, ey) = next_token_batch(&[w(1), w(0), w(1)], 3, &Device::Cpu).unwrap();
        assert_eq!(x.to_vec2::<u32>().unwrap(), ex.to_vec2::<u32>().unwrap());
        assert_eq!(y.to_vec2::<u32>().unwrap(), ey.to_vec2::<u32>().unwrap());
        assert_eq!(y.to_vec2::<u32>().unwrap()[1], [70_001, 70_002, 70_003]);
        assert!(corpus.get_batch(&[2], &Device::Cpu).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn bad_token_files_are_refused_naming_the_file() {
        let d = scratch("bad");
        std::fs::write(d.join("odd.bin"), [1u8, 2, 3]).unwrap();
        let e = TokenFile::open(&[d.join("odd.bin")], Some(TokenWidth::U16), 1).unwrap_err();
        assert!(
            e.to_string().contains("odd.bin") && e.to_string().contains("3 bytes"),
            "{e}"
        );
        let e = TokenFile::open(&[d.join("odd.bin")], None, 1).unwrap_err();
        assert!(e.to_string().contains("how wide"), "{e}");
        // nanoGPT's raw layout opened as llm.c's: what was read, what was expected, which
        // reader fits.
        raw_u16(&d.join("raw.bin"), 0..1000u16);
        let e = TokenFile::open(&[d.join("raw.bin")], None, 1)
            .unwrap_err()
            .to_string();
        let read = i32::from_le_bytes([0, 0, 1, 0]);
        for part in [
            "raw.bin",
            &format!("read {read}"),
            "20240520",
            "2000 bytes are a whole number of u16 ids",
            "nanoGPT",
            "Some(TokenWidth::U16)",
        ] {
            assert!(e.contains(part), "no `{part}` in: {e}");
        }
        // llm.c's magic number in a file shorter than its header: cut short.
        std::fs::write(d.join("cut.bin"), LLMC_MAGIC.to_le_bytes()).unwrap();
        let e = TokenFile::open(&[d.join("cut.bin")], None, 1).unwrap_err();
        assert!(e.to_string().contains("cut short"), "{e}");
        let mut header = [0i32; 256];
        header[0] = LLMC_MAGIC;
        header[1] = 7;
        let bytes: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
        std::fs::write(d.join("v7.bin"), bytes).unwrap();
        let e = TokenFile::open(&[d.join("v7.bin")], None, 1).unwrap_err();
        assert!(e.to_string().contains("version 7"), "{e}");
        let e = TokenFile::open(&[d.join("missing.bin")], None, 1).unwrap_err();
        assert!(e.to_string().contains("missing.bin"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_batch_read_as_runs_equals_its_windows_read_one_by_one() -> Result<()> {
        let d = scratch("runs");
        raw_u16(&d.join("a.bin"), 0..1000u16);
        raw_u16(&d.join("b.bin"), 5000..5333u16);
        let paths = [d.join("a.bin"), d.join("b.bin")];
        for stride in [8, 5, 9, 20] {
            let corpus = TokenFile::open(&paths, Some(TokenWidth::U16), 8)?.with_stride(stride)?;
            let n = corpus.len();
            // In order across the two files' boundary, a run cut by a gap, and shuffled.
            let orders: [Vec<usize>; 3] = [
                (0..n).collect(),
                vec![3, 4, 5, 9, 10, n - 2, n - 1, 0],
                (0..n).map(|i| (i * 7919) % n).collect(),
            ];
            for order in orders {
                let (x, y) = corpus.get_batch(&order, &Device::Cpu)?;
                let (x, y) = (x.to_vec2::<u32>()?, y.to_vec2::<u32>()?);
                for (row, &i) in order.iter().enumerate() {
                    let w = corpus.window(i)?;
                    assert_eq!(
                        (&x[row][..], &y[row][..]),
                        (&w[..8], &w[1..]),
                        "stride {stride}"
                    );
                }
            }
        }
        let _ = std::fs::remove_dir_all(&d);
        Ok(())
    }
}
