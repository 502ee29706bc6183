//! Trains a small candle-transformers model a few steps, one of three ways, and writes its final
//! weights: the model matrix that `tests/model_matrix.rs` checks.
//!
//! ```text
//! model_matrix FAMILY plain OUT WORLD     # plain candle, one process, f32
//! ivme launch --num_processes N model_matrix FAMILY hand OUT    # ivme by hand
//! ivme launch --num_processes N model_matrix FAMILY macro OUT   # the plain loop under #[accelerate]
//! ```
//!
//! FAMILY is one of `llama`, `qwen2`, `xlmr`, `bert`, `vit`, `t5`, `llama2c`, `mistral`, `phi3`
//! (candle-transformers' models) or `ivme_llama`, `ivme_mistral`, `ivme_qwen2`, `ivme_phi3`,
//! `ivme_gemma2`, `ivme_bert` (ivme's trainable families) (examples/support/models.rs). The plain run prints `reached R of T`: how many
//! of the model's T variables the first backward pass gave a gradient. BatchNorm models are not here: their batch statistics couple
//! the samples of a micro-batch, so the one-big-batch reference does not apply; the conv net
//! with BatchNorm is checked in tests/buffers.rs against a reference that simulates the ranks.
//! The precision comes from the launcher (`--mixed_precision`, or `IVME_PRECISION`).
//!
//! Every epoch is one optimizer step over `GRAD_ACCUM × N` micro-batches: each of the N
//! processes sums the gradients of its `GRAD_ACCUM` micro-batches. The plain run does the same
//! maths on one process: one step per epoch over all `GRAD_ACCUM × WORLD` micro-batches at once
//! (for ivme's families one micro-batch at a time, their gradients summed, as an accumulating
//! loop does).
//! Each run prints one line per process, `losses RANK L0 L1 …` (the mean loss of the process's
//! micro-batches in each epoch), and writes its weights to `OUT/{way}-rank{RANK}.safetensors`.

#[path = "support/init.rs"]
mod init;
#[path = "support/models.rs"]
mod models;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use ivme::optim::{AdamW, ParamsAdamW};
use ivme::Accelerator;
use std::path::{Path, PathBuf};

const GRAD_ACCUM: usize = 2;
const EPOCHS: usize = 6;
const SEED: u64 = 11;
const LR: f64 = 1e-2;
const WEIGHT_DECAY: f64 = 0.01;

fn params() -> ParamsAdamW {
    ParamsAdamW {
        lr: LR,
        weight_decay: WEIGHT_DECAY,
        ..Default::default()
    }
}

fn report(
    out: &Path,
    way: &str,
    rank: usize,
    varmap: &VarMap,
    losses: &[f32],
) -> candle_core::Result<()> {
    varmap.save(out.join(format!("{way}-rank{rank}.safetensors")))?;
    let losses: Vec<String> = losses.iter().map(|l| format!("{l:e}")).collect();
    println!("losses {rank} {}", losses.join(" "));
    Ok(())
}

/// Plain candle: the whole step's micro-batches as one batch, candle-nn's AdamW.
fn plain(family: &str, world: usize, out: &Path) -> candle_core::Result<()> {
    let varmap = VarMap::new();
    let mut task = models::build(
        family,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )?;
    init::reinit(&varmap, SEED, 0.1)?;
    let p = params();
    let mut opt = candle_nn::AdamW::new(
        varmap.all_vars(),
        candle_nn::ParamsAdamW {
            lr: p.lr,
            beta1: p.beta1,
            beta2: p.beta2,
            eps: p.eps,
            weight_decay: p.weight_decay,
        },
    )?;
    let batches = models::batches(family, GRAD_ACCUM * world, SEED)?;
    let whole = !family.starts_with("ivme_");
    let (xs, ys): (Vec<Tensor>, Vec<Tensor>) = batches.iter().cloned().unzip();
    let (xs, ys) = (Tensor::cat(&xs, 0)?, Tensor::cat(&ys, 0)?);
    let mut losses = Vec::new();
    for epoch in 0..EPOCHS {
        let (loss, grads) = if whole {
            let loss = task.loss(&xs, &ys)?;
            let grads = loss.backward()?;
            (loss, grads)
        } else {
            // Every weight of ivme's families trains: the reference takes the micro-batches one
            // at a time, as the ranks do, so that each kernel sums the same rows.
            accumulated(task.as_mut(), &batches, &varmap, world)?
        };
        if epoch == 0 {
            // How much of the model the loss reaches: all of it for ivme's families, the
            // output head alone for candle-transformers' llama (fused ops without a backward).
            let vars = varmap.all_vars();
            let reached = vars.iter().filter(|v| grads.get(v).is_some()).count();
            println!("reached {reached} of {}", vars.len());
        }
        opt.step(&grads)?;
        losses.push(loss.to_scalar::<f32>()?);
    }
    report(out, "plain", 0, &varmap, &losses)
}

