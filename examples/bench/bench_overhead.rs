//! Overhead of ivme over a hand-written candle loop, measured in one run.
//!
//! `cargo run --release --example bench_overhead` (1 process) or
//! `ivme launch --num_processes 2 target/release/examples/bench_overhead` (2 ranks: the
//! Accelerator's steps then include the gradient all-reduce, which the plain loop lacks).
//! Rounds alternate the loops so machine noise hits both alike; the median round counts.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder, VarMap};
use ivme::data::{DataLoader, TensorDataset};
use ivme::rng::Rng;
use ivme::{Accelerator, Precision};
use std::time::Instant;

#[path = "../support/mlp.rs"]
mod mlp;
use mlp::Mlp;

struct Case {
    name: &'static str,
    dims: Vec<usize>,
    batch: usize,
    steps: usize,
}

fn data(dims: &[usize], n: usize) -> ivme::Result<(Tensor, Tensor)> {
    let mut rng = Rng::new(5);
    let x = rng.randn(0.0, 1.0, (n, dims[0]), &Device::Cpu)?;
    let y = rng.randn(0.0, 1.0, (n, *dims.last().unwrap_or(&1)), &Device::Cpu)?;
    Ok((x, y))
}

/// Seconds per step of the plain candle loop over batches pre-sliced on `device` (the
/// Accelerator's: a GPU build compares GPU with GPU).
fn plain(case: &Case, x: &Tensor, y: &Tensor, device: &Device) -> ivme::Result<f64> {
    let (x, y) = (x.to_device(device)?, y.to_device(device)?);
    let varmap = VarMap::new();
    let model = Mlp::new(
        VarBuilder::from_varmap(&varmap, DType::F32, device),
        &case.dims,
    )?;
    let mut opt = candle_nn::AdamW::new(varmap.all_vars(), ParamsAdamW::default())?;
    let batches: Vec<(Tensor, Tensor)> = (0..case.steps)
        .map(|i| {
            Ok((
                x.narrow(0, i * case.batch, case.batch)?,
                y.narrow(0, i * case.batch, case.batch)?,
            ))
        })
        .collect::<candle_core::Result<_>>()?;
    let t = Instant::now();
    for (xb, yb) in &batches {
        let loss = candle_nn::loss::mse(&model.forward(xb)?, yb)?;
        opt.backward_step(&loss)?;
    }
    Ok(t.elapsed().as_secs_f64() / case.steps as f64)
}

/// Seconds per step of the same loop through the Accelerator, its loader and optimizer.
fn accelerated(acc: &mut Accelerator, case: &Case, x: &Tensor, y: &Tensor) -> ivme::Result<f64> {
    let varmap = VarMap::new();
    let model = Mlp::new(
        VarBuilder::from_varmap(&varmap, acc.param_dtype(DType::F32), acc.device()),
        &case.dims,
    )?;
    let opt = ivme::optim::AdamW::new(varmap.all_vars(), ParamsAdamW::default())?;
    let world = acc.num_processes();
    let loader = DataLoader::new(TensorDataset::new((x.clone(), y.clone()))?, case.batch);
    let (_varmap, mut opt, mut loader) = acc.prepare((varmap, opt, loader))?;
    let t = Instant::now();
    let mut steps = 0;
    for batch in loader.iter().take(case.steps / world.max(1)) {
        let (xb, yb) = batch?;
        let out = acc.autocast(|ac| model.forward(&ac.input(&xb)?))?;
        let loss = candle_nn::loss::mse(&out, &yb)?;
        let grads = acc.backward(&loss)?;
        opt.step(&grads)?;
        steps += 1;
    }
    Ok(t.elapsed().as_secs_f64() / steps.max(1) as f64)
}

fn slices(case: &Case, x: &Tensor, y: &Tensor) -> candle_core::Result<Vec<(Tensor, Tensor)>> {
    (0..case.steps)
        .map(|i| {
            Ok((
                x.narrow(0, i * case.batch, case.batch)?,
                y.narrow(0, i * case.batch, case.batch)?,
            ))
        })
        .collect()
}

/// The plain candle loop under `#[accelerate]` (the Accelerator passed in).
#[ivme::accelerate]
fn by_macro(
    accelerator: &mut Accelerator,
    dims: &[usize],
    batches: Vec<(Tensor, Tensor)>,
) -> candle_core::Result<f64> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&varmap, DType::F32, &device), dims)?;
    let mut opt = ivme::optim::AdamW::new(varmap.all_vars(), ParamsAdamW::default())?;
    let t = Instant::now();
    let mut steps = 0;
    for (xb, yb) in batches {
        let loss = candle_nn::loss::mse(&model.forward(&xb)?, &yb)?;
        let grads = loss.backward()?;
        opt.step(&grads)?;
        steps += 1;
    }
    Ok(t.elapsed().as_secs_f64() / f64::from(steps.max(1)))
}

