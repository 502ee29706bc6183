//! The watch over an MPI job's collectives: arrival with a deadline, a control channel between
//! ranks, and the goodbye that lets a job end without a rank finalizing into a hang.
//!
//! Before every collective each rank sends its peers a token naming the call it is at and
//! waits here for theirs. While it waits, a rank also reads a second communicator (the control
//! channel) on which ranks tell each other that they left the run (their Accelerator was
//! dropped), that they failed, or ask where the others are when a deadline passes. So a
//! collective that can never complete (a peer returned an error, panicked, skipped a call, or
//! is at another call) ends with an error on every rank in milliseconds, and one that a stopped
//! or stuck peer holds up ends at its deadline, naming the peers that did not come. Once every
//! rank arrived, a watchdog thread holds the data transfer to the same deadline (dog.rs).

use super::ops::{Current, Op};

mod arrival;
mod dog;
mod inquiry;
mod late;
use crate::error::{Error, Result};
use dog::{Dog, Transfer};
use mpi::ffi;
use mpi::point_to_point::{Destination, Source};
use mpi::request::{Request, Scope, StaticScope};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use std::cell::RefCell;
use std::time::{Duration, Instant};

/// Tag of every control message (the control channel is a communicator of its own).
const TAG: i32 = 77;

use crate::setup::status::STATUS_DIR_VAR;

/// How long a rank that stopped for a failed peer waits for that peer to exit first.
const LINGER: Duration = Duration::from_secs(3);

/// How long a timed-out rank waits for its peers to say where they are.
const INQUIRY: Duration = Duration::from_secs(2);

/// How long a rank busy-polls a collective before it starts sleeping between polls.
const SPIN: Duration = Duration::from_millis(2);

/// How many times a collective is tested before the control channel is read.
const FAST_POLLS: usize = 64;

/// The longest sleep between two polls: bounds the latency a sleeping wait adds.
const MAX_NAP: Duration = Duration::from_millis(1);

/// What kind of control message a rank sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
enum Kind {
    /// "I left the run after completing `seq` collectives."
    Leave = 1,
    /// "I failed: every collective of this job is over."
    Abort = 2,
    /// "Where are you?" sent by a rank whose deadline passed.
    Where = 3,
    /// The answer to `Where`: the collective this rank is in (or 0 when between collectives).
    Here = 4,
}

impl Kind {
    fn from_code(code: u64) -> Option<Kind> {
        Some(match code {
            1 => Kind::Leave,
            2 => Kind::Abort,
            3 => Kind::Where,
            4 => Kind::Here,
            _ => return None,
        })
    }
}

#[derive(Debug, Default)]
struct State {
    /// Collectives this rank has completed.
    done: u64,
    /// How long recent arrivals waited (late.rs).
    waits: late::Waits,
    /// The collective this rank is waiting in.
    current: Option<Current>,
    /// For each rank that left the run: how many collectives it had completed.
    left: Vec<Option<u64>>,
    /// Set once this job cannot communicate any more; every later collective fails with it.
    failed: Option<String>,
    /// Whether this rank already told the others that it failed.
    abort_sent: bool,
    /// The peer whose failure (or early goodbye) ended this rank's run, if one did.
    cause: Option<usize>,
    /// Whether an arrival so far carried a rank's request to stop (a preemption signal).
    stop_seen: bool,
}

/// Deadlines, the control channel and the end-of-run protocol of one MPI job.
pub(crate) struct Watch {
    ctrl: SimpleCommunicator,
    // Every rank sends each peer one token per collective, in order, on this channel.
    tokens: SimpleCommunicator,
    rank: usize,
    size: usize,
    /// How long one collective may take before the job fails.
    pub timeout: Duration,
    /// Whether every collective is first compared across ranks.
    pub debug_sync: bool,
    state: RefCell<State>,
    /// Ends this rank when a data transfer outlasts the deadline (dog.rs).
    dog: Dog,
}

/// What the end-of-run protocol concluded.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Ending {
    /// Every rank left cleanly: MPI may be finalized.
    Clean,
    /// Something failed: finalizing could wait forever for a peer stuck in a collective.
    Failed,
}

impl Watch {
    /// Watches the job of `world` through a control channel duplicated from it.
    pub fn new(world: &SimpleCommunicator, timeout: Duration, debug_sync: bool) -> Watch {
        let size = world.size() as usize;
        Watch {
            ctrl: world.duplicate(),
            tokens: world.duplicate(),
            rank: world.rank() as usize,
            size,
            timeout,
            debug_sync,
            state: RefCell::new(State {
                left: vec![None; size],
                ..State::default()
            }),
            dog: Dog::spawn(world.rank() as usize, size, timeout),
        }
    }

