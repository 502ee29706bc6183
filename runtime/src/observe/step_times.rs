//! Where a training step's time goes: waiting for data, candle's backward, the end of the
//! accumulation window (gradient collectives, clipping; under ZeRO the slice's optimizer step),
//! the prepared optimizers' step, checkpoint stalls, and the rest (the forward pass and the
//! loop's own code), per rank, and which rank holds the others up.

use crate::observe::profile::trace::Trace;
use crate::observe::profile::SpanKind;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// One rank's time, split by what it was spent on, over `steps` optimizer steps.
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepTimes {
    /// Optimizer steps (ends of accumulation windows) covered.
    pub steps: u64,
    /// Backward calls (micro-batches) covered.
    pub micro_batches: u64,
    /// Seconds from the start (or the last reset) to now.
    pub wall: f64,
    /// Seconds prepared data loaders took to hand out batches.
    pub data: f64,
    /// Seconds in candle's backward and in adding gradients to the window's sums.
    pub backward: f64,
    /// Seconds running checkpointed segments again during backward (activation
    /// checkpointing), not counted in `backward`.
    #[serde(default)]
    pub recompute: f64,
    /// Seconds ending accumulation windows: gradient collectives (including waiting for the
    /// other ranks), unscaling and clipping; under sharding also the slice's optimizer step,
    /// and with `overlap` the optimizer step.
    pub sync: f64,
    /// Seconds in the prepared optimizers' steps (and the 16-bit copies' refresh).
    pub optimizer: f64,
    /// Seconds checkpoint saves held the loop (the copy, for background saves).
    pub checkpoint: f64,
    /// Under `overlap`: the buckets whose part of the optimizer step started while a later
    /// bucket of the same window was still being averaged (the overlap at work).
    #[serde(default)]
    pub overlapped: u64,
}

impl StepTimes {
    /// The seconds not in any measured phase: the forward pass, the loss and the loop's own
    /// code.
    pub fn rest(&self) -> f64 {
        let measured = self.data
            + self.backward
            + self.recompute
            + self.sync
            + self.optimizer
            + self.checkpoint;
        (self.wall - measured).max(0.0)
    }

    /// The phases as (name, seconds), in the order reports list them.
    pub fn phases(&self) -> [(&'static str, f64); 7] {
        [
            ("data", self.data),
            ("forward and the rest", self.rest()),
            ("backward", self.backward),
            ("recompute", self.recompute),
            ("sync", self.sync),
            ("optimizer", self.optimizer),
            ("checkpoint", self.checkpoint),
        ]
    }

    /// A table of every rank's milliseconds per optimizer step, phase by phase, and which
    /// rank the others wait for: the one that waits least in `sync` arrives last.
    pub fn report(ranks: &[StepTimes]) -> String {
        let per_step = |t: &StepTimes, s: f64| 1e3 * s / t.steps.max(1) as f64;
        let mut out = format!(
            "step time, ms per optimizer step ({} steps on rank 0):\n{:<22}",
            ranks.first().map_or(0, |t| t.steps),
            "phase"
        );
        for r in 0..ranks.len() {
            out.push_str(&format!("{:>10}", format!("rank {r}")));
        }
        out.push('\n');
        for (i, (name, _)) in StepTimes::default().phases().iter().enumerate() {
            out.push_str(&format!("{name:<22}"));
            for t in ranks {
                out.push_str(&format!("{:>10.2}", per_step(t, t.phases()[i].1)));
            }
            out.push('\n');
        }
        out.push_str(&format!("{:<22}", "total"));
        for t in ranks {
            out.push_str(&format!("{:>10.2}", per_step(t, t.wall)));
        }
        out.push('\n');
        if ranks.len() > 1 {
            let waits: Vec<f64> = ranks.iter().map(|t| per_step(t, t.sync)).collect();
            let (late, least) = waits
                .iter()
                .enumerate()
                .min_by(|a, b| a.1.total_cmp(b.1))
                .map_or((0, 0.0), |(r, w)| (r, *w));
            let most = waits.iter().copied().fold(0.0, f64::max);
            out.push_str(&format!(
                "rank {late} waits least in sync ({least:.2} ms against up to {most:.2} ms): the \
                 others wait for it; compare its phases with theirs\n"
            ));
        }
        out
    }
}

/// The running totals behind [`StepTimes`], in nanoseconds, shared by the Accelerator, its
/// prepared loaders and optimizers.
#[derive(Debug)]
pub(crate) struct StepClock {
    since: Mutex<Instant>,
    steps: AtomicU64,
    micro: AtomicU64,
    data: AtomicU64,
    backward: AtomicU64,
    recompute: AtomicU64,
    sync: AtomicU64,
    optimizer: AtomicU64,
    checkpoint: AtomicU64,
    overlapped: AtomicU64,
    /// Checkpoint calls in progress (a save calls a wait inside it: only the outermost counts).
    saving: AtomicU64,
    /// The profile's recorder, when profiling: every phase also becomes a span there.
    trace: OnceLock<Arc<Trace>>,
}

/// Times a checkpoint call until dropped ([`StepClock::saving`]).
#[derive(Debug)]
pub(crate) struct Saving<'a> {
    clock: &'a StepClock,
    start: Instant,
}

