//! Activation checkpointing at the facade: candle's backward, through the segments the
//! forward recorded ([`crate::activations`]), with the buffers put back after the recomputes
//! and the recomputes timed as their own phase.

use crate::accelerator::Accelerator;
use crate::error::{Error, Result};
use crate::observe::step_times::Phase;
use candle_core::backprop::GradStore;
use candle_core::Tensor;
use std::time::Duration;

impl Accelerator {
    /// The gradients of `loss` (already scaled), through the checkpointed segments when
    /// activation checkpointing is on; and the time the segments took to run again.
    pub(super) fn backward_through_segments(
        &mut self,
        loss: &Tensor,
    ) -> Result<(GradStore, Duration)> {
        let Some(segments) = self.segments.as_mut() else {
            return Ok((crate::nn::grad_sink::backward(loss)?, Duration::ZERO));
        };
        if !crate::activations::ever_ran() {
            return Err(Error::Usage(format!(
                "{} is on, but no forward pass ran a checkpointed segment on the thread that \
                 built the Accelerator: nothing would be recomputed. Run each block through \
                 ivme::activations::checkpoint(&x, move |x| block.forward(x)) on that thread, \
                 use a model from ivme::models, or turn {} off",
                ivme_settings::ACTIVATION_CHECKPOINTING.name,
                ivme_settings::ACTIVATION_CHECKPOINTING.name,
            )));
        }
        let verify = segments.verify_once();
        self.check_units_ran()?;
        // A recompute runs BatchNorm's forward again: its statistics are put back after.
        let buffers = self.training.buffer_values()?;
        let recomputed = crate::activations::backward(loss, verify)?;
        self.training.restore_buffers(&buffers)?;
        let clock = self.training.window().clock();
        for (began, ended) in &recomputed.spans {
            clock.between(Phase::Recompute, *began, *ended);
        }
        let took = recomputed.took();
        Ok((recomputed.store, took))
    }

    /// Whether this Accelerator runs checkpointed segments again during backward
    /// ([`crate::activations`]).
    pub fn activation_checkpointing(&self) -> bool {
        self.segments.is_some()
    }
}