    /// Marks the data transfer of the current collective (every rank arrived) for the
    /// watchdog, until the returned guard is dropped.
    pub fn transfer(&self) -> Option<Transfer<'_>> {
        let current = self.state.borrow().current?;
        Some(self.dog.transfer(current))
    }

    /// Marks the start of a collective: fails at once if the job already failed.
    pub fn enter(&self, op: Op) -> Result<u64> {
        self.poll(None)?;
        let mut s = self.state.borrow_mut();
        if let Some(msg) = &s.failed {
            return Err(Error::Comm(msg.clone()));
        }
        let seq = s.done;
        let gone = (0..self.size).find(|&r| s.left[r].is_some_and(|c| c <= seq));
        if let Some(r) = gone {
            let completed = s.left[r].unwrap_or(0);
            s.cause.get_or_insert(r);
            drop(s);
            let c = Current { seq, op };
            return Err(self.fail(format!(
                "rank {r} left the run after {completed} collectives, so rank {} cannot start \
                 {c}; every rank must make the same collective calls in the same order",
                self.rank
            )));
        }
        s.current = Some(Current { seq, op });
        Ok(seq)
    }

    /// Marks the end of the current collective.
    pub fn leave_op(&self) {
        let mut s = self.state.borrow_mut();
        s.current = None;
        s.done += 1;
    }

    /// Records a failure found outside the watch (a desync check), tells the peers and returns
    /// the error.
    pub fn fail(&self, msg: String) -> Error {
        self.mark_failed(msg.clone());
        Error::Comm(msg)
    }

    /// Waits for `req` to complete, polling the control channel, until the deadline.
    ///
    /// On an error the request is left to MPI: the caller must leak the buffers it uses
    /// (`std::mem::forget`), since MPI may still write into them.
    pub fn wait<'a, D: ?Sized, S: Scope<'a>>(&self, req: Request<'a, D, S>) -> Result<()> {
        let mut slot = Some(req);
        let result = self.wait_until(|| match slot.take() {
            Some(r) => match r.test() {
                Ok(_) => true,
                Err(r) => {
                    slot = Some(r);
                    false
                }
            },
            None => true,
        });
        if let Some(r) = slot {
            // SAFETY: the request stays active inside MPI; the caller leaks its buffers so they
            // outlive it, and this job makes no further MPI calls that could complete it.
            unsafe {
                let _ = r.into_raw();
            }
        }
        result
    }

    fn wait_until(&self, mut done: impl FnMut() -> bool) -> Result<()> {
        // Most collectives complete within a few polls: test them alone first, and only then
        // start reading the control channel and the clock.
        for _ in 0..FAST_POLLS {
            if done() {
                self.state.borrow_mut().waits.record(Duration::ZERO);
                return Ok(());
            }
        }
        let start = Instant::now();
        let mut nap = Duration::from_micros(20);
        // Decided once the wait passed the 5 s floor (late.rs), so short waits pay nothing.
        let mut late: Option<Option<Duration>> = None;
        let mut warned = false;
        loop {
            if done() {
                self.state.borrow_mut().waits.record(start.elapsed());
                return Ok(());
            }
            let current = self.state.borrow().current;
            self.poll(current)?;
            let waited = start.elapsed();
            if waited >= self.timeout {
                return Err(self.timed_out(current, waited));
            }
            if !warned && waited >= late::FLOOR {
                let late = *late.get_or_insert_with(|| self.state.borrow().waits.late());
                if late.is_some_and(|l| waited >= l) {
                    warned = true;
                    self.warn_late(current, waited);
                }
            }
            if waited < SPIN {
                std::thread::yield_now();
            } else {
                // Progress only happens inside MPI calls, so the nap stays short; it keeps a
                // long wait (a peer saving a checkpoint) from burning a core.
                std::thread::sleep(nap);
                nap = (nap * 2).min(MAX_NAP);
            }
        }
    }

    /// Reads every pending control message; fails if one means `current` can never complete.
    fn poll(&self, current: Option<Current>) -> Result<()> {
        while let Some((from, msg)) = self.receive() {
            self.handle(from, msg, current)?;
        }
        match (&self.state.borrow().failed, current) {
            (Some(msg), Some(_)) => Err(Error::Comm(msg.clone())),
            _ => Ok(()),
        }
    }

    fn handle(&self, from: usize, msg: [u64; 4], current: Option<Current>) -> Result<()> {
        match Kind::from_code(msg[0]) {
            Some(Kind::Leave) => {
                let completed = msg[1];
                self.state.borrow_mut().left[from] = Some(completed);
                if let Some(c) = current.filter(|c| completed <= c.seq) {
                    self.state.borrow_mut().cause.get_or_insert(from);
                    let m = format!(
                        "rank {from} left the run after {completed} collectives (its program \
                         ended, returned an error, or skipped a call) while rank {} waits in {c}; \
                         every rank must make the same collective calls in the same order",
                        self.rank
                    );
                    return Err(self.fail(m));
                }
            }
            Some(Kind::Abort) => {
                let mut s = self.state.borrow_mut();
                s.left[from] = Some(msg[1]);
                // The rank whose failure started it all: the sender, or the peer it names.
                let culprit = msg[2].checked_sub(1).map_or(from, |c| c as usize);
                if culprit != self.rank {
                    s.cause.get_or_insert(culprit);
                }
                if s.failed.is_none() {
                    let at =
                        current.map_or_else(String::new, |c| format!(" while it waits in {c}"));
                    s.failed = Some(format!(
                        "rank {from} failed (its error is reported by that rank), so rank {} \
                         stops{at}",
                        self.rank
                    ));
                    // The peer that failed told everyone; no need to repeat it.
                    s.abort_sent = true;
                }
            }
            Some(Kind::Where) => {
                let (seq, kind, count) = match self.state.borrow().current {
                    Some(c) => (c.seq + 1, c.op.kind as u64, c.op.count),
                    None => (0, 0, self.state.borrow().done),
                };
                self.send(from, [Kind::Here as u64, seq, kind, count]);
            }
            // An answer that came after its inquiry ended.
            Some(Kind::Here) | None => {}
        }
        Ok(())
    }

    /// The next control message, if one has arrived.
    fn receive(&self) -> Option<(usize, [u64; 4])> {
        let (msg, status) = self
            .ctrl
            .any_process()
            .immediate_matched_probe_with_tag(TAG)?;
        let mut buf = [0u64; 4];
        msg.matched_receive_into(&mut buf[..]);
        Some((status.source_rank() as usize, buf))
    }

    /// Sends a control message without waiting for the peer (which may be stopped).
    fn send(&self, to: usize, msg: [u64; 4]) {
        // The buffer must outlive a send nobody waits for: a few bytes per message, and
        // control messages are rare (the end of the run, a failure).
        let buf: &'static [u64; 4] = Box::leak(Box::new(msg));
        let req = self
            .ctrl
            .process_at_rank(to as i32)
            .immediate_send_with_tag(StaticScope, &buf[..], TAG);
        // SAFETY: a freed send request still completes inside MPI; its buffer is 'static.
        unsafe {
            let (mut raw, _, _) = req.into_raw();
            ffi::MPI_Request_free(&mut raw);
        }
    }

    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.size).filter(move |&r| r != self.rank)
    }

    fn mark_failed(&self, msg: String) {
        let send_abort = {
            let mut s = self.state.borrow_mut();
            if s.failed.is_none() {
                s.failed = Some(msg);
            }
            !std::mem::replace(&mut s.abort_sent, true)
        };
        if send_abort {
            self.abort_peers();
        }
    }

    fn abort_peers(&self) {
        // Ranks that said goodbye are told too: they wait for everyone's goodbye at the end.
        // The message names the rank that started the failure (this one, unless it stopped
        // for a peer), so that rank knows it is the one to blame.
        let (done, culprit) = {
            let s = self.state.borrow();
            (s.done, s.cause.unwrap_or(self.rank))
        };
        for r in self.peers() {
            self.send(r, [Kind::Abort as u64, done, culprit as u64 + 1, 0]);
        }
    }

    /// Ends a failed run. A rank that stopped only because a peer failed gives that peer a
    /// moment to print its error and exit first (then the launcher ends this rank, and the
    /// peer's message is the one the user reads).
    fn failed_end(&self) -> Ending {
        self.record_cause();
        if self.state.borrow().cause.is_some() {
            std::thread::sleep(LINGER);
        }
        Ending::Failed
    }

    /// Tells the launcher (through the status folder its rank wrapper names) that this rank
    /// failed only because a peer did, so the summary names the peer as the one that failed.
    fn record_cause(&self) {
        let Some(peer) = self.state.borrow().cause else {
            return;
        };
        if let Some(dir) = std::env::var_os(STATUS_DIR_VAR).filter(|d| !d.is_empty()) {
            let file = std::path::Path::new(&dir).join(format!("cause-{}", self.rank));
            let _ = std::fs::write(file, format!("{peer}\n"));
        }
    }

    /// Ends this rank's part of the run: says goodbye and, unless something failed, waits for
    /// every peer's goodbye so that finalizing MPI cannot block on a peer still in a collective.
    pub fn finish(&self, panicking: bool) -> Ending {
        if panicking {
            self.mark_failed(format!("rank {} panicked", self.rank));
        }
        if self.state.borrow().failed.is_some() {
            return self.failed_end();
        }
        let done = self.state.borrow().done;
        for r in self.peers() {
            self.send(r, [Kind::Leave as u64, done, 0, 0]);
        }
        let start = Instant::now();
        loop {
            while let Some((from, msg)) = self.receive() {
                let _ = self.handle(from, msg, None);
            }
            let s = self.state.borrow();
            if s.failed.is_some() {
                drop(s);
                return self.failed_end();
            }
            let waiting: Vec<usize> = self.peers().filter(|&r| s.left[r].is_none()).collect();
            if waiting.is_empty() {
                return Ending::Clean;
            }
            if start.elapsed() >= self.timeout {
                warn_user!(
                    "rank {} waited {:.0} s at the end of the run for rank(s) {waiting:?} \
                     to finish; leaving without them",
                    self.rank,
                    self.timeout.as_secs_f64()
                );
                return Ending::Failed;
            }
            drop(s);
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
