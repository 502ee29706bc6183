fn train(
    model: &Linear,
    opt: &mut SGD,
    data: &[(Tensor, Tensor)],
) -> anyhow::Result<()> {
    #[allow(unused_mut, unused_variables)]
    let mut accelerator = ::ivme::Accelerator::builder().build()?;
    let __ivme_autocast = accelerator.autocast_scope();
    for (x, y) in ::ivme::macro_support::shard(&accelerator, data)? {
        let loss = candle_nn::loss::mse(
            &__ivme_autocast.run(|__ivme_ac| model.forward(x))?,
            y,
        )?;
        opt.step(&accelerator.backward(&loss)?)?;
        accelerator.preemption_point()?;
    }
    Ok(())
}
