//! The SPEC's plain candle loop, unchanged, under grad_accum = 2 and fp16, with a scheduler.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap};
use ivme::accelerate;
use ivme::optim::{AdamW, LrScheduler, ParamsAdamW, StepLr};

struct Mlp {
    l1: Linear,
    l2: Linear,
}

impl Mlp {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Mlp {
            l1: linear(4, 8, vb.pp("l1"))?,
            l2: linear(8, 1, vb.pp("l2"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.l2.forward(&self.l1.forward(xs)?.relu()?)
    }
}

fn loss_fn(outputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::loss::mse(outputs, targets)
}

#[accelerate(grad_accum = 2, precision = "fp16")]
fn train(batches: Vec<(Tensor, Tensor)>, params: ParamsAdamW) -> candle_core::Result<()> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
    let mut opt = AdamW::new(varmap.all_vars(), params)?;
    let mut scheduler = LrScheduler::new(&opt, StepLr::new(10, 0.5)?);
    for (inputs, targets) in batches {
        let inputs = inputs.to_device(&device)?;
        let targets = targets.to_device(&device)?;
        let outputs = model.forward(&inputs)?;
        let loss = loss_fn(&outputs, &targets)?;
        let grads = loss.backward()?;
        opt.step(&grads)?;
        scheduler.step();
    }
    Ok(())
}

fn main() {
    // Compiling is the test; training would need data.
    let _ = train;
}
