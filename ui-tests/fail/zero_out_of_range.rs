use ivme::accelerate;

#[accelerate(zero = 3)]
fn train() -> candle_core::Result<()> {
    Ok(())
}

#[accelerate(zero = "gradients")]
fn train_named() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
    let _ = train_named();
}