/// The mean loss of `batches` and their mean gradient as `world` processes form it: process
/// `r` sums the gradients of micro-batches `r`, `r + world`, … (each loss divided by the
/// window's size), the processes' sums are added in rank order and multiplied by `1 / world`.
/// Plain candle all the same, in the order a data-parallel loop adds (f32 addition is not
/// associative, and AdamW makes a whole step of a near-zero gradient's last bits).
fn accumulated(
    task: &mut dyn models::Task,
    batches: &[(Tensor, Tensor)],
    varmap: &VarMap,
    world: usize,
) -> candle_core::Result<(Tensor, GradStore)> {
    let vars = varmap.all_vars();
    let add = |acc: Option<GradStore>, grads: GradStore| -> candle_core::Result<GradStore> {
        let Some(mut acc) = acc else {
            return Ok(grads);
        };
        for v in &vars {
            if let (Some(a), Some(g)) = (acc.get(v), grads.get(v)) {
                let sum = (a + g)?;
                acc.insert(v, sum);
            }
        }
        Ok(acc)
    };
    let mut total: Option<GradStore> = None;
    let mut losses = Vec::new();
    for rank in 0..world {
        let mut window: Option<GradStore> = None;
        for (x, y) in batches.iter().skip(rank).step_by(world) {
            let loss = task.loss(x, y)?;
            window = Some(add(window, (&loss / GRAD_ACCUM as f64)?.backward()?)?);
            losses.push(loss);
        }
        if let Some(w) = window {
            total = Some(add(total, w)?);
        }
    }
    let mut grads = total.ok_or_else(|| candle_core::Error::Msg("no micro-batch".into()))?;
    let inv = Tensor::new(1.0 / world as f32, &Device::Cpu)?;
    for v in &vars {
        if let Some(g) = grads.get(v) {
            let mean = g.broadcast_mul(&inv)?;
            grads.insert(v, mean);
        }
    }
    Ok((Tensor::stack(&losses, 0)?.mean_all()?, grads))
}

/// ivme by hand: each process takes every N-th micro-batch.
fn by_hand(family: &str, out: &Path) -> ivme::Result<()> {
    let mut accelerator = Accelerator::builder().grad_accum(GRAD_ACCUM).build()?;
    let varmap = VarMap::new();
    let mut task = models::build(
        family,
        VarBuilder::from_varmap(
            &varmap,
            accelerator.param_dtype(DType::F32),
            accelerator.device(),
        ),
    )?;
    init::reinit(&varmap, SEED, 0.1)?;
    let opt = AdamW::new(varmap.all_vars(), params())?;
    let (varmap, mut opt) = accelerator.prepare((varmap, opt))?;
    let (rank, world) = (accelerator.process_index(), accelerator.num_processes());
    let batches = models::batches(family, GRAD_ACCUM * world, SEED)?;
    let mut losses = Vec::new();
    for _ in 0..EPOCHS {
        let mut total = 0f32;
        for (x, y) in batches.iter().skip(rank).step_by(world) {
            let x = x.to_device(accelerator.device())?;
            let y = y.to_device(accelerator.device())?;
            let loss = task.loss(&x, &y)?;
            let grads = accelerator.backward(&loss)?;
            opt.step(&grads)?;
            total += loss.to_scalar::<f32>()?;
        }
        losses.push(total / GRAD_ACCUM as f32);
    }
    report(out, "hand", rank, &varmap, &losses)?;
    Ok(())
}

/// The plain loop, unchanged but for the attribute and ivme's AdamW.
#[ivme::accelerate(grad_accum = 2)]
fn under_macro(family: &str, out: &Path) -> ivme::Result<()> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let mut task = models::build(
        family,
        VarBuilder::from_varmap(&varmap, DType::F32, &device),
    )?;
    init::reinit(&varmap, SEED, 0.1)?;
    let mut opt = AdamW::new(varmap.all_vars(), params())?;
    let batches = models::batches(family, GRAD_ACCUM * accelerator.num_processes(), SEED)?;
    let mut losses = Vec::new();
    for _ in 0..EPOCHS {
        let mut total = 0f32;
        for (x, y) in batches.iter() {
            let x = x.to_device(&device)?;
            let y = y.to_device(&device)?;
            let loss = task.loss(&x, &y)?;
            opt.backward_step(&loss)?;
            total += loss.to_scalar::<f32>()?;
        }
        losses.push(total / GRAD_ACCUM as f32);
    }
    report(out, "macro", accelerator.process_index(), &varmap, &losses)?;
    Ok(())
}

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: model_matrix FAMILY (plain OUT WORLD | hand OUT | macro OUT)";
    let (family, way, out) = match args.as_slice() {
        [f, w, o, ..] => (f.as_str(), w.as_str(), PathBuf::from(o)),
        _ => return Err(ivme::Error::Usage(usage.into())),
    };
    std::fs::create_dir_all(&out).map_err(candle_core::Error::wrap)?;
    match way {
        "plain" => {
            let world = args.get(3).and_then(|w| w.parse().ok()).unwrap_or(1);
            plain(family, world, &out)?;
        }
        "hand" => by_hand(family, &out)?,
        "macro" => under_macro(family, &out)?,
        _ => return Err(ivme::Error::Usage(usage.into())),
    }
    Ok(())
}
