use ivme::accelerate;

#[accelerate]
const fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
