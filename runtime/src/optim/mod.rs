//! Optimizers whose whole state can be saved, learning-rate schedules, and the prepared
//! optimizer that gates steps for accumulation and mixed precision.
//!
//! ivme's optimizers implement candle-nn's [`candle_nn::Optimizer`] and compute the same
//! numbers as candle-nn's on the same gradients; unlike candle-nn's, their moments and step
//! count can be read and restored ([`StatefulOptimizer`]), in f32.

pub(crate) mod accelerated;
pub mod adamw;
pub mod any;
pub(crate) mod fused;
pub mod gradients;
pub(crate) mod parts;
pub(crate) mod runs;
pub mod schedule;
mod scheduler;
pub mod sgd;
mod state_io;

pub use accelerated::AcceleratedOptimizer;
pub use adamw::AdamW;
pub use any::{AnyOptimizer, AnyParams};
pub use candle_nn::ParamsAdamW;
pub use gradients::Gradients;
pub use schedule::{
    ConstantLr, ExponentialLr, LambdaLr, LrSchedule, LrScheduler, StepLr, WarmupConstant,
    WarmupCosine, WarmupLinear,
};
pub use sgd::{ParamsSgd, Sgd};

use crate::error::Result;
use candle_core::{Tensor, Var};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What an optimizer shares with the schedulers attached to it: how many real steps it has
/// taken and the learning rate it will use next.
///
/// A scheduler reads the step count, so it advances exactly once per real optimizer step no
/// matter how often `step()` is called on it (accumulation micro-steps and skipped fp16 steps
/// do not count).
#[derive(Debug)]
pub struct OptimizerLink {
    steps: AtomicU64,
    lr_bits: AtomicU64,
}

impl OptimizerLink {
    /// A link for an optimizer that starts at learning rate `lr` with no steps taken.
    pub fn new(lr: f64) -> Arc<Self> {
        Arc::new(OptimizerLink {
            steps: AtomicU64::new(0),
            lr_bits: AtomicU64::new(lr.to_bits()),
        })
    }
    /// Real optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps.load(Ordering::Relaxed)
    }
    /// Records one more real step.
    pub fn record_step(&self) {
        self.steps.fetch_add(1, Ordering::Relaxed);
    }
    /// Sets the step count (when restoring a checkpoint).
    pub fn set_steps(&self, steps: u64) {
        self.steps.store(steps, Ordering::Relaxed);
    }
    /// The learning rate the next step uses.
    pub fn lr(&self) -> f64 {
        f64::from_bits(self.lr_bits.load(Ordering::Relaxed))
    }
    /// Sets the learning rate the next step uses.
    pub fn set_lr(&self, lr: f64) {
        self.lr_bits.store(lr.to_bits(), Ordering::Relaxed);
    }
}

/// Anything that exposes an [`OptimizerLink`], so a scheduler can be attached to it.
pub trait Linked {
    /// The shared step counter and learning rate.
    fn link(&self) -> &Arc<OptimizerLink>;
}

/// The saved form of an optimizer: per-variable tensors (in the order of
/// [`StatefulOptimizer::vars`]) plus JSON scalars (step count, hyper-parameters).
#[derive(Debug, Clone)]
pub struct OptimizerState {
    /// For each variable, its named state tensors (e.g. `exp_avg`, `exp_avg_sq`), in f32.
    pub tensors: Vec<Vec<(String, Tensor)>>,
    /// Everything that is not a tensor.
    pub scalars: serde_json::Value,
}

/// An optimizer whose variables can be re-bound and whose state can be saved and restored.
pub trait StatefulOptimizer: candle_nn::Optimizer + Linked + Send + 'static {
    /// The variables it updates, in the order it was given them.
    fn vars(&self) -> &[Var];
    /// Replaces each variable by one of the same shape (position for position): used to point
    /// the optimizer at f32 master weights. Existing state is kept.
    fn replace_vars(&mut self, vars: Vec<Var>) -> Result<()>;
    /// Points an optimizer that has not stepped yet at another set of variables, any number
    /// of them, with fresh state: under sharding, at this process's slices of its variables.
    /// The default refuses, naming the optimizer.
    fn rebind_fresh(&mut self, vars: Vec<Var>) -> Result<()> {
        let _ = vars;
        Err(crate::error::Error::Usage(format!(
            "{} cannot be sharded: implement `StatefulOptimizer::rebind_fresh` for it, or use \
             ivme's AdamW or Sgd",
            std::any::type_name::<Self>()
        )))
    }
    /// The full state: moments, step count, hyper-parameters.
    fn state_dict(&self) -> Result<OptimizerState>;
    /// Restores a state produced by [`state_dict`](Self::state_dict) on the same variables.
    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()>;
}
