//! A Llama's full training step (ivme's trainable `models::llama::Llama`: every weight gets a
//! gradient) through ivme against the same step written by hand in plain candle over the same
//! model, at four model sizes, each system in a process of its own, with its peak memory.
//!
//! ```text
//! cargo build --release -p ivme-models --examples
//! target/release/examples/bench_llama [rounds=3] [sizes=T,S,M,L] [f32|bf16]
//! ```
//!
//! The step: 2 micro-batches, global-norm clipping at 1.0, AdamW (lr 3e-4), the loss on every
//! position's logits against a random target each. The plain loop sums the two gradient stores, clips and steps
//! candle-nn's AdamW itself; ivme's is an `Accelerator` with `grad_accum(2)`,
//! `clip_grad_norm(1.0)` and its own AdamW. Every (system, size, allocator) measurement runs
//! in a process of its own (timing both in one process misleads: glibc's dynamic mmap threshold
//! favours whichever loop runs later), one warm-up step and then the timed steps; rounds
//! alternate which system goes first; medians. Two allocator settings: as each program starts
//! by itself (glibc's defaults; building an Accelerator tunes glibc with `mallopt`), and glibc
//! tuned for both by `ivme launch`'s variables. In bf16 the plain loop keeps bf16 weights and
//! AdamW state (what plain candle offers) and ivme f32 masters and moments.
//!
//! Sizes: T is the llama example's own model (0.2 M parameters, batch 16 × 32 bytes); S hidden
//! 256, 4 layers, vocab 4096, batch 8 × 64 (5 M); M hidden 512, 6 layers, vocab 8192, batch
//! 4 × 128 (31 M); L hidden 768, 12 layers, vocab 16384, batch 2 × 128 (103 M).
//!
//! `bench_llama one SYSTEM SIZE PRECISION` runs one measurement and prints ms per step and the
//! process's peak resident memory (VmHWM) in MiB.
//!
//! `bench_llama one matmuls SIZE f32` times the step's linear-layer matrix products alone
//! (forward and both backward products of every projection and the head, f32): the floor
//! candle's matmul sets under the step.
//!
//! `bench_llama profile [rounds=5] [sizes=T,S]` measures what a profile costs: ivme's step with
//! and without `IVME_PROFILE` (each in its own process, rounds alternating, f32, glibc tuned).

// A user's own choice of allocator (`--features mimalloc` / `jemalloc`): the Accelerator's
// `mallopt` tunes glibc only, so these run as they are.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
#[cfg(all(feature = "jemalloc", not(feature = "mimalloc")))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[path = "support/init.rs"]
mod init;
#[path = "support/llama_sizes.rs"]
mod llama_sizes;
#[path = "../../examples/support/peak_rss.rs"]
mod peak_rss;
#[path = "../../examples/support/rounds.rs"]
mod rounds;

use candle_core::{DType, Device, Tensor};
use candle_nn::{Optimizer, VarMap};
use ivme::{Accelerator, Precision};
use llama_sizes::{data, ivme_step, loss_of, median, model, precision_of, size, Size, LR};
use std::time::Instant;

