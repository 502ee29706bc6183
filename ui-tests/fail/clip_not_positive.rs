use ivme::accelerate;

#[accelerate(clip_grad_norm = -1.0)]
fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
