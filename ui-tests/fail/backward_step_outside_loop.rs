#![allow(dead_code)]

use candle_core::Tensor;
use candle_nn::{Optimizer, VarMap, SGD};
use ivme::accelerate;

#[accelerate]
fn train(varmap: &VarMap, loss: &Tensor) -> candle_core::Result<()> {
    let mut opt = SGD::new(varmap.all_vars(), 0.1)?;
    opt.backward_step(loss)?;
    Ok(())
}

fn main() {}
