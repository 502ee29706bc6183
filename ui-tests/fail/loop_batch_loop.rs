use candle_core::{Module, Tensor};
use candle_nn::{Linear, Optimizer, VarMap};
use ivme::optim::{ParamsSgd, Sgd};
use ivme::accelerate;

#[accelerate]
fn train(model: &Linear, varmap: &VarMap, data: Vec<(Tensor, Tensor)>) -> candle_core::Result<()> {
    let mut opt = Sgd::new(varmap.all_vars(), ParamsSgd { lr: 0.1, ..Default::default() })?;
    let mut it = data.iter();
    loop {
        let Some((x, y)) = it.next() else { break };
        let loss = candle_nn::loss::mse(&model.forward(x)?, y)?;
        opt.backward_step(&loss)?;
    }
    Ok(())
}

fn main() {
    let _ = train;
}
