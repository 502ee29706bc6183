//! The watchdog over a collective's data transfer.
//!
//! The arrival exchange before a collective has a deadline, but once every rank arrived the data
//! moves with MPI's blocking calls, which have none: a peer stopped (SIGSTOP, swapped out, its
//! machine frozen) after its arrival leaves the others inside MPI forever. A thread per rank
//! knows which transfer the rank is in and since when; past the collective deadline it prints
//! which collective stalled and ends the process, and the launcher ends the job as it does for
//! any failed rank.
//!
//! `IVME_STOP_IN_TRANSFER=R:K` (for tests) makes rank R stop itself (SIGSTOP) inside the data
//! transfer of its K-th collective, after every rank arrived.

use super::super::ops::Current;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The transfer a rank is in, shared with its watchdog.
#[derive(Default)]
struct Shared {
    /// The collective whose data is moving, and since when.
    transfer: Mutex<Option<(Current, Instant)>>,
    /// Set when the communicator is dropped: the thread exits.
    done: AtomicBool,
}

/// The watchdog of one rank (see the module docs).
pub(crate) struct Dog {
    shared: Arc<Shared>,
    /// `IVME_STOP_IN_TRANSFER`'s collective number for this rank.
    stop_at: Option<u64>,
}

/// Marks a transfer in progress; dropping it marks the end.
pub(crate) struct Transfer<'a>(&'a Shared);

impl Drop for Transfer<'_> {
    fn drop(&mut self) {
        *self.0.transfer.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

impl Dog {
    /// Starts the watchdog of `rank` with the collective deadline `timeout`.
    pub(crate) fn spawn(rank: usize, size: usize, timeout: Duration) -> Dog {
        let shared = Arc::new(Shared::default());
        let stop_at = std::env::var("IVME_STOP_IN_TRANSFER").ok().and_then(|v| {
            let (r, k) = v.split_once(':')?;
            (r.trim().parse::<usize>().ok()? == rank).then(|| k.trim().parse::<u64>().ok())?
        });
        if size > 1 {
            let watched = shared.clone();
            // Checks a few times per deadline, at most every 100 ms, at least every 10 ms.
            let every = (timeout / 20).clamp(Duration::from_millis(10), Duration::from_millis(100));
            let spawned = std::thread::Builder::new()
                .name("ivme-watchdog".into())
                .spawn(move || watch(&watched, rank, timeout, every));
            if let Err(e) = spawned {
                warn_user!("rank {rank}: could not start the collective watchdog ({e})");
            }
        }
        Dog { shared, stop_at }
    }

    /// Marks the start of `current`'s data transfer, once every rank arrived.
    pub(crate) fn transfer(&self, current: Current) -> Transfer<'_> {
        *self
            .shared
            .transfer
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some((current, Instant::now()));
        if self.stop_at == Some(current.seq + 1) {
            // SAFETY: raising a signal on this process; SIGSTOP cannot be caught.
            unsafe {
                libc::raise(libc::SIGSTOP);
            }
        }
        Transfer(&self.shared)
    }
}

impl Drop for Dog {
    fn drop(&mut self) {
        self.shared.done.store(true, Ordering::Relaxed);
    }
}

/// The watchdog thread: ends the process once one transfer outlasts `timeout`.
fn watch(shared: &Shared, rank: usize, timeout: Duration, every: Duration) {
    while !shared.done.load(Ordering::Relaxed) {
        std::thread::sleep(every);
        let stalled = shared
            .transfer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .filter(|(_, since)| since.elapsed() >= timeout);
        let Some((current, since)) = stalled else {
            continue;
        };
        eprintln!(
            "ivme: error: {current} stalled on rank {rank}: every rank had arrived, then its \
             data moved no further for {:.1} s (a peer stopped answering during the transfer: \
             stopped, swapped out, or its machine or network is gone); ending rank {rank}. \
             Raise the limit with `collective_timeout` (builder or attribute), `ivme launch \
             --collective_timeout` or IVME_COLLECTIVE_TIMEOUT if a transfer legitimately \
             takes this long",
            since.elapsed().as_secs_f64()
        );
        // The main thread is blocked inside MPI: leave without running exit handlers (MPI's
        // own could wait on the stalled transfer). The launcher ends the other ranks.
        // SAFETY: ends this process at once; nothing runs after it.
        unsafe { libc::_exit(1) }
    }
}
