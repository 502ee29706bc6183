use ivme::accelerate;

#[accelerate(cpu = 1)]
fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
