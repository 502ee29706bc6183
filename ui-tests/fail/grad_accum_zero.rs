use ivme::accelerate;

#[accelerate(grad_accum = 0)]
fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
