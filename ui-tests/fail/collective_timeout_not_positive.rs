use ivme::accelerate;

#[accelerate(collective_timeout = 0)]
fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
