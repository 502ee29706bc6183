#![allow(dead_code)]

use ivme::accelerate;
use ivme::Accelerator;

#[accelerate(grad_accum = 2, precision = "bf16")]
fn train(accelerator: &mut Accelerator) -> candle_core::Result<()> {
    let _ = accelerator.device();
    Ok(())
}

fn main() {}
