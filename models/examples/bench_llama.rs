//! Step time of the llama example's training step through ivme against the same step written by
//! hand in plain candle, in one run, on one process.
//!
//! ```text
//! cargo build --release -p ivme-models --examples
//! target/release/examples/bench_llama [rounds]
//! ```
//!
//! Both loops train the same candle-transformers Llama on the same byte batches: 2 micro-batches
//! per optimizer step, global-norm clipping at 1.0, AdamW. The plain loop sums the two gradient
//! stores, clips and steps candle-nn's AdamW itself; in bf16 its weights and AdamW state are bf16
//! (what plain candle offers), while ivme keeps f32 masters and moments. Rounds alternate the two
//! loops; the median round counts.

#[path = "support/bytes_llama.rs"]
mod bytes_llama;
#[path = "support/init.rs"]
mod init;

use bytes_llama::{batches, config, loss_of, text, Batch};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use candle_transformers::models::llama;
use ivme::optim::{AdamW, ParamsAdamW};
use ivme::{Accelerator, Precision};
use std::time::Instant;

const LR: f64 = 3e-3;

fn model(varmap: &VarMap, dtype: DType) -> candle_core::Result<(llama::Llama, llama::Cache)> {
    let cfg = config();
    let vb = VarBuilder::from_varmap(varmap, dtype, &Device::Cpu);
    let cache = llama::Cache::new(false, dtype, &cfg, &Device::Cpu)?;
    let model = llama::Llama::load(vb, &cfg)?;
    init::reinit(varmap, 17, 0.05)?;
    Ok((model, cache))
}

/// Milliseconds per optimizer step of plain candle: accumulate, clip, step, all by hand.
fn plain(dtype: DType, data: &[Batch]) -> candle_core::Result<f64> {
    let varmap = VarMap::new();
    let (model, mut cache) = model(&varmap, dtype)?;
    let vars = varmap.all_vars();
    let mut opt = candle_nn::AdamW::new(
        vars.clone(),
        candle_nn::ParamsAdamW {
            lr: LR,
            ..Default::default()
        },
    )?;
    let t = Instant::now();
    for pair in data.chunks_exact(2) {
        let mut sum: Option<candle_core::backprop::GradStore> = None;
        for (x, y) in pair {
            let loss = (loss_of(&model.forward(x, 0, &mut cache)?, y)? / 2.0)?;
            let grads = loss.backward()?;
            sum = Some(match sum {
                None => grads,
                Some(mut s) => {
                    for v in &vars {
                        if let (Some(a), Some(b)) = (s.get(v), grads.get(v)) {
                            let total = a.add(b)?;
                            s.insert(v, total);
                        }
                    }
                    s
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
        opt.step(&grads)?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e3 / (data.len() / 2) as f64)
}

/// Milliseconds per optimizer step of the same training through an Accelerator.
fn accelerated(acc: &mut Accelerator, data: &[Batch]) -> ivme::Result<f64> {
    let varmap = VarMap::new();
    let (model, mut cache) = model(&varmap, acc.param_dtype(DType::F32))?;
    let opt = AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: LR,
            ..Default::default()
        },
    )?;
    let (_varmap, mut opt) = acc.prepare((varmap, opt))?;
    let t = Instant::now();
    for (x, y) in &data[..data.len() / 2 * 2] {
        let loss = loss_of(&model.forward(x, 0, &mut cache)?, y)?;
        let grads = acc.backward(&loss)?;
        opt.step(&grads)?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e3 / (data.len() / 2) as f64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> ivme::Result<()> {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let (data, _) = batches(&text())?;
    println!(
        "llama step time, 1 process, {} micro-batches of {} windows per round",
        data.len() / 2 * 2,
        bytes_llama::BATCH
    );
    for precision in [Precision::No, Precision::Bf16] {
        let mut acc = Accelerator::builder()
            .grad_accum(2)
            .clip_grad_norm(1.0)
            .precision(precision)
            .build()?;
        let dtype = precision.compute_dtype();
        plain(dtype, &data)?; // warm-up
        let (mut p, mut a) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            if round % 2 == 0 {
                p.push(plain(dtype, &data)?);
                a.push(accelerated(&mut acc, &data)?);
            } else {
                a.push(accelerated(&mut acc, &data)?);
                p.push(plain(dtype, &data)?);
            }
        }
        let (p, a) = (median(p), median(a));
        println!(
            "  {:<4} plain candle {p:6.2} ms/step   ivme {a:6.2} ms/step   ratio {:.3}",
            precision.as_str(),
            a / p
        );
    }
    Ok(())
}