/// Milliseconds per step of plain candle (accumulate, clip, step, all by hand), after one
/// warm-up step.
fn plain(s: &Size, dtype: DType) -> candle_core::Result<f64> {
    let varmap = VarMap::new();
    let model = model(s, &varmap, dtype)?;
    let data = data(s)?;
    let vars = varmap.all_vars();
    let mut opt = candle_nn::AdamW::new(
        vars.clone(),
        candle_nn::ParamsAdamW {
            lr: LR,
            ..Default::default()
        },
    )?;
    let mut step = || -> candle_core::Result<()> {
        let mut sum: Option<candle_core::backprop::GradStore> = None;
        for (x, y) in &data {
            let loss = (loss_of(&model, x, y)? / 2.0)?;
            let grads = loss.backward()?;
            sum = Some(match sum {
                None => grads,
                Some(mut acc) => {
                    for v in &vars {
                        if let (Some(a), Some(b)) = (acc.get(v), grads.get(v)) {
                            let total = a.add(b)?;
                            acc.insert(v, total);
                        }
                    }
                    acc
                }
            });
        }
        let mut grads = sum.expect("two micro-batches");
        let mut squares = Tensor::zeros((), DType::F32, &Device::Cpu)?;
        for v in &vars {
            if let Some(g) = grads.get(v) {
                squares = squares.add(&g.to_dtype(DType::F32)?.sqr()?.sum_all()?)?;
            }
        }
        let norm = squares.sqrt()?.to_scalar::<f32>()? as f64;
        if norm > 1.0 {
            for v in &vars {
                if let Some(g) = grads.remove(v) {
                    grads.insert(v, (g * (1.0 / (norm + 1e-6)))?);
                }
            }
        }
        opt.step(&grads)
    };
    step()?;
    let t = Instant::now();
    for _ in 0..s.steps {
        step()?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e3 / s.steps as f64)
}

/// Milliseconds per step of the same training through an Accelerator, after one warm-up step.
fn accelerated(s: &Size, precision: Precision) -> ivme::Result<f64> {
    let mut acc = Accelerator::builder()
        .grad_accum(2)
        .clip_grad_norm(1.0)
        .precision(precision)
        .build()?;
    let mut step = ivme_step(s, &mut acc)?;
    step(&mut acc)?;
    let t = Instant::now();
    for _ in 0..s.steps {
        step(&mut acc)?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e3 / s.steps as f64)
}

