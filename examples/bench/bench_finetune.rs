//! What a LoRA fine-tune costs in each layout: the step time, peak memory, memory ivme holds and
//! bytes synced per step, for a 6.3 M-parameter residual MLP with rank-4 adapters on every
//! block linear and a new head (0.06 M trained parameters).
//!
//! ```text
//! cargo build --release --workspace --bins --examples
//! target/release/ivme launch --num_processes 2 target/release/examples/bench_finetune constant [steps]
//! ```
//!
//! The layouts, one per run (a process holds one Accelerator, so compare runs, alternating:
//! `for l in constant allvar full constant allvar full; do …; done`, and take medians):
//!
//! - `constant`: the base read as constants (`load_base` + `base_var_builder`); only the
//!   adapters and the head are variables, so candle computes no weight gradient for the base;
//! - `allvar`: every weight a variable of one `VarMap` (the base loaded into it), the optimizer
//!   over the adapters and the head: the base is frozen, but candle still computes its
//!   gradients (ivme drops them at once);
//! - `full`: the same model with every weight trained (full fine-tuning).
//!
//! Each run prints one line per rank: trained parameters, median micro-step time, peak RSS, the
//! bytes ivme holds (`held_bytes`) and the bytes handed to collectives per optimizer step.

#[path = "../support/finetune_net.rs"]
mod finetune_net;
#[path = "../support/peak_rss.rs"]
mod peak_rss;

use candle_core::{DType, Device, Module, Var};
use candle_nn::{Optimizer, VarMap};
use finetune_net::{write_base, Dims, Net};
use ivme::finetune::LoraConfig;
use ivme::optim::{AdamW, ParamsAdamW};
use ivme::rng::Rng;
use ivme::Accelerator;
use peak_rss::peak_rss_mb;
use std::path::PathBuf;
use std::time::Instant;

const DIMS: Dims = Dims {
    d: 512,
    h: 2048,
    blocks: 3,
};
const BATCH: usize = 32;
const ACCUM: usize = 2;

/// The base folder, written once: each process writes the same bytes to a folder of its own
/// and renames it into place, so concurrent first runs agree.
fn base_folder() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "ivme-bench-finetune-{}-{}-{}",
        DIMS.d, DIMS.h, DIMS.blocks
    ));
    if !dir.join("model.safetensors").is_file() {
        let own = dir.with_extension(format!("{}", std::process::id()));
        write_base(&own, DIMS);
        if std::fs::rename(&own, &dir).is_err() {
            // Another process got there first with the same bytes.
            let _ = std::fs::remove_dir_all(&own);
        }
    }
    dir
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
    let layout = args.first().map_or("constant", String::as_str).to_string();
    let steps: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(10);
    let base_dir = base_folder();
    let mut acc = Accelerator::builder()
        .grad_accum(ACCUM)
        .clip_grad_norm(1.0)
        .seed(1)
        .build()?;
    let lora = acc.lora(LoraConfig::new(4, 8.0, &["fc1", "fc2"]))?;
    let varmap = VarMap::new();
    let model = match layout.as_str() {
        "constant" => {
            let base = acc.load_base(&base_dir)?;
            Net::new(
                acc.base_var_builder(&base, &varmap, DType::F32),
                &lora,
                DIMS,
            )?
        }
        "allvar" | "full" => {
            let net = Net::new(acc.var_builder(&varmap, DType::F32), &lora, DIMS)?;
            finetune_net::load_into(&varmap, &base_dir)?;
            net
        }
        other => {
            return Err(ivme::Error::Usage(format!(
                "the layout is constant, allvar or full, not `{other}`"
            )))
        }
    };
    let trained: Vec<Var> = {
        let data = varmap.data().lock().expect("varmap");
        data.iter()
            .filter(|(n, _)| layout == "full" || n.contains(".lora_") || n.starts_with("head."))
            .map(|(_, v)| v.clone())
            .collect()
    };
    let count: usize = trained.iter().map(|v| v.elem_count()).sum();
    let mut opt = acc.prepare_optimizer_of(AdamW::new(trained, ParamsAdamW::default()))?;
    let mut rng = Rng::new(7 + acc.process_index() as u64);
    let dtype = acc.param_dtype(DType::F32);
    let x = rng
        .randn(0.0, 1.0, (BATCH, DIMS.d), &Device::Cpu)?
        .to_device(acc.device())?
        .to_dtype(dtype)?;
    let y = rng
        .randn(0.0, 1.0, (BATCH, 1), &Device::Cpu)?
        .to_device(acc.device())?;
    let mut times = Vec::new();
    let mut step_bytes = 0;
    for micro in 0..(steps + 1) * ACCUM {
        acc.wait_for_everyone()?;
        let before = acc.collective_bytes();
        let t = Instant::now();
        let out = model.forward(&x)?.to_dtype(DType::F32)?;
        let loss = candle_nn::loss::mse(&out, &y)?;
        let grads = acc.backward(&loss)?;
        opt.step(&grads)?;
        if micro >= ACCUM {
            times.push(t.elapsed().as_secs_f64());
        }
        if grads.is_sync_step() {
            step_bytes = acc.collective_bytes() - before;
        }
    }
    let h = acc.held_bytes()?;
    for r in 0..acc.num_processes() {
        if r == acc.process_index() {
            println!(
                "{layout:<8} {} ranks {}: rank {r}: trains {:.3} M parameters, micro-step \
                 {:.1} ms, peak RSS {:.0} MB, held {:.1} MB (weights {:.1}, gradients {:.1}, \
                 optimizer {:.1}), synced {:.3} MB a step",
                acc.num_processes(),
                acc.precision(),
                count as f64 / 1e6,
                median(times.clone()) * 1e3,
                peak_rss_mb(),
                mb(h.total()),
                mb(h.weights),
                mb(h.gradients),
                mb(h.optimizer),
                mb(step_bytes as usize),
            );
        }
        acc.wait_for_everyone()?;
    }
    Ok(())
}
