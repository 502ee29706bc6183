//! The optimizer step alone: candle-nn's `AdamW` against ivme's (fused: one pass in place per
//! variable, split across threads; and its op-by-op path, `IVME_FUSED_OPTIMIZER=0`), on the
//! same gradients, each in its own process.
//!
//! `cargo run --release --example bench_optimizer` runs the comparison: rounds alternate the
//! three, each round a fresh process per optimizer, and the medians and ratios are printed.
//! `bench_optimizer one candle|ivme [millions] [steps]` times one optimizer (used by the
//! comparison): milliseconds per step, median over the steps.

use candle_core::{Device, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};
use ivme::rng::Rng;
use std::time::Instant;

#[path = "../support/rounds.rs"]
mod rounds;

/// 20 variables adding up to `millions` million f32 parameters, and a gradient for each.
fn setup(millions: usize) -> ivme::Result<(Vec<Var>, candle_core::backprop::GradStore)> {
    let per = millions * 1_000_000 / 20;
    let mut rng = Rng::new(9);
    let mut vars = Vec::new();
    // The gradient of sum(var * g) with respect to var is g.
    let mut loss = Tensor::zeros((), candle_core::DType::F32, &Device::Cpu)?;
    for _ in 0..20 {
        let var = Var::from_tensor(&rng.randn(0.0, 0.02, per, &Device::Cpu)?)?;
        let g: Tensor = rng.randn(0.0, 1e-3, per, &Device::Cpu)?;
        loss = (loss + (var.as_tensor() * g)?.sum_all()?)?;
        vars.push(var);
    }
    let grads = loss.backward()?;
    Ok((vars, grads))
}

fn params() -> ParamsAdamW {
    ParamsAdamW {
        lr: 3e-4,
        weight_decay: 0.01,
        ..Default::default()
    }
}

/// Median milliseconds per step of `opt` over `steps` steps (after one warm-up step).
fn time<O: Optimizer>(
    mut opt: O,
    grads: &candle_core::backprop::GradStore,
    steps: usize,
) -> ivme::Result<f64> {
    opt.step(grads)?;
    let mut ms = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t = Instant::now();
        opt.step(grads)?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

fn one(which: &str, millions: usize, steps: usize) -> ivme::Result<()> {
    let (vars, grads) = setup(millions)?;
    let ms = match which {
        "candle" => time(candle_nn::AdamW::new(vars, params())?, &grads, steps)?,
        "ivme" => time(ivme::optim::AdamW::new(vars, params())?, &grads, steps)?,
        other => {
            return Err(ivme::Error::Usage(format!(
                "unknown optimizer `{other}`: use candle or ivme"
            )))
        }
    };
    println!("{ms:.3}");
    Ok(())
}

/// Runs `one` in a fresh process and reads its milliseconds.
fn child(which: &str, fused: bool, millions: usize, steps: usize) -> ivme::Result<f64> {
    let (millions, steps) = (millions.to_string(), steps.to_string());
    let fused = if fused { "1" } else { "0" };
    rounds::in_own_process(
        &["one", which, &millions, &steps],
        &[("IVME_FUSED_OPTIMIZER", fused)],
    )
}

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number =
        |i: usize, default: usize| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    if args.first().map(String::as_str) == Some("one") {
        let which = args.get(1).map_or("ivme", String::as_str);
        return one(which, number(2, 50), number(3, 10));
    }
    let (millions, rounds, steps) = (number(0, 50), number(1, 5), 10);
    let mut times: [Vec<f64>; 3] = Default::default();
    let runs = [("candle", true), ("ivme", true), ("ivme", false)];
    for round in 0..rounds {
        // Alternate the order so drift in the machine's speed hits every optimizer alike.
        for k in 0..3 {
            let i = (k + round) % 3;
            let (which, fused) = runs[i];
            times[i].push(child(which, fused, millions, steps)?);
        }
    }
    let median = |xs: &mut Vec<f64>| {
        xs.sort_by(f64::total_cmp);
        xs[xs.len() / 2]
    };
    let [candle, fused, ops] = times.map(|mut t| median(&mut t));
    println!(
        "AdamW step on {millions} M f32 parameters, {rounds} rounds (one process each), median \
         ms: candle-nn {candle:.1}, ivme fused {fused:.1}, ivme op by op {ops:.1}"
    );
    println!(
        "candle-nn / ivme fused: {:.2}x; ivme op by op / fused: {:.2}x",
        candle / fused,
        ops / fused
    );
    Ok(())
}
