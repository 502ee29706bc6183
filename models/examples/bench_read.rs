//! How fast do the disk data sets hand out tokens, against reading the same file with `cat`?
//! A 64 MiB corpus of u16 token ids as a token file, an Arrow IPC file and a Parquet file
//! (snappy) of 1024-token rows; each reader in its own process, rounds alternating, every file
//! in the page cache first (this measures decoding and copying, not the disk).
//!
//! ```text
//! cargo build --release -p ivme-models --examples
//! target/release/examples/bench_read [rounds]
//! ```
//!
//! Each round builds an Accelerator first, as a training program does (it tunes glibc's
//! allocator for large buffers). Loaders hand out batches of 64 rows of 1024 tokens (as `u32` tensors for the token file, as
//! `Row`s whose ids are read with `Row::ids` for the tables), up to 256 batches (16 M tokens).

#[path = "../../examples/support/rounds.rs"]
mod rounds;

use arrow_array::builder::{ListBuilder, UInt16Builder};
use arrow_array::{ArrayRef, RecordBatch};
use ivme::data::{ArrowFiles, DataLoader, Dataset, ParquetFiles, Row, TokenFile, TokenWidth};
use ivme::Error;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

const TOKENS: usize = 32 << 20;
const ROW: usize = 1024;
const BATCH: usize = 64;
const MAX_BATCHES: usize = 256;

fn fail(e: impl std::fmt::Display) -> Error {
    Error::Usage(format!("bench_read: {e}"))
}

/// Writes the corpus in the three layouts, unless there already.
fn write_files(dir: &Path) -> ivme::Result<()> {
    std::fs::create_dir_all(dir).map_err(fail)?;
    let id = |i: usize| ((i * 7919) % 50_000) as u16;
    let bin = dir.join("corpus.bin");
    if !bin.exists() {
        let bytes: Vec<u8> = (0..TOKENS).flat_map(|i| id(i).to_le_bytes()).collect();
        std::fs::write(&bin, bytes).map_err(fail)?;
    }
    let table = |from: usize, rows: usize| -> ivme::Result<RecordBatch> {
        let mut ids = ListBuilder::new(UInt16Builder::new());
        for r in from..from + rows {
            ids.values()
                .append_slice(&(r * ROW..(r + 1) * ROW).map(id).collect::<Vec<_>>());
            ids.append(true);
        }
        RecordBatch::try_from_iter([("ids", Arc::new(ids.finish()) as ArrayRef)]).map_err(fail)
    };
    let rows = TOKENS / ROW;
    let arrow = dir.join("corpus.arrow");
    if !arrow.exists() {
        let first = table(0, 1024)?;
        let file = std::fs::File::create(&arrow).map_err(fail)?;
        let mut w = arrow_ipc::writer::FileWriter::try_new(file, &first.schema()).map_err(fail)?;
        for at in (0..rows).step_by(1024) {
            w.write(&table(at, 1024)?).map_err(fail)?;
        }
        w.finish().map_err(fail)?;
    }
    let parquet = dir.join("corpus.parquet");
    if !parquet.exists() {
        let first = table(0, 1024)?;
        let file = std::fs::File::create(&parquet).map_err(fail)?;
        let props = parquet::file::properties::WriterProperties::builder()
            .set_compression(parquet::basic::Compression::SNAPPY)
            .set_max_row_group_row_count(Some(1024))
            .build();
        let mut w = parquet::arrow::ArrowWriter::try_new(file, first.schema(), Some(props))
            .map_err(fail)?;
        for at in (0..rows).step_by(1024) {
            w.write(&table(at, 1024)?).map_err(fail)?;
        }
        w.close().map_err(fail)?;
    }
    Ok(())
}

/// Reads up to [`MAX_BATCHES`] batches of `loader`, counting tokens with `count`.
fn drain<D: Dataset>(
    mut loader: DataLoader<D>,
    count: impl Fn(D::Batch) -> ivme::Result<usize>,
) -> ivme::Result<(usize, f64)> {
    let t = Instant::now();
    let mut tokens = 0;
    for batch in loader.iter().take(MAX_BATCHES) {
        tokens += count(batch?)?;
    }
    Ok((tokens, t.elapsed().as_secs_f64()))
}

