//! Variable-length documents packed into fixed windows, as language-model pre-training reads
//! them: the documents, each turned into token ids and followed by a separator, make one
//! stream in their given order, and window `i` is `seq_len + 1` ids of that stream starting at
//! `i * seq_len` (the inputs and their next-token targets).

use super::{DataFile, Dataset};
use crate::{Error, Result};
use candle_core::{Device, Tensor};

/// How a document becomes token ids.
type Tokenize<T> = Box<dyn Fn(T) -> Result<Vec<u32>> + Send + Sync>;

/// The documents of a [`Dataset`] (lines of [`TextLines`](super::TextLines), say) packed into
/// windows of `seq_len` token ids with their next-token targets, `(inputs, targets)`, `u32`,
/// as [`TokenFile`](super::TokenFile) gives them.
///
/// Packing is deterministic: documents in the data set's order, each tokenized by the given
/// function and followed by `separator` (an end-of-text id) when there is one, make one
/// stream; window `i` starts at id `i * seq_len`, so windows cross document boundaries and
/// no id is dropped except the stream's tail shorter than one window. Opening tokenizes every
/// document once to learn its length (only the lengths are kept: 8 bytes a document); a
/// window tokenizes again just the documents it overlaps. A document whose length changed
/// since then (a file edited under a running job, a tokenizer that is not deterministic) is an
/// error naming it, never a silently shifted window. A [`DataLoader`](super::DataLoader) over
/// it shuffles windows, shards them across processes and resumes exactly.
///
/// ```no_run
/// # fn main() -> ivme::Result<()> {
/// use ivme::data::{DataLoader, Packed, TextLines};
/// let lines = TextLines::open(&["corpus.txt"])?;
/// // Byte-level ids, 256 as the separator.
/// let bytes = |line: String| Ok(line.bytes().map(u32::from).collect());
/// let windows = Packed::new(lines, 128, Some(256), bytes)?;
/// let loader = DataLoader::new(windows, 16).prefetch(2);
/// # let _ = loader; Ok(()) }
/// ```
pub struct Packed<D: Dataset> {
    docs: D,
    tokenize: Tokenize<D::Item>,
    /// Where each document's ids end in the stream, its separator included.
    ends: Vec<u64>,
    seq_len: usize,
    separator: Option<u32>,
    windows: usize,
}

impl<D: Dataset> std::fmt::Debug for Packed<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Packed")
            .field("documents", &self.ends.len())
            .field("tokens", &self.tokens())
            .field("seq_len", &self.seq_len)
            .field("separator", &self.separator)
            .field("windows", &self.windows)
            .finish()
    }
}

impl<D: Dataset> Packed<D> {
    /// Packs the documents of `docs`, each made into ids by `tokenize`, into windows of
    /// `seq_len` ids; `separator` follows every document when given. Tokenizes every document
    /// once; an error of `tokenize` or of the data set names the document. A `seq_len` of 0 or
    /// a stream too short for one window is an error.
    pub fn new(
        docs: D,
        seq_len: usize,
        separator: Option<u32>,
        tokenize: impl Fn(D::Item) -> Result<Vec<u32>> + Send + Sync + 'static,
    ) -> Result<Packed<D>> {
        if seq_len == 0 {
            return Err(Error::Usage(
                "packed windows need a seq_len of at least 1".into(),
            ));
        }
        let tokenize: Tokenize<D::Item> = Box::new(tokenize);
        let mut ends = Vec::with_capacity(docs.len());
        let mut at = 0u64;
        for d in 0..docs.len() {
            let ids = document(&docs, &tokenize, d)?;
            at += ids.len() as u64 + u64::from(separator.is_some());
            ends.push(at);
        }
        // Window `i` needs ids up to `i * seq_len + seq_len` inclusive.
        let windows = (at.saturating_sub(1) / seq_len as u64) as usize;
        if windows == 0 {
            return Err(Error::Usage(format!(
                "{} documents make {at} token ids, too few for one window of {seq_len} ids and \
                 its target",
                docs.len()
            )));
        }
        Ok(Packed {
            docs,
            tokenize,
            ends,
            seq_len,
            separator,
            windows,
        })
    }

    /// The number of ids in the stream, separators included.
    pub fn tokens(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }

    /// The number of documents.
    pub fn documents(&self) -> usize {
        self.ends.len()
    }

    /// Window `index`: `seq_len + 1` ids from id `index * seq_len` of the stream.
    fn window(&self, index: usize) -> Result<Vec<u32>> {
        let start = index as u64 * self.seq_len as u64;
        let want = self.seq_len + 1;
        let mut out = Vec::with_capacity(want);
        // The first document that ends after `start`.
        let mut d = self.ends.partition_point(|&e| e <= start);
        let mut skip = start - if d == 0 { 0 } else { self.ends[d - 1] };
        while out.len() < want {
            let mut ids = document(&self.docs, &self.tokenize, d)?;
            let begin = if d == 0 { 0 } else { self.ends[d - 1] };
            let expected = self.ends[d] - begin - u64::from(self.separator.is_some());
            if ids.len() as u64 != expected {
                return Err(Error::Usage(format!(
                    "document {d} now makes {} token ids, but {expected} when the documents \
                     were packed: its source changed, or the tokenizer is not deterministic; \
                     pack the data again",
                    ids.len()
                )));
            }
            ids.extend(self.separator);
            let from = skip as usize;
            let take = (ids.len() - from).min(want - out.len());
            out.extend_from_slice(&ids[from..from + take]);
            skip = 0;
            d += 1;
        }
        Ok(out)
    }
}