impl Drop for Saving<'_> {
    fn drop(&mut self) {
        if self.clock.saving.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.clock.since(Phase::Checkpoint, self.start);
        }
    }
}

/// A phase a [`StepClock`] adds time to.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Phase {
    Data,
    Backward,
    Recompute,
    Sync,
    Optimizer,
    Checkpoint,
}

impl Default for StepClock {
    fn default() -> Self {
        StepClock {
            since: Mutex::new(Instant::now()),
            steps: AtomicU64::new(0),
            micro: AtomicU64::new(0),
            data: AtomicU64::new(0),
            backward: AtomicU64::new(0),
            recompute: AtomicU64::new(0),
            sync: AtomicU64::new(0),
            optimizer: AtomicU64::new(0),
            checkpoint: AtomicU64::new(0),
            overlapped: AtomicU64::new(0),
            saving: AtomicU64::new(0),
            trace: OnceLock::new(),
        }
    }
}

impl Phase {
    fn kind(self) -> SpanKind {
        match self {
            Phase::Data => SpanKind::Data,
            Phase::Backward => SpanKind::Backward,
            Phase::Recompute => SpanKind::Recompute,
            Phase::Sync => SpanKind::Sync,
            Phase::Optimizer => SpanKind::Optimizer,
            Phase::Checkpoint => SpanKind::Checkpoint,
        }
    }
}

impl StepClock {
    fn counter(&self, phase: Phase) -> &AtomicU64 {
        match phase {
            Phase::Data => &self.data,
            Phase::Backward => &self.backward,
            Phase::Recompute => &self.recompute,
            Phase::Sync => &self.sync,
            Phase::Optimizer => &self.optimizer,
            Phase::Checkpoint => &self.checkpoint,
        }
    }

    /// Adds `took`, which ended now, to `phase`.
    pub(crate) fn add(&self, phase: Phase, took: Duration) {
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.counter(phase).fetch_add(nanos, Ordering::Relaxed);
        if let Some(trace) = self.trace.get() {
            let now = Instant::now();
            trace.record(phase.kind(), now.checked_sub(took).unwrap_or(now), now);
        }
    }

    /// Adds the time since `start` to `phase`.
    pub(crate) fn since(&self, phase: Phase, start: Instant) {
        self.since_less(phase, start, Duration::ZERO);
    }

