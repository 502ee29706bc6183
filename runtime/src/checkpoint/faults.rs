//! Crash injection for testing the save protocol (debug builds only).
//!
//! Every durable step of a save (each file written and fsynced, each folder synced, the
//! manifest, each rename and removal) calls [`crash_point`]. In a debug build, setting
//! `IVME_CRASH_AT=K` kills the process with `SIGKILL` at the `K`-th step it reaches (counted
//! from process start, across every save and recovery), after printing
//! `ivme: injected crash at step K: <step>` on stderr. `IVME_CRASH_TRACE=1` prints every step
//! as it is reached instead. Release builds compile the hook to nothing.

/// Marks one step of the save protocol; kills the process here when `IVME_CRASH_AT` says so.
#[doc(hidden)]
pub fn crash_point(step: &str) {
    #[cfg(debug_assertions)]
    imp::reached(step);
    #[cfg(not(debug_assertions))]
    let _ = step;
}

#[cfg(debug_assertions)]
mod imp {
    use std::io::Write;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;

    struct Plan {
        at: Option<u64>,
        trace: bool,
    }

    static PLAN: OnceLock<Plan> = OnceLock::new();
    static REACHED: AtomicU64 = AtomicU64::new(0);

    pub(super) fn reached(step: &str) {
        let plan = PLAN.get_or_init(|| Plan {
            at: std::env::var("IVME_CRASH_AT")
                .ok()
                .and_then(|v| v.trim().parse().ok()),
            trace: std::env::var_os("IVME_CRASH_TRACE").is_some_and(|v| v == "1"),
        });
        if plan.at.is_none() && !plan.trace {
            return;
        }
        let n = REACHED.fetch_add(1, Ordering::SeqCst) + 1;
        let mut err = std::io::stderr().lock();
        if plan.trace {
            let _ = writeln!(err, "ivme: crash point {n}: {step}");
        }
        if plan.at == Some(n) {
            let _ = writeln!(err, "ivme: injected crash at step {n}: {step}");
            let _ = err.flush();
            // SAFETY: sending a signal to our own process has no memory-safety preconditions.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    }
}