/// Document `d` of `docs` as ids, with errors that name it.
fn document<D: Dataset>(docs: &D, tokenize: &Tokenize<D::Item>, d: usize) -> Result<Vec<u32>> {
    let named = |e: Error| Error::Usage(format!("document {d} of the packed data: {e}"));
    tokenize(docs.get(d).map_err(named)?).map_err(named)
}

impl<D: Dataset> Dataset for Packed<D> {
    type Item = Vec<u32>;
    type Batch = (Tensor, Tensor);

    fn len(&self) -> usize {
        self.windows
    }

    fn get(&self, index: usize) -> Result<Vec<u32>> {
        if index >= self.windows {
            return Err(Error::Usage(format!(
                "packed window {index} asked of {} windows",
                self.windows
            )));
        }
        self.window(index)
    }

    fn files(&self) -> Result<Vec<DataFile>> {
        self.docs.files()
    }

    fn collate(&self, items: Vec<Vec<u32>>, device: &Device) -> Result<(Tensor, Tensor)> {
        super::token_file::next_token_batch(&items, self.seq_len, device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::TensorDataset;

    /// Documents as lists of ids, one data set sample each.
    struct Docs(Vec<Vec<u32>>);

    impl Dataset for Docs {
        type Item = Vec<u32>;
        type Batch = ();
        fn len(&self) -> usize {
            self.0.len()
        }
        fn get(&self, i: usize) -> Result<Vec<u32>> {
            Ok(self.0[i].clone())
        }
        fn collate(&self, _: Vec<Vec<u32>>, _: &Device) -> Result<()> {
            Ok(())
        }
    }

    fn docs() -> Vec<Vec<u32>> {
        // Lengths 0 to 12, so windows start inside, at the end of and between documents.
        (0..13u32)
            .map(|d| (0..d).map(|k| 1000 * d + k).collect())
            .collect()
    }

    fn packed(seq_len: usize, sep: Option<u32>) -> Packed<Docs> {
        Packed::new(Docs(docs()), seq_len, sep, Ok).unwrap()
    }

    #[test]
    fn windows_are_the_stream_of_documents_and_separators_cut_in_order() {
        for (seq_len, sep) in [
            (1, Some(7)),
            (4, Some(7)),
            (5, None),
            (9, Some(7)),
            (77, None),
        ] {
            let stream: Vec<u32> = docs()
                .into_iter()
                .flat_map(|d| d.into_iter().chain(sep))
                .collect();
            let p = packed(seq_len, sep);
            assert_eq!(p.tokens(), stream.len() as u64);
            assert_eq!(p.len(), (stream.len() - 1) / seq_len, "{seq_len}");
            for i in 0..p.len() {
                let w = p.get(i).unwrap();
                assert_eq!(
                    w,
                    stream[i * seq_len..i * seq_len + seq_len + 1],
                    "{seq_len} {i}"
                );
            }
            assert!(p.get(p.len()).is_err());
        }
    }

    #[test]
    fn a_batch_is_the_inputs_and_their_next_token_targets() {
        let p = packed(4, Some(7));
        let (x, y) = p.get_batch(&[3, 0], &Device::Cpu).unwrap();
        let (w3, w0) = (p.get(3).unwrap(), p.get(0).unwrap());
        assert_eq!(
            x.to_vec2::<u32>().unwrap(),
            vec![w3[..4].to_vec(), w0[..4].to_vec()]
        );
        assert_eq!(
            y.to_vec2::<u32>().unwrap(),
            vec![w3[1..].to_vec(), w0[1..].to_vec()]
        );
    }

    #[test]
    fn a_document_that_changed_length_is_named_not_read_shifted() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let changed = Arc::new(AtomicBool::new(false));
        let c = changed.clone();
        let p = Packed::new(Docs(docs()), 4, Some(7), move |mut d: Vec<u32>| {
            if c.load(Ordering::Relaxed) && d.len() == 6 {
                d.push(1);
            }
            Ok(d)
        })
        .unwrap();
        let before = p.get(5).unwrap();
        changed.store(true, Ordering::Relaxed);
        // Window 5 (ids 20..25) ends in document 6 (ids 21..28 with its separator).
        let e = p.get(5).unwrap_err().to_string();
        assert!(e.contains("document 6 now makes 7 token ids, but 6"), "{e}");
        changed.store(false, Ordering::Relaxed);
        assert_eq!(p.get(5).unwrap(), before);
    }

    #[test]
    fn bad_input_is_refused_with_the_reason() {
        let e = Packed::new(Docs(docs()), 0, None, Ok).unwrap_err();
        assert!(e.to_string().contains("seq_len of at least 1"), "{e}");
        let e = Packed::new(Docs(vec![vec![1, 2]]), 2, None, Ok).unwrap_err();
        assert!(e.to_string().contains("too few for one window"), "{e}");
        let tensor = candle_core::Tensor::arange(0u32, 6, &Device::Cpu).unwrap();
        let rows = TensorDataset::new(tensor).unwrap();
        let e = Packed::new(rows, 2, None, |t: Tensor| {
            match t.to_scalar::<u32>().unwrap() {
                3 => Err(Error::Usage("cannot tokenize this".into())),
                v => Ok(vec![v; 2]),
            }
        })
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("document 3 of the packed data: cannot tokenize this"),
            "{e}"
        );
    }
}
