use ivme::accelerate;

#[accelerate]
async fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