    /// Adds the time since `start`, less `inside` (what a phase within it counted), to
    /// `phase`; its span is the whole stretch.
    pub(crate) fn since_less(&self, phase: Phase, start: Instant, inside: Duration) {
        let now = Instant::now();
        let took = now.saturating_duration_since(start).saturating_sub(inside);
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.counter(phase).fetch_add(nanos, Ordering::Relaxed);
        if let Some(trace) = self.trace.get() {
            trace.record(phase.kind(), start, now);
        }
    }

    /// Adds the stretch from `start` to `end` to `phase`.
    pub(crate) fn between(&self, phase: Phase, start: Instant, end: Instant) {
        let nanos = u64::try_from(end.saturating_duration_since(start).as_nanos());
        self.counter(phase)
            .fetch_add(nanos.unwrap_or(u64::MAX), Ordering::Relaxed);
        if let Some(trace) = self.trace.get() {
            trace.record(phase.kind(), start, end);
        }
    }

    /// Records every phase from now on as a span of `trace` too.
    pub(crate) fn record_into(&self, trace: Arc<Trace>) {
        let _ = self.trace.set(trace);
    }

    /// Times a checkpoint call until the guard is dropped; calls inside it add nothing more.
    pub(crate) fn saving(&self) -> Saving<'_> {
        self.saving.fetch_add(1, Ordering::Relaxed);
        Saving {
            clock: self,
            start: Instant::now(),
        }
    }

    /// Counts `parts` optimizer parts stepped while a later bucket was still moving.
    pub(crate) fn overlapped(&self, parts: u64) {
        self.overlapped.fetch_add(parts, Ordering::Relaxed);
    }

    /// Counts a backward call, and an optimizer step when it ended a window.
    pub(crate) fn count(&self, window_ended: bool) {
        self.micro.fetch_add(1, Ordering::Relaxed);
        if window_ended {
            self.steps.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The totals so far.
    pub(crate) fn read(&self) -> StepTimes {
        let secs = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64 * 1e-9;
        let wall = self.since.lock().map_or(0.0, |s| s.elapsed().as_secs_f64());
        StepTimes {
            steps: self.steps.load(Ordering::Relaxed),
            micro_batches: self.micro.load(Ordering::Relaxed),
            wall,
            data: secs(&self.data),
            backward: secs(&self.backward),
            recompute: secs(&self.recompute),
            sync: secs(&self.sync),
            optimizer: secs(&self.optimizer),
            checkpoint: secs(&self.checkpoint),
            overlapped: self.overlapped.load(Ordering::Relaxed),
        }
    }

    /// Starts the totals again from zero, now.
    pub(crate) fn reset(&self) {
        for c in [
            &self.steps,
            &self.micro,
            &self.data,
            &self.backward,
            &self.recompute,
            &self.sync,
            &self.optimizer,
            &self.checkpoint,
            &self.overlapped,
        ] {
            c.store(0, Ordering::Relaxed);
        }
        if let Ok(mut s) = self.since.lock() {
            *s = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rest_is_what_no_phase_took_and_the_report_names_the_late_rank() {
        let t = StepTimes {
            steps: 2,
            micro_batches: 4,
            wall: 1.0,
            data: 0.1,
            backward: 0.2,
            recompute: 0.0,
            sync: 0.3,
            optimizer: 0.1,
            checkpoint: 0.0,
            overlapped: 0,
        };
        assert!((t.rest() - 0.3).abs() < 1e-12);
        let late = StepTimes { sync: 0.01, ..t };
        let text = StepTimes::report(&[t, late]);
        assert!(text.contains("rank 1 waits least in sync"), "{text}");
        assert!(text.contains("150.00"), "sync of rank 0 per step: {text}");
        let clock = StepClock::default();
        clock.add(Phase::Data, Duration::from_millis(3));
        clock.count(false);
        clock.count(true);
        let read = clock.read();
        assert_eq!((read.steps, read.micro_batches), (1, 2));
        assert!((read.data - 0.003).abs() < 1e-9);
        clock.reset();
        assert_eq!(clock.read().steps, 0);
    }
}
