use ivme::accelerate;

// Every mistake in the attribute is reported in one compile.
#[accelerate(
    grad_accum = 0,
    precison = "fp16",
    clip_grad_value = "big",
    seed = 1,
    seed = 2
)]
fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
