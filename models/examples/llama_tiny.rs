//! A small Llama (ivme's trainable llama family), random init, trained on byte-level text under
//! `#[accelerate]`: bf16 with f32 masters, 2 micro-batches per step, global-norm clipping,
//! AdamW with warmup and cosine decay, an eval pass per epoch, a checkpoint every few steps,
//! and an automatic resume from the newest one.
//!
//! ```text
//! cargo build --release --workspace --bins --examples
//! target/release/ivme launch --num_processes 2 target/release/examples/llama_tiny
//! # stop it (or pass stop_after=5), start it again: it resumes where the checkpoint was taken
//! ```
//!
//! Arguments (all optional): `project=DIR` (checkpoints, default `llama_tiny_run`), `epochs=N`
//! (30), `stop_after=K` (return after the K-th optimizer step of this run, as a crash would),
//! `out=DIR` (each process writes its final weights to `DIR/rank{R}.safetensors`), `precision=`
//! `no|bf16|fp16` (bf16). Under `ivme launch --profile DIR` the run's phases per step go to DIR
//! with the losses of each epoch; `ivme profile DIR` draws them.
//!
//! Each sample is a 32-byte window; every position predicts the byte after it, and every weight
//! trains: ivme's `models::llama::Llama` computes its norms, rotary embeddings and attention with
//! `ivme::nn`'s differentiable ops (candle-transformers' `Llama` reaches its output head only).
//! The eval line gives the loss over every position and at the last one (the window's full
//! context), the figure the head-only model of earlier versions reached 0.738 on.

#[path = "support/bytes_llama.rs"]
mod bytes_llama;
#[path = "support/init.rs"]
mod init;

use bytes_llama::{batches, config, last_position_loss, loss_of, text, Batch};
use candle_core::{DType, Device};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use ivme::models::llama::Llama;
use ivme::optim::{AdamW, LrScheduler, ParamsAdamW, WarmupCosine};
use ivme::{Accelerator, Precision};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The training loop, plain candle but for the attribute: it shards `train` across processes,
/// accumulates, syncs, clips, steps the schedule once per optimizer step, and places tensors.
#[ivme::accelerate]
fn fit(
    acc: &mut Accelerator,
    train: Vec<Batch>,
    eval: &[Batch],
    epochs: usize,
    stop_after: Option<usize>,
) -> ivme::Result<VarMap> {
    let device = Device::Cpu;
    let cfg = config();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
    let model = Llama::new(&cfg, vb)?;
    // Seeded, so that every run starts from the same weights (rank 0's are broadcast).
    init::reinit(&varmap, 17, 0.05)?;
    let mut opt = AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: 1e-2,
            weight_decay: 0.01,
            ..Default::default()
        },
    )?;
    // Each process takes ⌈batches / processes⌉ batches an epoch (the last round padded), in
    // windows of `grad_accum`, the last one possibly short.
    let per_process = train.len().div_ceil(acc.num_processes());
    let steps_per_epoch = per_process.div_ceil(acc.gradient_accumulation_steps());
    let mut schedule = LrScheduler::new(
        &opt,
        WarmupCosine::new(4, (epochs * steps_per_epoch) as u64)?,
    );
    if let Some(dir) = acc.load_state_if_any()? {
        acc.print(format!("resumed from {}", dir.display()));
    }
    let mut steps = 0;
    let started = std::time::Instant::now();
    for epoch in 0..epochs {
        let mut total = 0f32;
        let mut seen = 0usize;
        for (x, y) in train.iter() {
            let x = x.to_device(&device)?;
            let y = y.to_device(&device)?;
            let loss = loss_of(&model.forward(&x)?, &y)?;
            let grads = loss.backward()?;
            opt.step(&grads)?;
            schedule.step();
            total += loss.to_scalar::<f32>()?;
            seen += 1;
            if acc.sync_gradients() {
                steps += 1;
                if steps % 4 == 0 || Some(steps) == stop_after {
                    acc.save_state(None)?;
                }
                if Some(steps) == stop_after {
                    acc.print(format!("stopping after {steps} steps, as asked"));
                    return Ok(varmap);
                }
            }
        }
        if seen == 0 {
            continue; // an epoch the checkpoint had already finished
        }
        // Every process evaluates every held-out batch: no backward, so nothing is sharded.
        let (mut eval_total, mut eval_last) = (0f32, 0f32);
        for (x, y) in eval {
            let logits = model.forward(&x.to_device(&device)?)?;
            eval_total += loss_of(&logits, y)?.to_scalar::<f32>()?;
            eval_last += last_position_loss(&logits, y)?.to_scalar::<f32>()?;
        }
        let n = eval.len().max(1) as f32;
        let (train_loss, eval_loss) = (total / seen as f32, eval_total / n);
        acc.print(format!(
            "epoch {epoch}: train loss {train_loss:.3} (this process), eval loss {eval_loss:.3}, \
             {:.3} at the last position, lr {:.2e}",
            eval_last / n,
            schedule.lr()
        ));
        // The curves `ivme profile` draws under a profile (`--profile DIR`).
        acc.log(
            [("loss", train_loss as f64), ("eval_loss", eval_loss as f64)],
            steps as u64,
        )?;
    }
    if steps > 0 {
        acc.print(format!(
            "{:.1} ms per optimizer step",
            started.elapsed().as_secs_f64() * 1e3 / steps as f64
        ));
    }
    Ok(varmap)
}

fn main() -> ivme::Result<()> {
    let args: BTreeMap<String, String> = std::env::args()
        .skip(1)
        .filter_map(|a| a.split_once('=').map(|(k, v)| (k.into(), v.into())))
        .collect();
    let get = |k: &str| args.get(k).cloned();
    let precision: Precision = get("precision").as_deref().unwrap_or("bf16").parse()?;
    let mut acc = Accelerator::builder()
        .grad_accum(2)
        .precision(precision)
        .clip_grad_norm(1.0)
        .seed(17)
        .project_dir(get("project").unwrap_or_else(|| "llama_tiny_run".into()))
        .total_limit(2)
        .build()?;
    let epochs = get("epochs").and_then(|v| v.parse().ok()).unwrap_or(30);
    let stop_after = get("stop_after").and_then(|v| v.parse().ok());
    let (train, eval) = batches(&text())?;
    let config = serde_json::json!({ "epochs": epochs, "precision": precision.to_string() });
    acc.init_trackers("llama_tiny", &config, Vec::new())?;
    acc.print(format!(
        "{} training batches of {} windows on {} process(es), {precision}",
        train.len(),
        bytes_llama::BATCH,
        acc.num_processes()
    ));
    let varmap = fit(&mut acc, train, &eval, epochs, stop_after)?;
    if let Some(out) = get("out") {
        let out = PathBuf::from(out);
        std::fs::create_dir_all(&out).map_err(|e| ivme::Error::io("creating out", e))?;
        acc.wait_for_checkpoint()?;
        varmap.save(out.join(format!("rank{}.safetensors", acc.process_index())))?;
    }
    // With a profile, this also prints its summary.
    acc.end_training()
}
