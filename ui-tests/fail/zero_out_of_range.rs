use ivme::accelerate;

#[accelerate(zero = 4)]
fn train() -> candle_core::Result<()> {
    Ok(())
}

#[accelerate(zero = "gradients")]
fn train_named() -> candle_core::Result<()> {
    Ok(())
}

#[accelerate(zero = 3, activation_checkpointing = false)]
fn train_stage3_unchecked() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
    let _ = train_named();
    let _ = train_stage3_unchecked();
}
