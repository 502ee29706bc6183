//! Every key (checkpoints saved each epoch under the project), a device choice that can fail, a closure computing the loss, a `while` loop
//! around the batch loop, and a boxed error return.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Optimizer, VarBuilder, VarMap};
use ivme::accelerate;
use ivme::optim::{AdamW, ParamsAdamW};

#[accelerate(
    grad_accum = 4,
    precision = "bf16",
    clip_grad_norm = 1,
    cpu = true,
    seed = 7,
    project_dir = "runs/demo",
    total_limit = 2,
    collective_timeout = 90.5,
    debug_sync = true,
    async_checkpoints = true,
    snapshot_every = 10,
    zero = 2
)]
fn train(batches: Vec<(Tensor, Tensor)>) -> Result<f32, Box<dyn std::error::Error>> {
    let device = Device::cuda_if_available(0)?;
    let varmap = VarMap::new();
    let model = linear(2, 1, VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
    let mut opt = AdamW::new(varmap.all_vars(), ParamsAdamW::default())?;
    let loss_of = |pred: &Tensor, y: &Tensor| -> candle_core::Result<Tensor> {
        candle_nn::loss::mse(pred, y)?.affine(0.5, 0.0)
    };
    let mut total = 0.0;
    let mut epoch = 0;
    while epoch < 3 {
        for (x, y) in batches.clone() {
            let loss = loss_of(&model.forward(&x)?, &y)?;
            let grads = loss.backward()?;
            opt.step(&grads)?;
            total += loss.to_scalar::<f32>()?;
        }
        epoch += 1;
        accelerator.save_state(None)?;
    }
    println!("process {} done", accelerator.process_index());
    Ok(total)
}

fn main() {
    let _ = train;
}