/// The same calls the macro writes, written by hand.
fn by_hand(
    acc: &mut Accelerator,
    dims: &[usize],
    batches: Vec<(Tensor, Tensor)>,
) -> ivme::Result<f64> {
    let varmap = VarMap::new();
    let model = Mlp::new(
        VarBuilder::from_varmap(&varmap, acc.param_dtype(DType::F32), acc.device()),
        dims,
    )?;
    let mut opt = acc.prepare_optimizer(
        &varmap,
        ivme::optim::AdamW::new(varmap.all_vars(), ParamsAdamW::default()),
    )?;
    let scope = acc.autocast_scope();
    let t = Instant::now();
    let mut steps = 0;
    for (xb, yb) in ivme::macro_support::shard(acc, batches)? {
        let out = scope.run(|ac| model.forward(&ac.input(&xb)?))?;
        let loss = candle_nn::loss::mse(&out, &yb)?;
        let grads = acc.backward(&loss)?;
        opt.step(&grads)?;
        steps += 1;
    }
    Ok(t.elapsed().as_secs_f64() / f64::from(steps.max(1)))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> ivme::Result<()> {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(7);
    let cases = [
        Case {
            name: "tiny 32-32-1, batch 16",
            dims: vec![32, 32, 1],
            batch: 16,
            steps: 1000,
        },
        Case {
            name: "wide 256-1024-1024-1, batch 64",
            dims: vec![256, 1024, 1024, 1],
            batch: 64,
            steps: 16,
        },
    ];
    let modes: [(&str, usize, Precision); 4] = [
        ("f32", 1, Precision::No),
        ("f32 grad_accum=2", 2, Precision::No),
        ("fp16", 1, Precision::Fp16),
        ("bf16", 1, Precision::Bf16),
    ];
    // One Accelerator per mode; MPI starts once, with the first.
    let mut accs: Vec<Accelerator> = Vec::new();
    for (_, accum, p) in modes {
        accs.push(
            Accelerator::builder()
                .grad_accum(accum)
                .precision(p)
                .build()?,
        );
        if accs.len() == 1 && accs[0].num_processes() > 1 {
            break;
        }
    }
    let world = accs[0].num_processes();
    let device = accs[0].device().clone();
    accs[0].print(format!(
        "ivme overhead, {world} process(es), RAYON_NUM_THREADS={}",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "unset".into())
    ));
    for case in &cases {
        let (x, y) = data(&case.dims, case.steps * case.batch)?;
        let mut base = Vec::new();
        let mut runs: Vec<Vec<f64>> = vec![Vec::new(); accs.len()];
        plain(case, &x, &y, &device)?; // warm-up
        for _ in 0..rounds {
            base.push(plain(case, &x, &y, &device)?);
            for (i, acc) in accs.iter_mut().enumerate() {
                runs[i].push(accelerated(acc, case, &x, &y)?);
            }
        }
        let (mut hand, mut mac) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            // Alternate which goes first so warm caches favour neither.
            if round % 2 == 0 {
                hand.push(by_hand(&mut accs[0], &case.dims, slices(case, &x, &y)?)?);
                mac.push(by_macro(&mut accs[0], &case.dims, slices(case, &x, &y)?)?);
            } else {
                mac.push(by_macro(&mut accs[0], &case.dims, slices(case, &x, &y)?)?);
                hand.push(by_hand(&mut accs[0], &case.dims, slices(case, &x, &y)?)?);
            }
        }
        let b = median(base);
        accs[0].print(format!(
            "{}: plain candle {:.1} µs/step",
            case.name,
            b * 1e6
        ));
        let (h, m) = (median(hand), median(mac));
        accs[0].print(format!(
            "  macro vs the same calls by hand: {:.1} vs {:.1} µs/step, ratio {:.3}",
            m * 1e6,
            h * 1e6,
            m / h
        ));
        for (i, r) in runs.into_iter().enumerate() {
            let m = median(r);
            accs[0].print(format!(
                "  ivme {:<18} {:>10.1} µs/step  ratio {:.3}",
                modes[i].0,
                m * 1e6,
                m / b
            ));
        }
    }
    Ok(())
}
