use ivme::accelerate;

#[accelerate(precision = bf16)]
fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
