//! The prepared optimizer: steps only when the gradients say a window is complete and no
//! fp16 overflow happened, then refreshes the low-precision copies of the weights.

use super::{Linked, OptimizerLink, StatefulOptimizer};
use crate::error::{Error, Result};
use crate::observe::step_times::{Phase, StepClock};
use crate::optim::gradients::Gradients;
use crate::stateful::{Shared, StateDict, Stateful};
use candle_core::Var;
use std::sync::{Arc, MutexGuard};

/// An optimizer handed to [`Accelerator::prepare`](crate::Accelerator::prepare).
///
/// Its [`step`](Self::step) is safe to call on every micro-batch: it does nothing on
/// accumulation micro-steps and on fp16 overflow, so the user's loop needs no `if`.
#[derive(Debug)]
pub struct AcceleratedOptimizer<O> {
    // Shared with the Accelerator, which saves and restores its state.
    inner: Shared<O>,
    link: Arc<OptimizerLink>,
    // (low-precision copy the model computes with, f32 master the optimizer updates)
    copies: Vec<(Var, Var)>,
    skipped: bool,
    // Under sharding the Accelerator's backward steps the optimizer (shard.rs).
    stepped_in_backward: bool,
    // The Accelerator's step-time totals, which each real step adds to.
    clock: Option<Arc<StepClock>>,
}

impl<O: StatefulOptimizer> AcceleratedOptimizer<O> {
    pub(crate) fn new(inner: Shared<O>, copies: Vec<(Var, Var)>) -> Self {
        let link = inner.lock().link().clone();
        AcceleratedOptimizer {
            inner,
            link,
            copies,
            skipped: false,
            stepped_in_backward: false,
            clock: None,
        }
    }

    /// Adds the time of each real step to `clock` (the Accelerator's step-time report).
    pub(crate) fn with_clock(mut self, clock: Arc<StepClock>) -> Self {
        self.clock = Some(clock);
        self
    }

    /// The optimizer of a sharded model, which `backward` steps.
    pub(crate) fn sharded(inner: Shared<O>) -> Self {
        AcceleratedOptimizer {
            stepped_in_backward: true,
            ..Self::new(inner, Vec::new())
        }
    }

    /// Applies `grads` if they end an accumulation window and hold no inf/NaN; otherwise
    /// does nothing (see [`optimizer_step_was_skipped`](Self::optimizer_step_was_skipped)).
    pub fn step(&mut self, grads: &Gradients) -> Result<()> {
        if !grads.is_sync_step() {
            return Ok(());
        }
        if grads.found_overflow() {
            self.skipped = true;
            return Ok(());
        }
        if self.stepped_in_backward {
            self.skipped = false;
            return Ok(());
        }
        let start = std::time::Instant::now();
        self.inner.lock().step(grads.store())?;
        self.skipped = false;
        for (copy, master) in &self.copies {
            crate::precision::refresh_copy(copy, master)?;
        }
        if let Some(clock) = &self.clock {
            clock.since(Phase::Optimizer, start);
        }
        Ok(())
    }

    /// Whether the last window's step was skipped because fp16 gradients overflowed.
    pub fn optimizer_step_was_skipped(&self) -> bool {
        self.skipped
    }

    /// The learning rate the next real step uses.
    pub fn learning_rate(&self) -> f64 {
        self.link.lr()
    }

    /// Sets the learning rate of the next real step.
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.link.set_lr(lr)
    }

    /// Real optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        self.link.steps()
    }

    /// The wrapped optimizer, locked for inspection or changes.
    pub fn inner(&self) -> MutexGuard<'_, O> {
        self.inner.lock()
    }
}

impl<O> Linked for AcceleratedOptimizer<O> {
    fn link(&self) -> &Arc<OptimizerLink> {
        &self.link
    }
}

/// How the Accelerator saves a prepared optimizer: its per-variable state keyed by variable
/// name, so a resumed process (whose VarMap may list variables in another order) finds it.
pub(crate) struct OptimizerSlot<O> {
    pub(crate) opt: Shared<O>,
    // names[i] is the name of opt.vars()[i]
    pub(crate) names: Vec<String>,
    /// Whether the state is saved flat (a sharded model's pieces are flat runs, though a piece
    /// that is a whole variable is updated in the variable's shape): flattened when saved,
    /// given the variable's shape back when loaded.
    pub(crate) flat: bool,
}

/// A prepared optimizer as the Accelerator keeps it: its state for checkpoints, and how many
/// real steps it has taken (read without copying its state).
pub(crate) trait PreparedSlot: Stateful {
    /// Real optimizer steps taken so far.
    fn steps(&self) -> u64;
}

impl<O: StatefulOptimizer + Send> PreparedSlot for OptimizerSlot<O> {
    fn steps(&self) -> u64 {
        self.opt.lock().link().steps()
    }
}

impl<O: StatefulOptimizer + Send> Stateful for OptimizerSlot<O> {
    fn state_dict(&self) -> Result<StateDict> {
        let state = self.opt.lock().state_dict()?;
        let mut tensors = Vec::new();
        for (name, per_var) in self.names.iter().zip(state.tensors) {
            for (key, t) in per_var {
                let t = if self.flat { t.flatten_all()? } else { t };
                tensors.push((format!("{name}::{key}"), t));
            }
        }
        Ok(StateDict {
            tensors,
            json: state.scalars,
        })
    }

    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let mut per_var: Vec<Vec<(String, candle_core::Tensor)>> =
            vec![Vec::new(); self.names.len()];
        let shapes: Vec<candle_core::Shape> = match self.flat {
            true => self
                .opt
                .lock()
                .vars()
                .iter()
                .map(|v| v.shape().clone())
                .collect(),
            false => Vec::new(),
        };
        for (full, t) in &state.tensors {
            let (name, key) = full.split_once("::").ok_or_else(|| {
                Error::Usage(format!(
                    "optimizer state entry `{full}` is not `variable::key`"
                ))
            })?;
            let i = self.names.iter().position(|n| n == name).ok_or_else(|| {
                Error::Usage(format!(
                    "the saved optimizer state has variable `{name}`, which this optimizer does not update"
                ))
            })?;
            // A count that does not match is left for the optimizer to report.
            let t = match shapes.get(i) {
                Some(s) if s.elem_count() == t.elem_count() => t.reshape(s)?,
                _ => t.clone(),
            };
            per_var[i].push((key.to_string(), t));
        }
        let state = super::OptimizerState {
            tensors: per_var,
            scalars: state.json.clone(),
        };
        self.opt.lock().load_state_dict(&state)
    }
}
