//! Does the loader keep up with the model? A data set whose batches take about 5 ms of CPU
//! work each to decode, feeding a model whose step takes about 20 ms, with and without
//! `DataLoader::prefetch`, against the same step on data that costs nothing; each in its own
//! process, rounds alternating.
//!
//! `cargo run --release --example bench_data [rounds]` prints the medians and the ratios;
//! `bench_data one free|decode|prefetch [steps]` times one (milliseconds per step). The model
//! step runs with `RAYON_NUM_THREADS=1`, so on a 2-core machine one core is left for decoding,
//! and with glibc's allocator set as `ivme launch` sets it.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder, VarMap};
use ivme::data::{DataLoader, Dataset};
use std::hint::black_box;
use std::time::{Duration, Instant};

#[path = "../support/mlp.rs"]
mod mlp;
#[path = "../support/rounds.rs"]
mod rounds;
use mlp::Mlp;

const BATCH: usize = 64;
const DIMS: [usize; 4] = [256, 1024, 1024, 1];

/// Samples whose batch costs `decode` of CPU work to build, as parsing or decompressing would.
struct Costly {
    n: usize,
    decode: Duration,
}

impl Dataset for Costly {
    type Item = usize;
    type Batch = (Tensor, Tensor);

    fn len(&self) -> usize {
        self.n
    }

    fn get(&self, index: usize) -> ivme::Result<usize> {
        Ok(index)
    }

    fn collate(&self, items: Vec<usize>, device: &Device) -> ivme::Result<(Tensor, Tensor)> {
        let start = Instant::now();
        let mut acc = 0u64;
        while start.elapsed() < self.decode {
            for i in 0..1000u64 {
                acc = black_box(acc.wrapping_mul(6364136223846793005).wrapping_add(i));
            }
        }
        black_box(acc);
        let seed = items.first().copied().unwrap_or(0) as f32;
        let x = Tensor::arange(0f32, (items.len() * DIMS[0]) as f32, device)?
            .reshape((items.len(), DIMS[0]))?
            .affine(1e-4, f64::from(seed) * 1e-3)?
            .sin()?;
        let y = x.sum_keepdim(1)?;
        Ok((x, y))
    }
}

fn one(mode: &str, steps: usize) -> ivme::Result<()> {
    let decode = if mode == "free" {
        Duration::ZERO
    } else {
        Duration::from_millis(5)
    };
    let data = Costly {
        n: BATCH * (steps + 2),
        decode,
    };
    let mut loader = DataLoader::new(data, BATCH);
    if mode == "prefetch" {
        loader = loader.prefetch(2);
    }
    let varmap = VarMap::new();
    let model = Mlp::new(
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        &DIMS,
    )?;
    let mut opt = candle_nn::AdamW::new(varmap.all_vars(), ParamsAdamW::default())?;
    let mut ms = Vec::new();
    let mut last = Instant::now();
    for (i, batch) in loader.iter().enumerate() {
        let (x, y) = batch?;
        let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
        opt.backward_step(&loss)?;
        // The first two steps warm up (and let the prefetch fill).
        if i >= 2 {
            ms.push(last.elapsed().as_secs_f64() * 1e3);
        }
        last = Instant::now();
    }
    ms.sort_by(f64::total_cmp);
    println!("{:.3}", ms[ms.len() / 2]);
    Ok(())
}

fn child(mode: &str, steps: usize) -> ivme::Result<f64> {
    let steps = steps.to_string();
    rounds::in_own_process(
        &["one", mode, &steps],
        &[
            ("RAYON_NUM_THREADS", "1"),
            // glibc as `ivme launch` sets it, so the step's time is the model's, not page faults.
            ("MALLOC_MMAP_THRESHOLD_", "33554432"),
            ("MALLOC_TRIM_THRESHOLD_", "2147483647"),
        ],
    )
}

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("one") {
        let mode = args.get(1).map_or("free", String::as_str);
        let steps = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(40);
        return one(mode, steps);
    }
    let rounds: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(5);
    let modes = ["free", "decode", "prefetch"];
    let mut times: [Vec<f64>; 3] = Default::default();
    for round in 0..rounds {
        for k in 0..3 {
            let i = (k + round) % 3;
            times[i].push(child(modes[i], 40)?);
        }
    }
    let [free, decode, prefetch] = times.map(|mut t| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    });
    println!(
        "ms per step, median of {rounds} rounds (one process each): free data {free:.2}, 5 ms \
         decode {decode:.2}, 5 ms decode with prefetch(2) {prefetch:.2}"
    );
    println!(
        "decode / free: {:.2}x; prefetch / free: {:.2}x",
        decode / free,
        prefetch / free
    );
    Ok(())
}
