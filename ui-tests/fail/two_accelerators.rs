#![allow(dead_code)]

use ivme::accelerate;
use ivme::Accelerator;

#[accelerate]
fn train(a: &mut Accelerator, b: &mut Accelerator) -> candle_core::Result<()> {
    let _ = (a.device(), b.device());
    Ok(())
}

fn main() {}
