//! An optimizer chosen at run time (from a flag or a config file) without an enum of your own.
//!
//! `AcceleratedOptimizer<O>` and the macro work with one concrete optimizer type; a program
//! that picks AdamW or SGD from its arguments uses [`AnyOptimizer`], which is either and
//! forwards every call, state included. Schedules chosen at run time box themselves:
//! `LrScheduler::new(&opt, choice)` takes a `Box<dyn LrSchedule>` too.

use super::{AdamW, Linked, OptimizerLink, OptimizerState, ParamsAdamW, ParamsSgd, Sgd};
use super::{LrSchedule, StatefulOptimizer};
use crate::error::Result;
use candle_core::backprop::GradStore;
use candle_core::Var;
use candle_nn::Optimizer;
use std::sync::Arc;

/// ivme's AdamW or SGD, whichever the configuration names.
///
/// ```no_run
/// use candle_nn::{Optimizer, VarMap};
/// use ivme::optim::{AnyOptimizer, AnyParams, ParamsSgd};
///
/// # fn main() -> candle_core::Result<()> {
/// let varmap = VarMap::new();
/// let params = match std::env::args().nth(1).as_deref() {
///     Some("sgd") => AnyParams::Sgd(ParamsSgd { lr: 0.1, ..Default::default() }),
///     _ => AnyParams::AdamW(Default::default()),
/// };
/// let opt = AnyOptimizer::new(varmap.all_vars(), params)?;
/// # let _ = opt; Ok(()) }
/// ```
#[derive(Debug)]
pub enum AnyOptimizer {
    /// [`AdamW`].
    AdamW(AdamW),
    /// [`Sgd`] (with momentum, Nesterov, dampening and weight decay).
    Sgd(Sgd),
}

/// The hyper-parameters of an [`AnyOptimizer`]: which optimizer, with its settings.
#[derive(Debug, Clone)]
pub enum AnyParams {
    /// Build an [`AdamW`].
    AdamW(ParamsAdamW),
    /// Build an [`Sgd`].
    Sgd(ParamsSgd),
}

macro_rules! each {
    ($self:expr, $o:ident => $e:expr) => {
        match $self {
            AnyOptimizer::AdamW($o) => $e,
            AnyOptimizer::Sgd($o) => $e,
        }
    };
}

impl Optimizer for AnyOptimizer {
    type Config = AnyParams;

    fn new(vars: Vec<Var>, config: AnyParams) -> candle_core::Result<Self> {
        Ok(match config {
            AnyParams::AdamW(p) => AnyOptimizer::AdamW(AdamW::new(vars, p)?),
            AnyParams::Sgd(p) => AnyOptimizer::Sgd(Sgd::new(vars, p)?),
        })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        each!(self, o => o.step(grads))
    }

    fn learning_rate(&self) -> f64 {
        each!(self, o => o.learning_rate())
    }

    fn set_learning_rate(&mut self, lr: f64) {
        each!(self, o => o.set_learning_rate(lr))
    }
}

impl Linked for AnyOptimizer {
    fn link(&self) -> &Arc<OptimizerLink> {
        each!(self, o => o.link())
    }
}

impl StatefulOptimizer for AnyOptimizer {
    fn vars(&self) -> &[Var] {
        each!(self, o => o.vars())
    }

    fn replace_vars(&mut self, vars: Vec<Var>) -> Result<()> {
        each!(self, o => o.replace_vars(vars))
    }

    fn rebind_fresh(&mut self, vars: Vec<Var>) -> Result<()> {
        each!(self, o => o.rebind_fresh(vars))
    }

    fn state_dict(&self) -> Result<OptimizerState> {
        each!(self, o => o.state_dict())
    }

    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        each!(self, o => o.load_state_dict(state))
    }
}

/// A schedule chosen at run time: `LrScheduler::new(&opt, Box::new(WarmupCosine::new(..)?)
/// as Box<dyn LrSchedule>)`.
impl LrSchedule for Box<dyn LrSchedule> {
    fn factor(&self, step: u64) -> f64 {
        (**self).factor(step)
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
}
