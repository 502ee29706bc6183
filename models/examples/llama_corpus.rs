//! The llama example trained from a corpus on disk, as a pre-training job reads one: the
//! program writes a text of numbered 32-byte lines and its byte-level token file (u16 ids, as
//! nanoGPT's `.bin`), then trains a small Llama (ivme's trainable family, every position predicting its next
//! byte) on windows of that file,
//! read from disk batch by batch and built two batches ahead on a background thread
//! (`prefetch(2)`), under `#[accelerate]`. A run stopped mid-epoch resumes on any number of
//! processes: the loader's position is saved in the checkpoint by samples.
//!
//! ```text
//! cargo build --release --workspace --bins --examples
//! target/release/ivme launch --num_processes 2 target/release/examples/llama_corpus stop_after=6
//! target/release/ivme launch --num_processes 3 target/release/examples/llama_corpus
//! ```
//!
//! Arguments (all optional): `dir=DIR` (the corpus and the checkpoints, default
//! `llama_corpus_run`), `epochs=N` (2), `stop_after=K` (return after the K-th optimizer step of
//! this run, as a crash would), `data=tokens|lines|parquet|arrow` (the token file through
//! `TokenFile`; or the text's lines packed with a newline separator through `Packed`, read from
//! the text, from a Parquet file of the lines' ids, or from a Hugging Face style cache folder of
//! Arrow files: the same stream of ids),
//! `seen=DIR` (each process appends the line number that starts each window it trains on, per
//! epoch, to `DIR/rank{R}.txt`, and how many rows of its last batch were padding).

// The model and loss of the other llama examples; their in-memory batches are not used here.
#[allow(dead_code)]
#[path = "support/bytes_llama.rs"]
mod bytes_llama;
#[path = "support/init.rs"]
mod init;

use arrow_array::builder::{ListBuilder, UInt16Builder};
use arrow_array::{ArrayRef, RecordBatch, StringArray};
use bytes_llama::{config, loss_of};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use ivme::data::{
    ArrowFiles, DataLoader, Dataset, Packed, ParquetFiles, Row, TextLines, TokenFile, TokenWidth,
};
use ivme::models::llama::Llama;
use ivme::optim::{AdamW, ParamsAdamW};
use ivme::{Accelerator, Error};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Bytes of context per window: one line of the corpus.
const CONTEXT: usize = 32;
/// Windows per micro-batch.
const BATCH: usize = 8;
/// Lines of the corpus.
const LINES: usize = 240;

/// The corpus: numbered lines of exactly [`CONTEXT`] bytes (newline included), so window `i`
/// starts with line `i`'s number.
fn corpus_text() -> String {
    let words = [
        "data from disk",
        "read window by window",
        "prefetched ahead",
        "sharded by rank",
        "resumed by samples",
        "on any world size",
    ];
    (0..LINES)
        .map(|i| format!("{i:06} {:<24}\n", words[i % words.len()]))
        .collect()
}

/// Writes the text and its token file (rank 0), unless they are there already.
fn write_corpus(dir: &Path) -> ivme::Result<()> {
    let io = |what: &str| {
        let what = what.to_string();
        move |e| Error::io(what.clone(), e)
    };
    std::fs::create_dir_all(dir).map_err(io("creating the corpus folder"))?;
    let text = corpus_text();
    let ids: Vec<u8> = text
        .bytes()
        .flat_map(|b| u16::from(b).to_le_bytes())
        .collect();
    for (name, bytes) in [("corpus.txt", text.as_bytes()), ("corpus.bin", &ids[..])] {
        let path = dir.join(name);
        if !path.exists() {
            // Written aside and renamed, so no process ever opens half a file.
            let part = dir.join(format!("{name}.part"));
            std::fs::write(&part, bytes).map_err(io("writing the corpus"))?;
            std::fs::rename(&part, &path).map_err(io("writing the corpus"))?;
        }
    }
    write_tables(dir, &text)
}

