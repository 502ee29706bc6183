//! What the gradient sync allocates per step, measured on real ranks.
//!
//! `ivme launch --num_processes 2 target/debug/examples/grad_sync_alloc [steps]`
//!
//! Each step runs the same forward twice on the same batch: once into the Accelerator's
//! `backward` (candle's backward, then the all-reduce across ranks) and once into candle's
//! plain `loss.backward()`. Both build the same graph, so what the first allocates beyond the
//! second is what the sync allocates. Every rank prints one line:
//! `rank R steps S sync_large L sync_allocs A sync_bytes B` (per step, averaged).

use candle_core::{DType, Device, Module};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use ivme::optim::{ParamsSgd, Sgd};
use ivme::rng::Rng;
use ivme::Accelerator;

#[path = "../support/count_alloc.rs"]
mod count_alloc;
use count_alloc::Counts;

#[global_allocator]
static ALLOCATOR: count_alloc::Counting = count_alloc::Counting;

#[path = "../support/mlp.rs"]
mod mlp;
use mlp::Mlp;

fn main() -> ivme::Result<()> {
    let steps: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(6);
    let mut acc = Accelerator::builder().seed(7).build()?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = Mlp::new(vb, &[64, 256, 256, 1])?;
    let params = ParamsSgd {
        lr: 0.01,
        ..Default::default()
    };
    let opt = Sgd::new(varmap.all_vars(), params)?;
    let (_varmap, mut opt) = acc.prepare((varmap, opt))?;
    let mut rng = Rng::new(11 + acc.process_index() as u64);
    let mut total = Counts::default();
    let mut plain = Counts::default();
    // The first steps lay out the sync's buffers and warm candle's caches.
    let warmup = 2;
    for step in 0..warmup + steps {
        let x = rng.randn(0.0, 1.0, (8, 64), &Device::Cpu)?;
        let y = rng.randn(0.0, 1.0, (8, 1), &Device::Cpu)?;
        let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
        let before = Counts::now();
        let grads = acc.backward(&loss)?;
        let synced = Counts::since(before);
        let again = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
        let before = Counts::now();
        drop(again.backward()?);
        let alone = Counts::since(before);
        if step >= warmup {
            total.add(synced);
            plain.add(alone);
        }
        opt.step(&grads)?;
    }
    let per = |a: u64, b: u64| (a as f64 - b as f64) / steps as f64;
    println!(
        "rank {} steps {steps} sync_large {} sync_allocs {} sync_bytes {}",
        acc.process_index(),
        per(total.large, plain.large),
        per(total.allocs, plain.allocs),
        per(total.bytes, plain.bytes),
    );
    Ok(())
}
