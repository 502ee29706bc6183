//! Where the accumulation window stands: which micro-batch of its window the next backward
//! is, fed by the data loaders (so a short last window gets its true mean) or counted by
//! backward itself.

use crate::data::StepObserver;
use crate::observe::step_times::{Phase, StepClock};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Where the current micro-batch sits in its accumulation window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MicroStep {
    /// Number of micro-batches in this window (shorter for a last, partial window).
    pub window: usize,
    /// Whether this micro-batch ends its window (gradients are synced and applied).
    pub sync: bool,
}

#[derive(Debug, Default)]
struct Cursor {
    // Set once a prepared loader (or `Accelerator::micro_step`) reports batches: from then on
    // the data says where windows end, which is what makes a short last window exact.
    data_driven: bool,
    pending: Option<MicroStep>,
    // Without data reports, each backward call is the next micro-batch.
    auto_index: u64,
    // Padding samples at the end of the batch handed out last (for gather_for_metrics).
    last_padding: usize,
    // The index in its epoch of the batch a data source handed out last, plus one (0: none).
    last_batch: u64,
}

/// Tracks accumulation windows for one Accelerator.
#[derive(Debug)]
pub struct GradientState {
    accum: usize,
    cursor: Mutex<Cursor>,
    /// Where each step's time goes (observe/step_times.rs), fed by the loaders too.
    clock: Arc<StepClock>,
    /// Samples the prepared loaders handed out on this process (padding aside), for the
    /// progress bars' rate.
    samples: Arc<AtomicU64>,
}

impl GradientState {
    /// A state for windows of `accum` micro-batches.
    pub fn new(accum: usize) -> Self {
        GradientState {
            accum: accum.max(1),
            cursor: Mutex::new(Cursor::default()),
            clock: Arc::default(),
            samples: Arc::default(),
        }
    }

    /// The count of samples the prepared loaders handed out on this process.
    pub(crate) fn samples(&self) -> &Arc<AtomicU64> {
        &self.samples
    }

    /// The step-time totals this Accelerator's parts add to.
    pub(crate) fn clock(&self) -> &Arc<StepClock> {
        &self.clock
    }

    /// The configured window length.
    pub fn accum(&self) -> usize {
        self.accum
    }

    /// Where batch `index` of `total` sits: windows start at multiples of the window length
    /// and the last one may be shorter.
    pub fn locate(accum: usize, index: usize, total: usize) -> MicroStep {
        let start = index - index % accum;
        let window = accum.min(total.saturating_sub(start)).max(1);
        MicroStep {
            window,
            sync: index % accum == accum - 1 || index + 1 >= total,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cursor> {
        // A poisoned lock only means another thread panicked mid-update of plain integers.
        self.cursor.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The micro-step the next backward belongs to, without consuming it.
    pub fn peek(&self) -> MicroStep {
        let c = self.lock();
        match (c.data_driven, c.pending) {
            (true, Some(s)) => s,
            _ => {
                let pos = (c.auto_index % self.accum as u64) as usize;
                MicroStep {
                    window: self.accum,
                    sync: pos == self.accum - 1,
                }
            }
        }
    }

    /// The micro-step a backward call belongs to; advances the automatic counter when no
    /// data source drives the windows.
    pub(crate) fn for_backward(&self) -> MicroStep {
        let step = self.peek();
        let mut c = self.lock();
        if !(c.data_driven && c.pending.is_some()) {
            c.auto_index += 1;
        }
        step
    }

    /// Padding samples at the end of the batch a prepared data source handed out last.
    pub fn last_padding(&self) -> usize {
        self.lock().last_padding
    }

    /// Where the data stands, for the cross-rank check of the gradient sync: the index of the
    /// batch handed out last plus one (0 when no data source reports batches), combined with
    /// the automatic micro-step counter. Equal on every rank of a program in step.
    pub fn position(&self) -> u64 {
        let c = self.lock();
        c.last_batch ^ c.auto_index.rotate_left(32)
    }

    /// The automatic micro-step counter (for checkpoints).
    pub fn auto_index(&self) -> u64 {
        self.lock().auto_index
    }

    /// Restores the automatic micro-step counter.
    pub fn set_auto_index(&self, i: u64) {
        self.lock().auto_index = i;
    }
}

impl StepObserver for GradientState {
    fn on_batch(&self, index: usize, batches_in_epoch: usize, padding: usize) {
        let step = Self::locate(self.accum, index, batches_in_epoch);
        let mut c = self.lock();
        c.data_driven = true;
        c.pending = Some(step);
        c.last_padding = padding;
        c.last_batch = index as u64 + 1;
    }

    fn on_fetch(&self, took: std::time::Duration) {
        self.clock.add(Phase::Data, took);
    }

    fn on_samples(&self, samples: usize) {
        self.samples.fetch_add(samples as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_full_then_short_at_the_end() {
        let l = |i, n| GradientState::locate(3, i, n);
        assert_eq!(
            l(0, 4),
            MicroStep {
                window: 3,
                sync: false
            }
        );
        assert_eq!(
            l(2, 4),
            MicroStep {
                window: 3,
                sync: true
            }
        );
        assert_eq!(
            l(3, 4),
            MicroStep {
                window: 1,
                sync: true
            }
        );
        assert_eq!(
            GradientState::locate(2, 4, 5),
            MicroStep {
                window: 1,
                sync: true
            }
        );
        assert_eq!(
            GradientState::locate(1, 0, 5),
            MicroStep {
                window: 1,
                sync: true
            }
        );
    }

    #[test]
    fn without_data_every_backward_is_the_next_micro_step() {
        let s = GradientState::new(2);
        assert!(!s.for_backward().sync);
        assert!(s.for_backward().sync);
        assert!(!s.for_backward().sync);
    }

    #[test]
    fn data_reports_drive_the_windows() {
        let s = GradientState::new(3);
        s.on_batch(3, 4, 0);
        assert_eq!(
            s.for_backward(),
            MicroStep {
                window: 1,
                sync: true
            }
        );
        // A second backward on the same batch (a second model) is the same micro-step.
        assert_eq!(
            s.for_backward(),
            MicroStep {
                window: 1,
                sync: true
            }
        );
    }
}
