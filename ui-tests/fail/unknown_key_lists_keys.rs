use ivme::accelerate;

#[accelerate(learning_rate = 0.1)]
fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
