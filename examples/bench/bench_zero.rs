//! What ZeRO sharding saves and costs: the bytes of training state each process holds, and the
//! step time of each stage against plain data parallelism, for a 50 M-parameter model.
//!
//! ```text
//! cargo build --release --workspace --bins --examples
//! target/release/ivme launch --num_processes 3 target/release/examples/bench_zero optimizer [steps] [DIR]
//! ```
//!
//! With `DIR`, each run then saves its training state to `DIR/{stage}-{N}` and reports the
//! seconds the save took and the bytes each rank wrote.
//!
//! Each run prints, for every rank, the bytes of training state it holds (from
//! `Accelerator::held_bytes`), its peak RSS and the median step time. A process holds one
//! Accelerator (MPI starts once), so stages are compared across runs: alternate them
//! (`for s in no optimizer gradients no optimizer gradients; do …; done`) and take medians.
//!
//! The model is a ReLU MLP 2048 → 4096 → 4096 → 4096 → 2048 (50.3 M parameters) trained with
//! AdamW on batches of 8, in the precision the launcher sets (`--mixed_precision bf16`).

#[path = "../support/mlp.rs"]
mod mlp;
#[path = "../support/peak_rss.rs"]
mod peak_rss;

use candle_core::{DType, Device, Module};
use candle_nn::{Optimizer, VarMap};
use ivme::optim::{AdamW, ParamsAdamW};
use ivme::rng::Rng;
use ivme::{Accelerator, Sharding};
use mlp::Mlp;
use peak_rss::peak_rss_mb;
use std::time::Instant;

const DIMS: [usize; 5] = [2048, 4096, 4096, 4096, 2048];
const BATCH: usize = 8;

/// Trains `steps` optimizer steps under `sharding`; returns the seconds of each step after the
/// first, and the accelerator (for what it holds).
fn train(sharding: Sharding, steps: usize) -> ivme::Result<(Vec<f64>, Accelerator)> {
    let mut acc = Accelerator::builder().sharding(sharding).seed(1).build()?;
    let varmap = VarMap::new();
    let model = Mlp::new(acc.var_builder(&varmap, DType::F32), &DIMS)?;
    let opt = AdamW::new(varmap.all_vars(), ParamsAdamW::default())?;
    let (_varmap, mut opt) = acc.prepare((varmap, opt))?;
    let mut rng = Rng::new(7 + acc.process_index() as u64);
    let dtype = acc.param_dtype(DType::F32);
    let x = rng
        .randn(0.0, 1.0, (BATCH, DIMS[0]), &Device::Cpu)?
        .to_dtype(dtype)?;
    let y = rng.randn(0.0, 1.0, (BATCH, DIMS[4]), &Device::Cpu)?;
    let mut times = Vec::new();
    for step in 0..steps {
        acc.wait_for_everyone()?;
        let t = Instant::now();
        let out = model.forward(&x)?.to_dtype(DType::F32)?;
        let loss = candle_nn::loss::mse(&out, &y)?;
        let grads = acc.backward(&loss)?;
        opt.step(&grads)?;
        if step > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok((times, acc))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn mb(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let stage: Sharding = args.first().map_or("no", String::as_str).parse()?;
    let steps: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(4);
    let (times, mut acc) = train(stage, steps.max(2))?;
    let h = acc.held_bytes()?;
    let saved = match args.get(2) {
        Some(dir) => {
            let dir = std::path::Path::new(dir).join(format!("{stage}-{}", acc.num_processes()));
            acc.wait_for_everyone()?;
            let t = Instant::now();
            acc.save_state(Some(&dir))?;
            let secs = t.elapsed().as_secs_f64();
            let mine = dir.join(format!("rank{}", acc.process_index()));
            let bytes: u64 = std::fs::read_dir(&mine)
                .map_err(|e| ivme::Error::io(format!("listing {}", mine.display()), e))?
                .filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum();
            format!(", save {secs:.2} s, wrote {:.1} MB", mb(bytes as usize))
        }
        None => String::new(),
    };
    let params: usize = DIMS.windows(2).map(|w| w[0] * w[1] + w[1]).sum();
    // One line per rank, in rank order.
    for r in 0..acc.num_processes() {
        if r == acc.process_index() {
            println!(
                "{params} params, {} ranks, {stage:<9} {}: rank {r}: weights {:.1} MB, \
                 gradients {:.1} MB, masters {:.1} MB, optimizer {:.1} MB (total {:.1} MB), \
                 peak RSS {:.0} MB, step {:.0} ms{saved}",
                acc.num_processes(),
                acc.precision(),
                mb(h.weights),
                mb(h.gradients),
                mb(h.masters),
                mb(h.optimizer),
                mb(h.total()),
                peak_rss_mb(),
                median(times.clone()) * 1e3
            );
        }
        acc.wait_for_everyone()?;
    }
    Ok(())
}
