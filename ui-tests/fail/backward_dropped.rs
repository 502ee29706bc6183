#![allow(dead_code)]

use candle_core::{Tensor, Var};
use ivme::accelerate;

#[accelerate]
fn train(w: &Var, x: &Tensor) -> candle_core::Result<()> {
    for _ in 0..3 {
        let loss = w.as_tensor().mul(x)?.sum_all()?;
        loss.backward()?;
    }
    Ok(())
}

fn main() {}
