//! The prepared optimizer: steps only when the gradients say a window is complete and no
//! fp16 overflow happened, then refreshes the low-precision copies of the weights.

use super::{Linked, OptimizerLink, StatefulOptimizer};
use crate::error::Result;
use crate::grads::Gradients;
use candle_core::{DType, Var};
use std::sync::Arc;

/// An optimizer handed to [`Accelerator::prepare`](crate::Accelerator::prepare).
///
/// Its [`step`](Self::step) is safe to call on every micro-batch: it does nothing on
/// accumulation micro-steps and on fp16 overflow, so the user's loop needs no `if`.
#[derive(Debug)]
pub struct AcceleratedOptimizer<O> {
    inner: O,
    // (low-precision copy the model computes with, f32 master the optimizer updates)
    copies: Vec<(Var, Var)>,
    skipped: bool,
}

impl<O: StatefulOptimizer> AcceleratedOptimizer<O> {
    pub(crate) fn new(inner: O, copies: Vec<(Var, Var)>) -> Self {
        AcceleratedOptimizer { inner, copies, skipped: false }
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
        self.inner.step(grads.store())?;
        self.skipped = false;
        for (copy, master) in &self.copies {
            copy.set(&master.as_tensor().to_dtype(copy.dtype())?)?;
        }
        Ok(())
    }

    /// Whether the last window's step was skipped because fp16 gradients overflowed.
    pub fn optimizer_step_was_skipped(&self) -> bool {
        self.skipped
    }

    /// The learning rate the next real step uses.
    pub fn learning_rate(&self) -> f64 {
        self.inner.learning_rate()
    }

    /// Sets the learning rate of the next real step.
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.inner.set_learning_rate(lr)
    }

    /// Real optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        self.inner.link().steps()
    }

    /// The wrapped optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The wrapped optimizer, mutably (e.g. to restore its state).
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// Unwraps the optimizer.
    pub fn into_inner(self) -> O {
        self.inner
    }

    /// Whether the weights the model computes with are separate low-precision copies.
    pub fn has_low_precision_copies(&self) -> bool {
        self.copies.iter().any(|(c, _)| c.dtype() != DType::F32)
    }
}

impl<O: Linked> Linked for AcceleratedOptimizer<O> {
    fn link(&self) -> &Arc<OptimizerLink> {
        self.inner.link()
    }
}
