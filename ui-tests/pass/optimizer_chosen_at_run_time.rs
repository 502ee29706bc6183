//! An optimizer and a schedule picked at run time, with no enum of the user's own.

use candle_core::{Module, Tensor};
use candle_nn::{Linear, Optimizer, VarMap};
use ivme::accelerate;
use ivme::optim::{AnyOptimizer, AnyParams, LrSchedule, LrScheduler, ParamsSgd, WarmupCosine};

#[accelerate]
fn train(
    model: &Linear,
    varmap: &VarMap,
    data: Vec<(Tensor, Tensor)>,
    sgd: bool,
) -> ivme::Result<()> {
    let params = if sgd {
        AnyParams::Sgd(ParamsSgd { lr: 0.1, ..Default::default() })
    } else {
        AnyParams::AdamW(Default::default())
    };
    let mut opt = AnyOptimizer::new(varmap.all_vars(), params)?;
    let schedule: Box<dyn LrSchedule> = Box::new(WarmupCosine::new(2, 10)?);
    let mut sched = LrScheduler::new(&opt, schedule);
    for (x, y) in data {
        let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
        opt.backward_step(&loss)?;
        sched.step();
    }
    Ok(())
}

fn main() {
    let _ = train;
}
