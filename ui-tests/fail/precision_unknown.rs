use ivme::accelerate;

#[accelerate(precision = "fp8")]
fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