fn row_tokens(rows: Vec<Row>) -> ivme::Result<usize> {
    rows.iter().map(|r| Ok(r.ids("ids")?.len())).sum()
}

/// One round: prints the tokens per second of `mode`.
fn one(mode: &str, dir: &Path) -> ivme::Result<()> {
    // A training program has an Accelerator, which sets glibc's allocator for candle's large
    // buffers (docs/performance.md); the batches here are such buffers.
    let _acc = ivme::Accelerator::builder().cpu(true).build()?;
    let tokens_of = |(x, _y): (candle_core::Tensor, candle_core::Tensor)| Ok(x.elem_count());
    let open_tokens = || TokenFile::open(&[dir.join("corpus.bin")], Some(TokenWidth::U16), ROW);
    let (tokens, secs) = match mode {
        "cat" => {
            let t = Instant::now();
            let status = std::process::Command::new("cat")
                .arg(dir.join("corpus.bin"))
                .stdout(std::process::Stdio::null())
                .status()
                .map_err(fail)?;
            if !status.success() {
                return Err(fail("cat failed"));
            }
            (TOKENS, t.elapsed().as_secs_f64())
        }
        "tokens" => drain(DataLoader::new(open_tokens()?, BATCH), tokens_of)?,
        "tokens-shuffled" => drain(
            DataLoader::new(open_tokens()?, BATCH).shuffle(true),
            tokens_of,
        )?,
        "tokens-prefetch" => drain(
            DataLoader::new(open_tokens()?, BATCH)
                .shuffle(true)
                .prefetch(4)
                .workers(2),
            tokens_of,
        )?,
        "tokens-in-order-prefetch" => drain(
            DataLoader::new(open_tokens()?, BATCH)
                .prefetch(4)
                .workers(2),
            tokens_of,
        )?,
        "arrow-shuffled" => {
            let rows = ArrowFiles::open(&[dir.join("corpus.arrow")], &["ids"])?;
            drain(DataLoader::new(rows, BATCH).shuffle(true), row_tokens)?
        }
        "parquet" => {
            let rows = ParquetFiles::open(&[dir.join("corpus.parquet")], &["ids"])?;
            drain(DataLoader::new(rows, BATCH), row_tokens)?
        }
        "parquet-shuffled" => {
            let rows = ParquetFiles::open(&[dir.join("corpus.parquet")], &["ids"])?;
            drain(DataLoader::new(rows, BATCH).shuffle(true), row_tokens)?
        }
        other => return Err(fail(format!("unknown mode {other}"))),
    };
    println!("{}", tokens as f64 / secs);
    Ok(())
}

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("one") {
        return one(&args[1], Path::new(&args[2]));
    }
    let rounds: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(3);
    let dir: PathBuf = std::env::temp_dir().join("ivme-bench-read");
    write_files(&dir)?;
    // Every file into the page cache before the first round.
    for f in ["corpus.bin", "corpus.arrow", "corpus.parquet"] {
        std::fs::read(dir.join(f)).map_err(fail)?;
    }
    let modes = [
        "cat",
        "tokens",
        "tokens-shuffled",
        "tokens-prefetch",
        "tokens-in-order-prefetch",
        "arrow-shuffled",
        "parquet",
        "parquet-shuffled",
    ];
    let dir_arg = dir.display().to_string();
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    for r in 0..rounds {
        for k in 0..modes.len() {
            let i = (k + r) % modes.len();
            rates[i].push(rounds::in_own_process(&["one", modes[i], &dir_arg], &[])?);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let cat = median(&mut rates[0].clone());
    println!("| reader | M tokens/s | GB/s of u16 ids | of cat |");
    println!("|---|---|---|---|");
    for (mode, rate) in modes.iter().zip(rates.iter_mut()) {
        let rate = median(rate);
        println!(
            "| {mode} | {:.1} | {:.2} | {:.3}x |",
            rate / 1e6,
            rate * 2.0 / 1e9,
            rate / cat
        );
    }
    println!("(median of {rounds} rounds, one process each; files cached, {TOKENS} tokens)");
    Ok(())
}
