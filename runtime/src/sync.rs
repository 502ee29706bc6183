//! How an accumulation window's gradients end: the gradient-sync strategy.
//!
//! `backward` scales the loss, runs candle's backward and adds each micro-batch into the
//! models' window sums; on the window's last micro-batch it hands the window to the strategy
//! the run was built with:
//!
//! - [`Strategy::Replicated`] (plain data parallelism): every process averages the whole
//!   gradients with the bucketed, position-checked all-reduce (`bucket.rs`), unscales them and
//!   checks for fp16 overflow, then clips them by the global norm or by value. On one process
//!   the communicator is the identity, and a window that needs no averaging, unscaling or
//!   copying hands candle's own gradients through untouched.
//! - [`Strategy::Sharded`] (ZeRO stages 1 and 2, `shard.rs`): each process ends with its slice
//!   of the mean gradient, the processes agree on the global norm and overflow, and each steps
//!   the optimizer over its slice inside `backward`.
//!
//! A new strategy is a variant here and its arm in [`Accelerator::end_window`]; `backward`
//! does not change.

use crate::accelerator::Accelerator;
use crate::comm::Communicator;
use crate::config::{BufferSync, Sharding};
use crate::error::Result;
use crate::grads::Gradients;
use candle_core::backprop::GradStore;

/// The gradient-sync strategy of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Strategy {
    /// Whole gradients averaged on every process; the optimizer steps after `backward`.
    Replicated,
    /// Each process ends with its slice and steps it inside `backward`.
    Sharded,
}

impl Strategy {
    /// The strategy of a sharding stage.
    pub fn of(sharding: Sharding) -> Strategy {
        match sharding {
            Sharding::No => Strategy::Replicated,
            Sharding::Optimizer | Sharding::Gradients => Strategy::Sharded,
        }
    }
}

/// How windows end, as the builder set it: the strategy's stage, the all-reduce bucket size
/// and the clipping applied to every window's gradients.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SyncSettings {
    sharding: Sharding,
    bucket_bytes: usize,
    clip_norm: Option<f64>,
    clip_value: Option<f64>,
    buffers: BufferSync,
}

impl SyncSettings {
    /// The settings of a run.
    pub(crate) fn new(
        sharding: Sharding,
        bucket_bytes: usize,
        clip_norm: Option<f64>,
        clip_value: Option<f64>,
    ) -> Self {
        SyncSettings {
            sharding,
            bucket_bytes,
            clip_norm,
            clip_value,
            buffers: BufferSync::Broadcast,
        }
    }
    /// The same settings with buffers agreeing as `buffers` says.
    pub(crate) fn with_buffers(mut self, buffers: BufferSync) -> Self {
        self.buffers = buffers;
        self
    }
    /// How buffers agree across processes.
    pub(crate) fn buffers(&self) -> BufferSync {
        self.buffers
    }
    /// How much of the training state each process holds.
    pub(crate) fn sharding(&self) -> Sharding {
        self.sharding
    }
    /// The strategy that ends a window.
    pub(crate) fn strategy(&self) -> Strategy {
        Strategy::of(self.sharding)
    }
    /// Bytes per all-reduce bucket.
    pub(crate) fn bucket_bytes(&self) -> usize {
        self.bucket_bytes
    }
    /// The global-norm limit every window is clipped to, if any.
    pub(crate) fn clip_norm(&self) -> Option<f64> {
        self.clip_norm
    }
    /// The value limit every window is clamped to, if any.
    pub(crate) fn clip_value(&self) -> Option<f64> {
        self.clip_value
    }
}

impl Accelerator {
    /// Ends the window on its last micro-batch: the gradients the optimizer gets, whether
    /// fp16 overflowed and (when clipping measured it) the global norm.
    pub(crate) fn end_window(&mut self, touched: &[bool], inv_scale: f64) -> Result<Gradients> {
        let position = self.training.window().position();
        self.end_window_buffers(touched)?;
        match self.sync.strategy() {
            Strategy::Sharded => {
                let (store, overflow, norm) = self.step_sharded(touched, position, inv_scale)?;
                Ok(Gradients::synced(store, overflow).with_norm(norm))
            }
            Strategy::Replicated => {
                let mut out = GradStore::default();
                let mut overflow = false;
                // Only the models this loss reached end their window here: another model
                // trained in the same micro-step (a second loss, a GAN's other half) ends it at
                // its own backward.
                for m in self.training.touched_mut(touched) {
                    overflow |= m.take_synced(
                        &self.comm,
                        position,
                        self.sync.bucket_bytes(),
                        inv_scale,
                        self.mixed.scales_loss(),
                        &mut out,
                    )?;
                }
                let mut grads = Gradients::synced(out, overflow);
                if !overflow {
                    self.clip(&mut grads)?;
                }
                Ok(grads)
            }
        }
    }

    /// Whether a one-micro-batch window's gradients are already final as candle computed
    /// them: replicated over the identity communicator, no loss scale, no low-precision copies
    /// and nothing summed from earlier micro-batches.
    pub(crate) fn passes_through(&self) -> bool {
        self.sync.strategy() == Strategy::Replicated
            && self.comm.world_size() == 1
            && !self.mixed.scales_loss()
            && self
                .training
                .models()
                .iter()
                .all(|m| !m.has_copies() && m.sums.iter().all(Option::is_none))
    }

    /// Ends a window that [`passes_through`](Self::passes_through): candle's store, clipped.
    pub(crate) fn end_in_place(&self, store: GradStore) -> Result<Gradients> {
        let mut grads = Gradients::synced(store, false);
        self.clip(&mut grads)?;
        Ok(grads)
    }

    /// Clips synced, replicated gradients as the builder set: by the global norm, or by value.
    fn clip(&self, grads: &mut Gradients) -> Result<()> {
        if self.sync.clip_norm().is_none() && self.sync.clip_value().is_none() {
            return Ok(());
        }
        let vars = self.training.trained_master_vars();
        if let Some(n) = self.sync.clip_norm() {
            grads.clip_norm(&vars, n, 2.0)?;
        }
        if let Some(v) = self.sync.clip_value() {
            grads.clip_value(&vars, v)?;
        }
        Ok(())
    }
}
