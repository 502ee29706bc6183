//! No configuration, a model passed by reference, `backward_step`, an `ivme::Result` return.

use candle_core::{Module, Tensor};
use candle_nn::{Linear, Optimizer, VarMap};
use ivme::accelerate;
use ivme::optim::{ParamsSgd, Sgd};

#[accelerate]
fn train(model: &Linear, varmap: &VarMap, data: &[(Tensor, Tensor)]) -> ivme::Result<f32> {
    let params = ParamsSgd {
        lr: 0.1,
        ..Default::default()
    };
    let mut opt = Sgd::new(varmap.all_vars(), params)?;
    let mut last = 0.0;
    for (x, y) in data {
        let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
        opt.backward_step(&loss)?;
        last = loss.to_scalar::<f32>()?;
    }
    Ok(last)
}

fn main() {
    let _ = train;
}
