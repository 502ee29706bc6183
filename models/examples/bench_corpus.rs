//! Does reading the corpus from disk cost the llama example any step time? The same tokens, the
//! same windows in the same shuffled order, trained from a token file on disk (with and
//! without `prefetch(2)`) and from tensors in memory; each in its own process, rounds
//! alternating.
//!
//! ```text
//! cargo build --release -p ivme-models --examples
//! target/release/examples/bench_corpus [rounds]
//! ```
//!
//! `bench_corpus one memory|disk|prefetch FILE` times one (milliseconds per optimizer step:
//! 2 micro-batches of 16 windows of 32 bytes, global-norm clipping at 1.0, AdamW, through a
//! prepared loader and an Accelerator).

#[allow(dead_code)]
#[path = "support/bytes_llama.rs"]
mod bytes_llama;
#[path = "support/init.rs"]
mod init;

use bytes_llama::{config, loss_of, text, BATCH, CONTEXT};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use ivme::data::{DataLoader, Dataset, TensorDataset, TokenFile, TokenWidth};
use ivme::models::llama::Llama;
use ivme::optim::{AdamW, ParamsAdamW};
use ivme::{Accelerator, Error};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

/// Optimizer steps timed per round (after two warm-up steps).
const STEPS: usize = 40;

/// Trains on `loader`'s batches and returns the median milliseconds per optimizer step.
fn train<D>(mut acc: Accelerator, loader: DataLoader<D>) -> ivme::Result<f64>
where
    D: Dataset<Batch = (Tensor, Tensor)> + Send + Sync + 'static,
{
    let cfg = config();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = Llama::new(&cfg, vb)?;
    init::reinit(&varmap, 17, 0.05)?;
    let opt = AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: 3e-3,
            ..Default::default()
        },
    )?;
    let (_varmap, mut opt) = acc.prepare((varmap, opt))?;
    let mut loader = acc.prepare(loader)?;
    let mut ms = Vec::new();
    let mut last = Instant::now();
    let mut steps = 0;
    for batch in loader.iter() {
        let (x, y) = batch?;
        let loss = loss_of(&model.forward(&x)?, &y)?;
        let grads = acc.backward(&loss)?;
        opt.step(&grads)?;
        if acc.sync_gradients() {
            steps += 1;
            if steps > 2 {
                ms.push(last.elapsed().as_secs_f64() * 1e3);
            }
            last = Instant::now();
            if steps == STEPS + 2 {
                break;
            }
        }
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

/// One round: `mode` over the token file `file`.
fn one(mode: &str, file: &Path) -> ivme::Result<()> {
    let acc = Accelerator::builder()
        .cpu(true)
        .grad_accum(2)
        .clip_grad_norm(1.0)
        .seed(17)
        .build()?;
    let corpus = TokenFile::open(&[file], Some(TokenWidth::U16), CONTEXT)?;
    let ms = match mode {
        "memory" => {
            // The same windows, read once into two tensors.
            let all: Vec<usize> = (0..corpus.len()).collect();
            let (x, y) = corpus.get_batch(&all, &Device::Cpu)?;
            let data = TensorDataset::new((x, y))?;
            train(acc, DataLoader::new(data, BATCH).shuffle(true).seed(3))?
        }
        "disk" => train(acc, DataLoader::new(corpus, BATCH).shuffle(true).seed(3))?,
        "prefetch" => train(
            acc,
            DataLoader::new(corpus, BATCH)
                .shuffle(true)
                .seed(3)
                .prefetch(2),
        )?,
        other => {
            return Err(Error::Usage(format!(
                "mode {other}: memory, disk, prefetch"
            )))
        }
    };
    println!("{ms:.3}");
    Ok(())
}

fn round(mode: &str, file: &Path) -> ivme::Result<f64> {
    let exe = std::env::current_exe().map_err(|e| Error::io("finding this program", e))?;
    let out = Command::new(exe)
        .args(["one", mode])
        .arg(file)
        .output()
        .map_err(|e| Error::io("starting a round", e))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim().parse().map_err(|_| {
        Error::Usage(format!(
            "a round printed `{text}`: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    })
}

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("one") {
        return one(&args[1], Path::new(&args[2]));
    }
    let rounds: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(5);
    // The example's text, repeated to a corpus of about 1 MB of u16 ids.
    let mut ids: Vec<u8> = Vec::new();
    while ids.len() < 1 << 20 {
        ids.extend(text().iter().flat_map(|&b| u16::from(b).to_le_bytes()));
    }
    let dir = std::env::temp_dir().join(format!("ivme-bench-corpus-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::io("creating the corpus folder", e))?;
    let file = dir.join("corpus.bin");
    std::fs::write(&file, &ids).map_err(|e| Error::io("writing the corpus", e))?;
    let modes = ["memory", "disk", "prefetch"];
    let mut times: [Vec<f64>; 3] = Default::default();
    for r in 0..rounds {
        for k in 0..3 {
            let i = (k + r) % 3;
            times[i].push(round(modes[i], &file)?);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let [memory, disk, prefetch] = times.map(|mut t| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    });
    println!(
        "llama step from a token file, ms per optimizer step, median of {rounds} rounds (one \
         process each): in memory {memory:.2}, from disk {disk:.2}, from disk with prefetch(2) \
         {prefetch:.2}"
    );
    println!(
        "disk / memory: {:.3}x; prefetch / memory: {:.3}x (target <= 1.03)",
        disk / memory,
        prefetch / memory
    );
    Ok(())
}
