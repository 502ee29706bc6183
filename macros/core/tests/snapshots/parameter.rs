pub fn train<M: Module>(
    accelerator: &mut Accelerator,
    model: &M,
    varmap: &VarMap,
    data: Vec<(Tensor, Tensor)>,
    epochs: usize,
) -> candle_core::Result<f32> {
    let __ivme_autocast = accelerator.autocast_scope();
    let mut opt = accelerator
        .prepare_optimizer(&varmap, SGD::new(varmap.all_vars(), 0.1))?;
    let mut last = 0.0;
    for _epoch in 0..epochs {
        for (x, y) in ::ivme::macro_support::shard(&accelerator, &data)? {
            let logits = __ivme_autocast
                .run(|__ivme_ac| {
                    model
                        .forward(
                            &__ivme_ac
                                .input(&x.to_device(&Device::clone(accelerator.device()))?)?,
                        )
                })?;
            let loss = candle_nn::loss::mse(&logits, y)?;
            let grads = accelerator.backward(&loss)?;
            opt.step(&grads)?;
            last = loss.to_scalar::<f32>()?;
            accelerator.preemption_point()?;
        }
    }
    Ok(last)
}
