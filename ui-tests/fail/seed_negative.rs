use ivme::accelerate;

#[accelerate(seed = -3)]
fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