/// Milliseconds per step of the step's linear-layer matrix products alone, in candle: for each
/// micro-batch and block the seven projections' forward `x·Wᵀ` and backward `dY·W`, `dYᵀ·x`,
/// and the same for the output head (attention's own products, a few percent at these
/// lengths, left out). What candle's matmul costs the step whatever the rest costs.
fn matmuls(s: &Size) -> candle_core::Result<f64> {
    let rows = s.batch * s.tokens;
    let dev = Device::Cpu;
    let kv = s.hidden / s.heads * s.kv_heads;
    let mut shapes = Vec::new();
    for _ in 0..s.layers {
        for (i, o) in [
            (s.hidden, s.hidden),
            (s.hidden, kv),
            (s.hidden, kv),
            (s.hidden, s.hidden),
            (s.hidden, s.mlp),
            (s.hidden, s.mlp),
            (s.mlp, s.hidden),
        ] {
            shapes.push((i, o));
        }
    }
    shapes.push((s.hidden, s.vocab));
    let tensors = shapes
        .iter()
        .map(|&(i, o)| {
            Ok((
                Tensor::randn(0f32, 1., (rows, i), &dev)?,
                Tensor::randn(0f32, 0.02, (o, i), &dev)?,
                Tensor::randn(0f32, 1., (rows, o), &dev)?,
            ))
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let step = || -> candle_core::Result<()> {
        for _ in 0..2 {
            for (x, w, dy) in &tensors {
                let _y = x.matmul(&w.t()?)?;
                let _dx = dy.matmul(w)?;
                let _dw = dy.t()?.matmul(x)?;
            }
        }
        Ok(())
    };
    step()?;
    let t = Instant::now();
    for _ in 0..s.steps {
        step()?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e3 / s.steps as f64)
}

/// ivme's step with a profile recorded against the same step without, rounds alternating.
fn profile_cost(args: &[String]) -> ivme::Result<()> {
    let rounds: usize = args
        .first()
        .and_then(|a| a.parse().ok())
        .unwrap_or(5)
        .max(1);
    let sizes: Vec<&Size> = args
        .get(1)
        .map_or("T,S", String::as_str)
        .split(',')
        .map(size)
        .collect::<ivme::Result<_>>()?;
    let dir = std::env::temp_dir().join(format!("ivme-bench-profile-{}", std::process::id()));
    let dir_text = dir.display().to_string();
    let tuned = [
        ("MALLOC_MMAP_THRESHOLD_", "33554432"),
        ("MALLOC_TRIM_THRESHOLD_", "17179869184"),
    ];
    let profiled = [tuned[0], tuned[1], ("IVME_PROFILE", dir_text.as_str())];
    println!("what a profile costs: ivme's llama step, f32, 1 process, {rounds} rounds (medians)");
    println!("| size | ivme ms/step | ivme with a profile ms/step | ratio |");
    println!("|---|---|---|---|");
    for s in sizes {
        let (mut off, mut on) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for profile in order {
                let envs: &[(&str, &str)] = if profile { &profiled } else { &tuned };
                let (ms, _) =
                    rounds::in_own_process_with_peak(&["one", "ivme", s.name, "f32"], envs)?;
                if profile {
                    on.push(ms)
                } else {
                    off.push(ms)
                }
            }
        }
        let (off, on) = (median(off), median(on));
        println!("| {} | {off:.2} | {on:.2} | {:.3} |", s.name, on / off);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("one") {
        let s = size(&args[2])?;
        let precision = precision_of(&args[3])?;
        let ms = match args[1].as_str() {
            "plain" => plain(s, precision.compute_dtype())?,
            "matmuls" => matmuls(s)?,
            _ => accelerated(s, precision)?,
        };
        println!("{ms} {}", peak_rss::peak_rss_mb());
        return Ok(());
    }
    if args.first().map(String::as_str) == Some("profile") {
        return profile_cost(&args[1..]);
    }
    let rounds: usize = args
        .first()
        .and_then(|a| a.parse().ok())
        .unwrap_or(3)
        .max(1);
    let sizes: Vec<&Size> = args
        .get(1)
        .map_or("T,S,M,L", String::as_str)
        .split(',')
        .map(size)
        .collect::<ivme::Result<_>>()?;
    let word = args.get(2).map_or("f32", String::as_str);
    precision_of(word)?;
    let tuned = [
        ("MALLOC_MMAP_THRESHOLD_", "33554432"),
        ("MALLOC_TRIM_THRESHOLD_", "17179869184"),
    ];
    println!(
        "llama training step, {word}, 1 process, {rounds} rounds (medians), each system in its \
         own process; RAYON_NUM_THREADS={}",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "unset".into())
    );
    println!(
        "| size | parameters | allocator | plain candle ms/step | ivme ms/step | ivme / candle \
         | plain candle peak MiB | ivme peak MiB |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for s in sizes {
        let params = {
            let varmap = VarMap::new();
            model(s, &varmap, DType::F32)?;
            varmap
                .all_vars()
                .iter()
                .map(|v| v.elem_count())
                .sum::<usize>()
        };
        for (label, envs) in [("glibc defaults", &[][..]), ("tuned", &tuned[..])] {
            let (mut p, mut a) = (Vec::new(), Vec::new());
            let (mut p_peak, mut a_peak) = (0f64, 0f64);
            for round in 0..rounds {
                let systems = if round % 2 == 0 {
                    ["plain", "ivme"]
                } else {
                    ["ivme", "plain"]
                };
                for system in systems {
                    let (ms, peak) =
                        rounds::in_own_process_with_peak(&["one", system, s.name, word], envs)?;
                    if system == "plain" {
                        p.push(ms);
                        p_peak = p_peak.max(peak);
                    } else {
                        a.push(ms);
                        a_peak = a_peak.max(peak);
                    }
                }
            }
            let (p, a) = (median(p), median(a));
            println!(
                "| {} | {:.1} M | {label} | {p:.1} | {a:.1} | {:.3} | {p_peak:.0} | {a_peak:.0} |",
                s.name,
                params as f64 / 1e6,
                a / p
            );
        }
    }
    Ok(())
}
