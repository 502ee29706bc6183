#![allow(dead_code)]

use ivme::accelerate;
use ivme::Accelerator;

#[accelerate]
fn train(accelerator: Accelerator) -> candle_core::Result<()> {
    let _ = accelerator.device();
    Ok(())
}

fn main() {}
