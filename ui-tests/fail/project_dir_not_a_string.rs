use ivme::accelerate;

#[accelerate(project_dir = runs, total_limit = 0)]
fn train() -> candle_core::Result<()> {
    Ok(())
}

fn main() {
    let _ = train();
}
