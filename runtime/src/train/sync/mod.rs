//! How an accumulation window's gradients end: the gradient-sync strategy, behind one call.
//!
//! `backward` (the facade) scales the loss, runs candle's backward and hands the micro-batch's
//! store to [`take`]: it adds the gradients to the models' window sums and, on the window's
//! last micro-batch, ends the window with the strategy the run was built with, after bringing
//! the buffers of the models the window trained to agreement (`train/buffers.rs`):
//!
//! - [`Strategy::Replicated`] (plain data parallelism, `replicated.rs`): every process averages
//!   the whole gradients with the bucketed, position-checked all-reduce (`bucket.rs`),
//!   unscales them and checks for fp16 overflow, then clips them by the global norm or by
//!   value; under `overlap` the optimizer steps bucket by bucket during the sync
//!   (`overlap.rs`). On one process a window that needs no averaging, unscaling or copying
//!   hands candle's own gradients through untouched.
//! - [`Strategy::Sharded`] (ZeRO stages 1, 2 and 3, `sharded.rs`, stage 2's collectives in
//!   `scatter.rs`): each process ends with its slice of the mean gradient, the processes
//!   agree on the global norm and overflow, and each steps the optimizer over its slice.
//!   Under stage 3 the blocks' weights are slices too, gathered for each run of their
//!   checkpointed segment and their gradients reduce-scattered as soon as the segment's
//!   backward ends (`gathered.rs`, `resident.rs`); the window's end takes those slices as
//!   they are.
//!
//! A new strategy is a variant here, a file beside the two, and its arm in [`end_window`];
//! `backward` does not change.

pub(crate) mod gathered;
mod overlap;
mod replicated;
mod resident;
pub(crate) mod scatter;
mod sharded;

pub(crate) use overlap::warnings as overlap_warnings;

use crate::comm::Communicator;
use crate::error::Result;
use crate::observe::step_times::Phase;
use crate::optim::gradients::Gradients;
use crate::train::training::Training;
use candle_core::backprop::GradStore;
use std::time::{Duration, Instant};

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
            Sharding::Optimizer | Sharding::Gradients | Sharding::Parameters => Strategy::Sharded,
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

/// One micro-batch's gradients as `backward` hands them over.
pub(crate) struct MicroBatch {
    /// candle's gradients of the loss times `loss_scale` over the window's size.
    pub store: GradStore,
    /// Whether this micro-batch is its window's last (the window ends here).
    pub ends_window: bool,
    /// The fp16 loss scale the loss was multiplied by (1 otherwise); undone at the window's end.
    pub loss_scale: f64,
    /// Whether the loss is scaled (fp16): the window's end then looks for inf/NaN.
    pub scaled: bool,
    /// When the micro-batch's backward began, for the step-time phases.
    pub started: Instant,
    /// How long checkpointed segments took to run again inside it (their own phase).
    pub recomputed: Duration,
}

/// Everything a window's end reads besides the models: the communicator, the settings, the
/// data position the collectives check, and the scale to undo.
pub(crate) struct WindowEnd<'a> {
    /// The processes' communicator (the identity in a world of one).
    pub comm: &'a dyn Communicator,
    /// How windows end.
    pub settings: &'a SyncSettings,
    /// Where the data stands; every collective checks the ranks agree on it.
    pub position: u64,
    /// One over the loss scale (1 without fp16).
    pub inv_scale: f64,
    /// Whether to look for inf/NaN (fp16).
    pub check_overflow: bool,
}

/// What [`take`] hands back: the gradients `backward` returns and, when the window ended,
/// when its end began (the step's sync phase runs from there until `backward` is done).
pub(crate) struct Taken {
    /// The gradients `backward` returns.
    pub grads: Gradients,
    /// When the window's end began, if it ended.
    pub sync_began: Option<Instant>,
}

/// Takes one micro-batch's gradients into the window: adds them to the models' window sums
/// and, on the window's last micro-batch, ends the window (buffers agreed, gradients synced,
/// unscaled and clipped, sharded optimizers stepped). Records the micro-batch's backward
/// phase; the sync phase is the caller's to close.
pub(crate) fn take(
    training: &mut Training,
    settings: &SyncSettings,
    comm: &dyn Communicator,
    micro: MicroBatch,
) -> Result<Taken> {
    let clock = training.window().clock().clone();
    let MicroBatch {
        store,
        ends_window,
        loss_scale,
        scaled,
        started,
        recomputed,
    } = micro;
    let end = WindowEnd {
        comm,
        settings,
        position: training.window().position(),
        inv_scale: 1.0 / loss_scale,
        check_overflow: scaled,
    };
    if ends_window && replicated::passes_through(training, &end) {
        clock.since_less(Phase::Backward, started, recomputed);
        let sync_began = Some(Instant::now());
        let grads = replicated::end_in_place(training, &end, store)?;
        return Ok(Taken { grads, sync_began });
    }
    // Which models the loss reached (`touched[i]` for model `i`): only they end the window.
    let models = training.models_mut().iter_mut();
    let touched = models
        .map(|m| m.accumulate(&store))
        .collect::<Result<Vec<bool>>>()?;
    drop(store);
    clock.since_less(Phase::Backward, started, recomputed);
    if !ends_window {
        let grads = Gradients::accumulating();
        return Ok(Taken {
            grads,
            sync_began: None,
        });
    }
    let sync_began = Some(Instant::now());
    let grads = end_window(training, &end, &touched)?;
    Ok(Taken { grads, sync_began })
}

/// Ends the window on its last micro-batch for the models the loss reached (`touched[i]` for
/// model `i`): their buffers agreed, then the strategy's end.
fn end_window(training: &mut Training, end: &WindowEnd, touched: &[bool]) -> Result<Gradients> {
    training.end_window_buffers(end.comm, end.settings.buffers(), touched)?;
    match end.settings.strategy() {
        Strategy::Replicated => replicated::end(training, end, touched),
        Strategy::Sharded => sharded::end(training, end, touched),
    }
}
