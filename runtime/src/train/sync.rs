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

use crate::setup::config::{BufferSync, Sharding};

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
    overlap: bool,
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
            overlap: false,
        }
    }
    /// The same settings with the optimizer stepped inside `backward`, overlapped with the
    /// sync (`overlap.rs`).
    pub(crate) fn with_overlap(mut self, on: bool) -> Self {
        self.overlap = on;
        self
    }
    /// Whether the optimizer steps inside `backward`, overlapped with the sync.
    pub(crate) fn overlap(&self) -> bool {
        self.overlap
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