/// Writes the text's lines as a table (`line`: the text, `ids`: its bytes as u16 ids, newline
/// left out) to `corpus.parquet` (row groups of 50 lines) and to a Hugging Face style cache
/// folder `hf/` (two stream-format Arrow shards of the `train` split).
fn write_tables(dir: &Path, text: &str) -> ivme::Result<()> {
    let fail = |e: &dyn std::fmt::Display| Error::Usage(format!("writing the corpus tables: {e}"));
    let lines: Vec<&str> = text.lines().collect();
    let table = |lines: &[&str]| -> ivme::Result<RecordBatch> {
        let mut ids = ListBuilder::new(UInt16Builder::new());
        for line in lines {
            ids.values()
                .append_slice(&line.bytes().map(u16::from).collect::<Vec<_>>());
            ids.append(true);
        }
        RecordBatch::try_from_iter([
            (
                "line",
                Arc::new(StringArray::from(lines.to_vec())) as ArrayRef,
            ),
            ("ids", Arc::new(ids.finish()) as ArrayRef),
        ])
        .map_err(|e| fail(&e))
    };
    let parquet = dir.join("corpus.parquet");
    if !parquet.exists() {
        let part = dir.join("corpus.parquet.part");
        let file = std::fs::File::create(&part).map_err(|e| fail(&e))?;
        let props = parquet::file::properties::WriterProperties::builder()
            .set_max_row_group_row_count(Some(50))
            .build();
        let batch = table(&lines)?;
        let mut w = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), Some(props))
            .map_err(|e| fail(&e))?;
        w.write(&batch).map_err(|e| fail(&e))?;
        w.close().map_err(|e| fail(&e))?;
        std::fs::rename(&part, &parquet).map_err(|e| fail(&e))?;
    }
    let hf = dir.join("hf");
    if !hf.exists() {
        let part = dir.join("hf.part");
        std::fs::create_dir_all(&part).map_err(|e| fail(&e))?;
        let half = lines.len() / 2;
        for (k, shard) in [&lines[..half], &lines[half..]].into_iter().enumerate() {
            let path = part.join(format!("corpus-train-{k:05}-of-00002.arrow"));
            let file = std::fs::File::create(&path).map_err(|e| fail(&e))?;
            let batch = table(shard)?;
            let mut w = arrow_ipc::writer::StreamWriter::try_new(file, &batch.schema())
                .map_err(|e| fail(&e))?;
            // Batches of 40 lines, as a cache holds several per shard.
            for at in (0..batch.num_rows()).step_by(40) {
                let n = 40.min(batch.num_rows() - at);
                w.write(&batch.slice(at, n)).map_err(|e| fail(&e))?;
            }
            w.finish().map_err(|e| fail(&e))?;
        }
        std::fs::write(part.join("dataset_info.json"), "{}").map_err(|e| fail(&e))?;
        std::fs::rename(&part, &hf).map_err(|e| fail(&e))?;
    }
    Ok(())
}

/// The number of the line a window starts with.
fn line_of(window: &[u32]) -> usize {
    window[..6]
        .iter()
        .fold(0, |n, &b| n * 10 + (b as usize - usize::from(b'0')))
}

/// The windows: from the token file, or packed from the text's lines.
enum Corpus {
    Tokens(TokenFile),
    Lines(Packed<TextLines>),
    Parquet(Packed<ParquetFiles>),
    Arrow(Packed<ArrowFiles>),
}

impl Dataset for Corpus {
    type Item = Vec<u32>;
    type Batch = (Tensor, Tensor);

    fn len(&self) -> usize {
        match self {
            Corpus::Tokens(c) => c.len(),
            Corpus::Lines(c) => c.len(),
            Corpus::Parquet(c) => c.len(),
            Corpus::Arrow(c) => c.len(),
        }
    }

    fn get(&self, index: usize) -> ivme::Result<Vec<u32>> {
        match self {
            Corpus::Tokens(c) => c.get(index),
            Corpus::Lines(c) => c.get(index),
            Corpus::Parquet(c) => c.get(index),
            Corpus::Arrow(c) => c.get(index),
        }
    }

    fn collate(&self, items: Vec<Vec<u32>>, device: &Device) -> ivme::Result<(Tensor, Tensor)> {
        match self {
            Corpus::Tokens(c) => c.collate(items, device),
            Corpus::Lines(c) => c.collate(items, device),
            Corpus::Parquet(c) => c.collate(items, device),
            Corpus::Arrow(c) => c.collate(items, device),
        }
    }
}

