//! Draws replayed: while a checkpointed segment's forward runs ([`crate::activations`]), every
//! draw from an [`Rng`](super::Rng) logs the generator's state; while the segment runs again in
//! `backward`, each draw takes the next logged state instead, so the recompute draws the numbers
//! the forward drew and no generator advances twice.

use super::RngState;
use std::cell::RefCell;
use std::collections::VecDeque;

/// What this thread's draws do now.
enum Log {
    /// A segment's forward: each draw logs its generator's state.
    Record(Vec<RngState>),
    /// Its recompute: each draw takes the next logged state.
    Replay(VecDeque<RngState>),
}

thread_local! {
    static LOG: RefCell<Option<Log>> = const { RefCell::new(None) };
}

/// Runs `f`, logging the state of every generator it draws from; returns its result and the
/// states, in draw order.
pub(crate) fn recording<T>(f: impl FnOnce() -> T) -> (T, Vec<RngState>) {
    let out = scoped(Log::Record(Vec::new()), f);
    match out {
        (out, Some(Log::Record(states))) => (out, states),
        (out, _) => (out, Vec::new()),
    }
}

/// Runs `f`, its draws replaying `states` in order; returns its result and how many states it
/// left unused.
pub(crate) fn replaying<T>(states: Vec<RngState>, f: impl FnOnce() -> T) -> (T, usize) {
    match scoped(Log::Replay(states.into()), f) {
        (out, Some(Log::Replay(left))) => (out, left.len()),
        (out, _) => (out, 0),
    }
}

/// Runs `f` with `log` in place, then takes it back (also when `f` panics).
fn scoped<T>(log: Log, f: impl FnOnce() -> T) -> (T, Option<Log>) {
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            if std::thread::panicking() {
                LOG.with(|l| l.borrow_mut().take());
            }
        }
    }
    LOG.with(|l| *l.borrow_mut() = Some(log));
    let guard = Restore;
    let out = f();
    drop(guard);
    (out, LOG.with(|l| l.borrow_mut().take()))
}

/// How a generator at `state` draws now: `None` from itself (outside segments, and in a
/// segment's forward, where the state is logged), or the state a recompute replays. `Err`
/// when a recompute draws more often than its forward did.
pub(super) fn draw_from(state: RngState) -> Result<Option<RngState>, ()> {
    LOG.with(|l| match &mut *l.borrow_mut() {
        None => Ok(None),
        Some(Log::Record(states)) => {
            states.push(state);
            Ok(None)
        }
        Some(Log::Replay(states)) => states.pop_front().map(Some).ok_or(()),
    })
}
