use ivme::accelerate;

#[accelerate(grad_accum = 2, precision = "bf16", grad_accum = 4)]
fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
