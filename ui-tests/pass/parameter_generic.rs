//! The `&mut Accelerator` parameter form on a generic function with nested epoch / batch loops.

use candle_core::{Device, Module, Tensor};
use candle_nn::{Optimizer, VarMap};
use ivme::optim::{ParamsSgd, Sgd};
use ivme::{accelerate, Accelerator};

#[accelerate]
pub fn train<M: Module>(
    accelerator: &mut Accelerator,
    model: &M,
    varmap: &VarMap,
    data: Vec<(Tensor, Tensor)>,
    epochs: usize,
) -> candle_core::Result<f32> {
    let mut opt = Sgd::new(varmap.all_vars(), ParamsSgd::default())?;
    let mut last = 0.0;
    for _epoch in 0..epochs {
        for (x, y) in &data {
            let logits = model.forward(&x.to_device(&Device::Cpu)?)?;
            let loss = candle_nn::loss::mse(&logits, &y)?;
            let grads = loss.backward()?;
            opt.step(&grads)?;
            last = loss.to_scalar::<f32>()?;
        }
    }
    accelerator.wait_for_everyone()?;
    Ok(last)
}

fn main() {
    let _ = train::<candle_nn::Linear>;
}
