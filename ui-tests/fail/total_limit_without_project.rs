use ivme::accelerate;

#[accelerate(total_limit = 3)]
fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
