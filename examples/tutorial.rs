//! The SPEC's "loop before", written against ivme's runtime API by hand.
//!
//! A small MLP learns a noisy linear map from synthetic data. Run it on one process with
//! `cargo run --example tutorial`, or data-parallel with
//! `ivme launch --num_processes 2 target/debug/examples/tutorial`.

use candle_core::{DType, Module, Tensor};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap};
use ivme::data::{DataLoader, TensorDataset};
use ivme::optim::{AdamW, ParamsAdamW};
use ivme::rng::Rng;
use ivme::Accelerator;

struct Mlp {
    hidden: Linear,
    out: Linear,
}

impl Mlp {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Mlp {
            hidden: linear(8, 32, vb.pp("hidden"))?,
            out: linear(32, 1, vb.pp("out"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.out.forward(&self.hidden.forward(xs)?.relu()?)
    }
}

/// y = x·w + 0.1·noise, the same on every rank because it comes from one seed.
fn synthetic(n: usize) -> ivme::Result<TensorDataset<(Tensor, Tensor)>> {
    let dev = candle_core::Device::Cpu;
    let mut rng = Rng::new(42);
    let x = rng.randn(0.0, 1.0, (n, 8), &dev)?;
    let w = rng.randn(0.0, 1.0, (8, 1), &dev)?;
    let noise = rng.randn(0.0, 0.1, (n, 1), &dev)?;
    let y = (x.matmul(&w)? + noise)?;
    TensorDataset::new((x, y))
}

fn main() -> ivme::Result<()> {
    let epochs: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let mut accelerator = Accelerator::new()?;
    let device = accelerator.device().clone();

    let varmap = VarMap::new();
    let model = Mlp::new(accelerator.var_builder(&varmap, DType::F32))?;
    let opt = AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: 1e-2,
            ..Default::default()
        },
    )?;
    let loader = DataLoader::new(synthetic(512)?, 32).shuffle(true).seed(7);
    let (varmap, mut opt, mut loader) = accelerator.prepare((varmap, opt, loader))?;
    let _ = &varmap;

    for epoch in 0..epochs {
        let mut total = 0f32;
        let mut batches = 0usize;
        for batch in loader.iter() {
            let (inputs, targets) = batch?;
            let outputs = accelerator.autocast(|ac| model.forward(&ac.input(&inputs)?))?;
            let loss = candle_nn::loss::mse(&outputs, &targets)?;
            let grads = accelerator.backward(&loss)?;
            opt.step(&grads)?;
            total += loss.to_scalar::<f32>()?;
            batches += 1;
        }
        // The epoch's loss averaged over every process's batches.
        let mean = Tensor::new(&[total / batches.max(1) as f32], &device)?;
        let mean = accelerator.reduce(&mean, ivme::comm::ReduceOp::Mean)?;
        accelerator.print(format!(
            "epoch {epoch}: loss {:.5}",
            mean.to_vec1::<f32>()?[0]
        ));
    }
    Ok(())
}
