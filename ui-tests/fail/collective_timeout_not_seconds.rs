use ivme::accelerate;

#[accelerate(collective_timeout = "10m")]
fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