/// Trains on `corpus` for `epochs` epochs, a plain candle loop but for the attribute: it
/// accumulates, syncs and clips (as the builder in `main` says), and the prepared loader
/// shards the windows across processes and resumes from the checkpoint's position.
#[ivme::accelerate]
fn fit(
    acc: &mut Accelerator,
    corpus: Corpus,
    epochs: usize,
    stop_after: Option<usize>,
    mut seen: Option<std::fs::File>,
) -> ivme::Result<VarMap> {
    let device = Device::Cpu;
    let cfg = config();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
    let model = Llama::new(&cfg, vb)?;
    init::reinit(&varmap, 17, 0.05)?;
    let mut opt = AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: 3e-3,
            ..Default::default()
        },
    )?;
    let mut loader = acc.prepare(
        DataLoader::new(corpus, BATCH)
            .shuffle(true)
            .seed(3)
            .prefetch(2),
    )?;
    if let Some(dir) = acc.load_state_if_any()? {
        acc.print(format!("resumed from {}", dir.display()));
    }
    let mut steps = 0;
    let mut log = |line: String| -> ivme::Result<()> {
        if let Some(f) = seen.as_mut() {
            writeln!(f, "{line}").map_err(|e| Error::io("writing the seen windows", e))?;
        }
        Ok(())
    };
    for epoch in 0..epochs {
        let (mut total, mut batches) = (0f32, 0usize);
        for batch in loader.iter() {
            let (x, y) = batch?;
            for row in x.to_vec2::<u32>()? {
                log(format!("{epoch} {}", line_of(&row)))?;
            }
            // Every position predicts its next token.
            let loss = loss_of(&model.forward(&x)?, &y)?;
            let grads = loss.backward()?;
            opt.step(&grads)?;
            total += loss.to_scalar::<f32>()?;
            batches += 1;
            if acc.sync_gradients() {
                steps += 1;
                if steps % 3 == 0 || Some(steps) == stop_after {
                    acc.save_state(None)?;
                }
                if Some(steps) == stop_after {
                    acc.print(format!("stopping after {steps} steps, as asked"));
                    return Ok(varmap);
                }
            }
        }
        if batches == 0 {
            continue; // an epoch the checkpoint had already finished
        }
        log(format!("{epoch} pad {}", loader.last_batch_padding()))?;
        acc.print(format!(
            "epoch {epoch}: train loss {:.3} (this process)",
            total / batches as f32
        ));
    }
    Ok(varmap)
}

fn main() -> ivme::Result<()> {
    let args: BTreeMap<String, String> = std::env::args()
        .skip(1)
        .filter_map(|a| a.split_once('=').map(|(k, v)| (k.into(), v.into())))
        .collect();
    let get = |k: &str| args.get(k).cloned();
    let dir = PathBuf::from(get("dir").unwrap_or_else(|| "llama_corpus_run".into()));
    let mut acc = Accelerator::builder()
        .grad_accum(2)
        .clip_grad_norm(1.0)
        .seed(17)
        .project_dir(dir.join("project"))
        .total_limit(2)
        .build()?;
    if acc.is_main_process() {
        write_corpus(&dir)?;
    }
    acc.wait_for_everyone()?;
    let epochs = get("epochs").and_then(|v| v.parse().ok()).unwrap_or(2);
    let stop_after = get("stop_after").and_then(|v| v.parse().ok());
    let seen = match get("seen") {
        Some(d) => {
            let path = Path::new(&d).join(format!("rank{}.txt", acc.process_index()));
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
            Some(f)
        }
        None => None,
    };
    let corpus = match get("data").as_deref().unwrap_or("tokens") {
        "tokens" => Corpus::Tokens(TokenFile::open(
            &[dir.join("corpus.bin")],
            Some(TokenWidth::U16),
            CONTEXT,
        )?),
        "lines" => {
            let lines = TextLines::open(&[dir.join("corpus.txt")])?;
            let bytes = |line: String| Ok(line.bytes().map(u32::from).collect());
            Corpus::Lines(Packed::new(lines, CONTEXT, Some(u32::from(b'\n')), bytes)?)
        }
        // The tables hold each line's ids without its newline: the separator puts it back.
        "parquet" => {
            let rows = ParquetFiles::open(&[dir.join("corpus.parquet")], &["ids"])?;
            let ids = |row: Row| row.ids("ids");
            Corpus::Parquet(Packed::new(rows, CONTEXT, Some(u32::from(b'\n')), ids)?)
        }
        "arrow" => {
            let rows = ArrowFiles::open_hf(dir.join("hf"), "train", &["ids"])?;
            let ids = |row: Row| row.ids("ids");
            Corpus::Arrow(Packed::new(rows, CONTEXT, Some(u32::from(b'\n')), ids)?)
        }
        other => {
            return Err(Error::Usage(format!(
                "data={other}: use tokens, lines, parquet or arrow"
            )))
        }
    };
    acc.print(format!(
        "{} windows of {CONTEXT} bytes on {} process(es)",
        corpus.len(),
        acc.num_processes()
    ));
    fit(&mut acc, corpus, epochs, stop_after, seen)?;
    Ok(())
}
