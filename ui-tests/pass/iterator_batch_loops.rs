//! Batch loops over `.iter().enumerate()`, `.iter()`, `.into_iter()` and `.enumerate()` of those
//! are sharded; a retry `loop` inside the batch `for` loop leaves the `for` loop as the one sharded.

use candle_core::{Module, Tensor};
use candle_nn::{Linear, Optimizer, VarMap};
use ivme::optim::{ParamsSgd, Sgd};
use ivme::accelerate;

#[accelerate]
fn train(model: &Linear, varmap: &VarMap, data: Vec<(Tensor, Tensor)>) -> candle_core::Result<()> {
    let mut opt = Sgd::new(varmap.all_vars(), ParamsSgd { lr: 0.1, ..Default::default() })?;
    for (i, (x, y)) in data.iter().enumerate() {
        let loss = candle_nn::loss::mse(&model.forward(x)?, y)?;
        let grads = loss.backward()?;
        opt.step(&grads)?;
        let _ = i + 1;
    }
    for (x, y) in data.iter() {
        let mut tries = 0;
        loop {
            let loss = candle_nn::loss::mse(&model.forward(x)?, y)?;
            opt.backward_step(&loss)?;
            tries += 1;
            if tries == 2 {
                break;
            }
        }
    }
    for (i, (x, y)) in data.into_iter().enumerate() {
        let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
        opt.backward_step(&loss)?;
        let _ = i;
    }
    Ok(())
}

fn main() {
    let _ = train;
}
