//! ivme's own `DataLoader`: prepared by the macro and iterated per epoch; the model's forward
//! goes through a helper function (nested items are left alone).

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap};
use ivme::accelerate;
use ivme::data::{DataLoader, TensorDataset};
use ivme::optim::{ParamsSgd, Sgd};

#[accelerate(precision = "no")]
fn train(x: Tensor, y: Tensor) -> candle_core::Result<()> {
    fn predict(model: &Linear, x: &Tensor) -> candle_core::Result<Tensor> {
        model.forward(x)
    }
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let model = linear(3, 1, VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
    let mut opt = Sgd::new(varmap.all_vars(), ParamsSgd::default())?;
    // Built ahead on a background thread: prepared first, then `.prefetch` on the result.
    let mut loader = DataLoader::new(TensorDataset::new((x, y))?, 8).prefetch(2);
    for _epoch in 0..2 {
        for batch in loader.iter() {
            let (xb, yb) = batch?;
            let loss = candle_nn::loss::mse(&predict(&model, &xb)?, &yb)?;
            let grads = loss.backward()?;
            opt.step(&grads)?;
        }
    }
    Ok(())
}

fn main() {
    let _ = train;
}
