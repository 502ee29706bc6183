//! Overhead of ivme over a hand-written candle loop, measured in one run, each system in a
//! process of its own.
//!
//! `cargo run --release --example bench_overhead [rounds=7] [systems]`, one process: the plain
//! candle loop; ivme's `Accelerator` with its loader and AdamW in f32, f32 with `grad_accum=2`,
//! fp16 and bf16; and the plain loop under `#[accelerate]` against the calls it writes, by
//! hand. Every (system, model, allocator) measurement is a process of its own (in one process
//! glibc's dynamic mmap threshold favours whichever loop runs later), its first tenth of the
//! steps a warm-up; rounds alternate the order; medians. Two allocator settings: as each
//! program starts (glibc's defaults; building an Accelerator tunes glibc itself, the plain loop
//! has no such help) and glibc tuned for every system as `ivme launch` does. `systems` is a
//! comma list of `plain,f32,accum2,fp16,bf16,hand,macro` (default: all). For 2 processes see
//! `bench_ddp` and `bench_llama_ddp`.
//!
//! `bench_overhead one SYSTEM MODEL` is one measurement: it prints seconds per step.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder, VarMap};
use ivme::data::{DataLoader, TensorDataset};
use ivme::rng::Rng;
use ivme::{Accelerator, Precision};
use std::time::Instant;

#[path = "../support/mlp.rs"]
mod mlp;
use mlp::Mlp;
#[path = "../support/rounds.rs"]
mod rounds;

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
    let warm = warm_up(batches.len());
    let mut t = Instant::now();
    for (i, (xb, yb)) in batches.iter().enumerate() {
        if i == warm {
            t = Instant::now();
        }
        let loss = candle_nn::loss::mse(&model.forward(xb)?, yb)?;
        opt.backward_step(&loss)?;
    }
    Ok(t.elapsed().as_secs_f64() / (batches.len() - warm) as f64)
}

/// The steps not timed at the start of a measurement: a tenth, at least one.
fn warm_up(steps: usize) -> usize {
    (steps / 10).clamp(1, steps.saturating_sub(1))
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
    let total = case.steps / world.max(1);
    let warm = warm_up(total);
    let mut t = Instant::now();
    let mut steps = 0;
    for (i, batch) in loader.iter().take(total).enumerate() {
        if i == warm {
            (t, steps) = (Instant::now(), 0);
        }
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
    let warm = warm_up(batches.len());
    let mut t = Instant::now();
    let mut steps = 0;
    for (i, (xb, yb)) in batches.into_iter().enumerate() {
        if i == warm {
            (t, steps) = (Instant::now(), 0);
        }
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
    let warm = warm_up(batches.len());
    let mut t = Instant::now();
    let mut steps = 0;
    for (i, (xb, yb)) in ivme::macro_support::shard(acc, batches)?.enumerate() {
        if i == warm {
            (t, steps) = (Instant::now(), 0);
        }
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

/// The systems, by name: (name, what the table calls it).
const SYSTEMS: [(&str, &str); 7] = [
    ("plain", "plain candle"),
    ("f32", "ivme f32"),
    ("accum2", "ivme f32 grad_accum=2"),
    ("fp16", "ivme fp16"),
    ("bf16", "ivme bf16"),
    ("hand", "the macro's calls by hand"),
    ("macro", "#[accelerate]"),
];

fn cases() -> [Case; 2] {
    [
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
    ]
}

/// One measurement of `system` on case `which`, in this process: seconds per step.
fn one(system: &str, which: usize) -> ivme::Result<f64> {
    let case = &cases()[which];
    let (x, y) = data(&case.dims, case.steps * case.batch)?;
    if system == "plain" {
        // The Accelerator's device (a GPU build compares GPU with GPU), without building one:
        // that would tune glibc for the plain loop too.
        return plain(case, &x, &y, &Device::cuda_if_available(0)?);
    }
    let (accum, precision) = match system {
        "accum2" => (2, Precision::No),
        "fp16" => (1, Precision::Fp16),
        "bf16" => (1, Precision::Bf16),
        _ => (1, Precision::No),
    };
    let mut acc = Accelerator::builder()
        .grad_accum(accum)
        .precision(precision)
        .build()?;
    match system {
        "hand" => by_hand(&mut acc, &case.dims, slices(case, &x, &y)?),
        "macro" => Ok(by_macro(&mut acc, &case.dims, slices(case, &x, &y)?)?),
        _ => accelerated(&mut acc, case, &x, &y),
    }
}

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("one") {
        let which: usize = args[2].parse().unwrap_or(0);
        println!("{}", one(&args[1], which)?);
        return Ok(());
    }
    let rounds: usize = args
        .first()
        .and_then(|a| a.parse().ok())
        .unwrap_or(7)
        .max(1);
    let wanted: Vec<&str> = args
        .get(1)
        .map_or("plain,f32,accum2,fp16,bf16,hand,macro", String::as_str)
        .split(',')
        .collect();
    let systems: Vec<(&str, &str)> = SYSTEMS
        .iter()
        .copied()
        .filter(|(s, _)| wanted.contains(s))
        .collect();
    if !systems.iter().any(|(s, _)| *s == "plain") {
        return Err(ivme::Error::Usage(
            "bench_overhead: the systems must include plain, the baseline".into(),
        ));
    }
    let tuned = [
        ("MALLOC_MMAP_THRESHOLD_", "33554432"),
        ("MALLOC_TRIM_THRESHOLD_", "17179869184"),
    ];
    println!(
        "ivme overhead, 1 process, RAYON_NUM_THREADS={}, {rounds} rounds (medians), each system \
         in its own process",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "unset".into())
    );
    for (which, case) in cases().iter().enumerate() {
        for (label, envs) in [("glibc defaults", &[][..]), ("tuned", &tuned[..])] {
            println!("{} ({label}):", case.name);
            let mut times: Vec<Vec<f64>> = vec![Vec::new(); systems.len()];
            for round in 0..rounds {
                let mut order: Vec<usize> = (0..systems.len()).collect();
                if round % 2 == 1 {
                    order.reverse();
                }
                for i in order {
                    let which = which.to_string();
                    let secs = rounds::in_own_process(&["one", systems[i].0, &which], envs)?;
                    times[i].push(secs);
                }
            }
            let medians: Vec<f64> = times.into_iter().map(median).collect();
            let at = |name: &str| systems.iter().position(|(s, _)| *s == name);
            let base = at("plain").map_or(1.0, |i| medians[i]);
            for (i, (name, label)) in systems.iter().enumerate() {
                let against = match *name {
                    "macro" => at("hand").map_or(base, |h| medians[h]),
                    _ => base,
                };
                let what = if *name == "macro" && at("hand").is_some() {
                    "by hand"
                } else {
                    "plain"
                };
                println!(
                    "  {label:<28} {:>10.1} µs/step  ratio {:.3} (against {what})",
                    medians[i] * 1e6,
                    medians[i] / against
                );
            }
        }
    }
    Ok(())
}
