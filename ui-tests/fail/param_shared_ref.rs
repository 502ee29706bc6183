#![allow(dead_code)]

use ivme::accelerate;

#[accelerate]
fn train(accelerator: &ivme::Accelerator) -> candle_core::Result<()> {
    let _ = accelerator.device();
    Ok(())
}

fn main() {}
