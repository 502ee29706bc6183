//! The README's main example: the SPEC's "loop before", unchanged but for the attribute.
//!
//! ```text
//! cargo build --release --workspace --bins --examples
//! target/release/ivme launch --num_processes 2 target/release/examples/tutorial_macro
//! ```
//!
//! `#[accelerate]` makes the loop data-parallel (each process takes its share of `batches`),
//! sums gradients over 2 micro-batches per optimizer step, computes in fp16 with loss scaling,
//! and places everything on this process's device. `cargo expand --example tutorial_macro`
//! shows the calls it writes (also in macros/macro.md).

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap};
use ivme::optim::{AdamW, LrScheduler, ParamsAdamW, WarmupCosine};
use ivme::rng::Rng;

struct Mlp {
    hidden: Linear,
    out: Linear,
}

impl Mlp {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Mlp {
            hidden: linear(8, 64, vb.pp("hidden"))?,
            out: linear(64, 1, vb.pp("out"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.out.forward(&self.hidden.forward(xs)?.relu()?)
    }
}

fn loss_fn(outputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::loss::mse(outputs, targets)
}

#[ivme::accelerate(grad_accum = 2, precision = "fp16")]
fn train(batches: Vec<(Tensor, Tensor)>, epochs: usize) -> candle_core::Result<()> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
    let mut opt = AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: 3e-3,
            ..Default::default()
        },
    )?;
    let mut scheduler = LrScheduler::new(&opt, WarmupCosine::new(5, 200)?);
    for epoch in 0..epochs {
        let mut total = 0f32;
        let mut count = 0f32;
        for (inputs, targets) in &batches {
            let inputs = inputs.to_device(&device)?;
            let targets = targets.to_device(&device)?;
            let outputs = model.forward(&inputs)?;
            let loss = loss_fn(&outputs, &targets)?;
            let grads = loss.backward()?;
            opt.step(&grads)?;
            scheduler.step();
            total += loss.to_scalar::<f32>()?;
            count += 1.0;
        }
        accelerator.print(format!(
            "epoch {epoch}: loss {:.4} (rank 0's batches), lr {:.2e}",
            total / count,
            scheduler.lr()
        ));
    }
    Ok(())
}

/// 32 batches of 16 samples of y = x·w + noise, identical on every process (one seed).
fn batches() -> ivme::Result<Vec<(Tensor, Tensor)>> {
    let mut rng = Rng::new(42);
    let w = rng.randn(0.0, 1.0, (8, 1), &Device::Cpu)?;
    (0..32)
        .map(|_| {
            let x = rng.randn(0.0, 1.0, (16, 8), &Device::Cpu)?;
            let y = (x.matmul(&w)? + rng.randn(0.0, 0.1, (16, 1), &Device::Cpu)?)?;
            Ok((x, y))
        })
        .collect()
}

fn main() -> candle_core::Result<()> {
    let epochs = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(8);
    train(batches()?, epochs)
}
