//! `#[accelerate(async_checkpoints = true)]` on a function whose Accelerator the attribute
//! creates: the background save the body started last is committed before the function
//! returns, so a failed commit is the function's error, not a message at the end.
//!
//! Run it in a scratch folder: the project is `runs/async-macro` under the current directory.
//! Prints `train ok <checkpoint count>` or `train failed: <error>` (exit code 3). With
//! `ASYNC_MACRO_FAIL=1` files this process writes are limited to 1 MiB, so the 2 MB model
//! file of the background save fails with a real I/O error (`EFBIG`).

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Optimizer, VarBuilder, VarMap};
use ivme::optim::{AdamW, ParamsAdamW};

#[ivme::accelerate(project_dir = "runs/async-macro", async_checkpoints = true)]
fn train(width: usize) -> ivme::Result<()> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let model = linear(
        width,
        1,
        VarBuilder::from_varmap(&varmap, DType::F32, &device).pp("l"),
    )?;
    let mut opt = AdamW::new(varmap.all_vars(), ParamsAdamW::default())?;
    let x = Tensor::ones((4, width), DType::F32, &device)?;
    let y = Tensor::zeros((4, 1), DType::F32, &device)?;
    let batches = vec![(x, y)];
    for (x, y) in batches {
        let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
        let grads = loss.backward()?;
        opt.step(&grads)?;
    }
    // Returns once the state is copied; the files are written in the background.
    accelerator.save_state(None)?;
    Ok(())
}

#[path = "support/fsize.rs"]
mod fsize;
use fsize::limit_file_size;

fn main() {
    if std::env::var("ASYNC_MACRO_FAIL").is_ok_and(|v| v == "1") {
        limit_file_size(1 << 20);
    }
    match train(1 << 19) {
        Ok(()) => {
            let saved = std::fs::read_dir("runs/async-macro/checkpoints")
                .map(|d| {
                    d.filter_map(|e| e.ok())
                        .filter(|e| e.path().is_dir())
                        .count()
                })
                .unwrap_or(0);
            println!("train ok {saved}");
        }
        Err(e) => {
            println!("train failed: {e}");
            std::process::exit(3);
        }
    }
}
