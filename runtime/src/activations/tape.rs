//! The thread's record of checkpointed segments: what each segment ran, on what input, what it
//! handed on, and the random draws it made, from its forward until the backward that recomputes
//! it.

use super::UnitWeights;
use crate::rng::{replay, RngState};
use candle_core::{Tensor, Var};
use std::cell::RefCell;
use std::rc::Rc;

/// A segment's forward, kept to be run again in backward.
pub(crate) type Run = Box<dyn Fn(&Tensor) -> candle_core::Result<Tensor>>;

/// One checkpointed segment of a forward pass.
pub(crate) struct Segment {
    /// What the segment was given (with its graph: the gradient flows on through it).
    pub input: Tensor,
    /// A copy of what it computed, as a fresh variable: the rest of the forward starts there,
    /// and backward stops there with the gradient the segment's recompute continues from.
    pub output: Var,
    /// The segment's forward.
    pub run: Run,
    /// The unit whose weights the segment runs with (ZeRO-3 gathers them for each run).
    pub unit: Option<String>,
    /// The state of each generator the forward drew from, in draw order: the recompute draws
    /// the same numbers.
    pub draws: Vec<RngState>,
}

/// What this thread is doing with segments.
#[derive(Default)]
struct Tape {
    /// How many recording Accelerators live on this thread (checkpointing is on while > 0).
    recorders: usize,
    /// Segments recorded since the last backward, in forward order.
    segments: Vec<Segment>,
    /// Whether any segment ran while checkpointing was on.
    ever_ran: bool,
    /// Whether a segment is running (its forward or its recompute).
    inside: bool,
    /// ZeRO-3's hands on the units' weights, while an Accelerator sharding them lives.
    weights: Option<Rc<dyn UnitWeights>>,
}

thread_local! {
    static TAPE: RefCell<Tape> = RefCell::new(Tape::default());
}

/// Keeps checkpointing on for the thread that started it while it lives.
#[derive(Debug)]
pub(crate) struct Recording {
    /// The thread whose tape it switched on (dropped elsewhere, it leaves that tape alone).
    thread: std::thread::ThreadId,
}

impl Recording {
    /// Switches checkpointing on for this thread.
    pub(crate) fn start() -> Recording {
        TAPE.with(|t| t.borrow_mut().recorders += 1);
        Recording {
            thread: std::thread::current().id(),
        }
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        if std::thread::current().id() != self.thread {
            return;
        }
        TAPE.with(|t| {
            let mut t = t.borrow_mut();
            t.recorders -= 1;
            if t.recorders == 0 {
                t.segments.clear();
            }
        });
    }
}

/// Keeps `weights` as the thread's hands on the units' weights while it lives.
pub(crate) struct WeightsInstalled {
    thread: std::thread::ThreadId,
}

impl std::fmt::Debug for WeightsInstalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WeightsInstalled")
    }
}

/// The units whose weights ZeRO-3 frees between their segments, with the thread that gathers
/// them, in the whole process.
static FREED_UNITS: std::sync::Mutex<Vec<(std::thread::ThreadId, String)>> =
    std::sync::Mutex::new(Vec::new());

/// Notes that this thread's ZeRO-3 frees the weights of `unit` between its segments.
pub(crate) fn note_freed_unit(unit: &str) {
    let mut units = FREED_UNITS.lock().unwrap_or_else(|e| e.into_inner());
    units.push((std::thread::current().id(), unit.to_string()));
}

/// Whether another thread's ZeRO-3 frees the weights of `unit` between its segments.
pub(crate) fn freed_elsewhere(unit: &str) -> bool {
    let me = std::thread::current().id();
    let units = FREED_UNITS.lock().unwrap_or_else(|e| e.into_inner());
    units.iter().any(|(t, u)| *t != me && u == unit)
}

impl WeightsInstalled {
    /// Installs `weights` on this thread.
    pub(crate) fn install(weights: Rc<dyn UnitWeights>) -> WeightsInstalled {
        TAPE.with(|t| t.borrow_mut().weights = Some(weights));
        WeightsInstalled {
            thread: std::thread::current().id(),
        }
    }
}

impl Drop for WeightsInstalled {
    fn drop(&mut self) {
        let mut units = FREED_UNITS.lock().unwrap_or_else(|e| e.into_inner());
        units.retain(|(t, _)| *t != self.thread);
        drop(units);
        if std::thread::current().id() == self.thread {
            TAPE.with(|t| t.borrow_mut().weights = None);
        }
    }
}

/// The thread's hands on the units' weights, under ZeRO-3.
pub(crate) fn weights() -> Option<Rc<dyn UnitWeights>> {
    TAPE.with(|t| t.borrow().weights.clone())
}

/// Whether a segment run now would be recorded: checkpointing is on and no segment is running.
pub(crate) fn records() -> bool {
    TAPE.with(|t| {
        let t = t.borrow();
        t.recorders > 0 && !t.inside
    })
}

/// Whether any segment ran on this thread while checkpointing was on.
pub(crate) fn ever_ran() -> bool {
    TAPE.with(|t| t.borrow().ever_ran)
}

/// Runs `f` as a segment's forward, logging the draws it makes; returns its result and the
/// draws.
pub(crate) fn forward<T>(f: impl FnOnce() -> T) -> (T, Vec<RngState>) {
    TAPE.with(|t| t.borrow_mut().ever_ran = true);
    inside(|| replay::recording(f))
}

/// Runs `f` as a segment's recompute, replaying `draws`; returns its result and how many
/// draws it did not replay (a forward that drew more than the recompute does).
pub(crate) fn recompute<T>(draws: Vec<RngState>, f: impl FnOnce() -> T) -> (T, usize) {
    inside(|| replay::replaying(draws, f))
}

/// Runs `f` as a segment: a segment inside it runs as part of it. Leaves the segment also when
/// `f` panics.
fn inside<T>(f: impl FnOnce() -> T) -> T {
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            TAPE.with(|t| {
                if let Ok(mut t) = t.try_borrow_mut() {
                    t.inside = false;
                }
            });
        }
    }
    TAPE.with(|t| t.borrow_mut().inside = true);
    let _leave = Leave;
    f()
}

/// Adds a recorded segment.
pub(crate) fn push(segment: Segment) {
    TAPE.with(|t| {
        t.borrow_mut().segments.push(segment);
    });
}

/// Takes every segment recorded since the last backward, in forward order.
pub(crate) fn take() -> Vec<Segment> {
    TAPE.with(|t| std::mem::take(&mut t.borrow_mut().segments))
}
