use ivme::accelerate;

#[accelerate(project_dir = "runs/demo", async_checkpoints = "yes")]
fn train() -> candle_core::Result<()> {
    accelerator.save_state(None)?;
    Ok(())
}

fn main() {
    let _ = train();
}
