use ivme::accelerate;

#[accelerate(clip_grad_norm = 1.0, clip_grad_value = 0.5)]
fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
