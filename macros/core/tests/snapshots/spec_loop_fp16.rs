fn train(
    batches: Vec<(Tensor, Tensor)>,
    params: ParamsAdamW,
) -> candle_core::Result<()> {
    #[allow(unused_mut, unused_variables)]
    let mut accelerator = ::ivme::Accelerator::builder()
        .grad_accum(2)
        .precision(::ivme::Precision::Fp16)
        .build()?;
    let __ivme_autocast = accelerator.autocast_scope();
    #[allow(unused_variables)]
    let device = Device::clone(accelerator.device());
    let varmap = VarMap::new();
    let model = Mlp::new(
        VarBuilder::clone(&accelerator.var_builder(&varmap, DType::F32)),
    )?;
    let mut opt = accelerator
        .prepare_optimizer(&varmap, AdamW::new(varmap.all_vars(), params))?;
    for (inputs, targets) in ::ivme::macro_support::shard(&accelerator, batches)? {
        let inputs = inputs.to_device(accelerator.device())?;
        let targets = targets.to_device(accelerator.device())?;
        let outputs = __ivme_autocast
            .run(|__ivme_ac| model.forward(&__ivme_ac.input(&inputs)?))?;
        let loss = loss_fn(&outputs, &targets)?;
        let grads = accelerator.backward(&loss)?;
        opt.step(&grads)?;
        accelerator.preemption_point()?;
    }
    Ok(())
}
