fn train(
    model: &Linear,
    opt: &mut SGD,
    data: &[(Tensor, Tensor)],
) -> anyhow::Result<()> {
    #[allow(unused_mut, unused_variables)]
    let mut accelerator = ::ivme::Accelerator::builder().build()?;
    for (x, y) in ::ivme::macro_support::shard(&accelerator, data)? {
        let loss = candle_nn::loss::mse(&model.forward(x)?, y)?;
        opt.step(&accelerator.backward(&loss)?)?;
    }
    Ok(())
}
