use ivme::accelerate;

#[accelerate(cpu)]
fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
