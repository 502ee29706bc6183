//! Arrival: before a collective every rank tells every peer which call it is at and waits,
//! with the deadline, for theirs.

use super::Watch;
use crate::comm::ops::{describe, Token};
use crate::error::Result;
use mpi::point_to_point::{Destination, Source};
use mpi::request::Request;
use mpi::topology::Communicator as _;

/// Tag of the arrival tokens (on a communicator of their own).
const TOKEN_TAG: i32 = 78;

/// What a rank sends each peer on arrival: the collective's token, then whether a preemption
/// signal asked this rank to stop (setup/preempt.rs). Every rank reads the same words for the
/// same collective, so the ranks agree on a stop without a collective of its own.
type Arrival = [u64; 6];

fn arrival(token: Token) -> Arrival {
    let [a, b, c, d, e] = token;
    [a, b, c, d, e, u64::from(crate::setup::preempt::requested())]
}

fn token_of(arrival: &Arrival) -> Token {
    [arrival[0], arrival[1], arrival[2], arrival[3], arrival[4]]
}

impl Watch {
    /// Whether a rank asked to stop (a preemption signal), as the arrivals so far showed it:
    /// the same answer on every rank between the same two collectives.
    pub fn stop_seen(&self) -> bool {
        self.state.borrow().stop_seen
    }

    /// Waits (with the deadline, watching the control channel) until every rank arrived at
    /// the current collective, and fails on every rank if they are not at the same one.
    ///
    /// Each rank sends every peer a token saying which collective it is at (sequence number,
    /// kind, size, root, data position) and reads theirs. Once every token arrived and matched,
    /// every rank is inside the same call, so the data moves with MPI's blocking (fastest)
    /// algorithms and cannot wait on a peer that is elsewhere. This is also a barrier.
    pub fn arrive(&self) -> Result<()> {
        let Some(current) = self.state.borrow().current else {
            return Ok(());
        };
        if self.size == 1 {
            return Ok(());
        }
        // Boxed so that a send abandoned by a failure can keep reading it: it is leaked then.
        let mine: Box<Arrival> = Box::new(arrival(current.token()));
        let mut stop = mine[5] != 0;
        let mut got = vec![false; self.size];
        got[self.rank] = true;
        let mut mismatch: Option<(usize, Token)> = None;
        let result = mpi::request::scope(|scope| {
            let mut sends: Vec<Option<Request<'_, [u64], _>>> = self
                .peers()
                .map(|r| {
                    let to = self.tokens.process_at_rank(r as i32);
                    Some(to.immediate_send_with_tag(scope, &mine[..], TOKEN_TAG))
                })
                .collect();
            let result = self.wait_until(|| {
                for slot in sends.iter_mut() {
                    if let Some(req) = slot.take() {
                        if let Err(req) = req.test() {
                            *slot = Some(req);
                        }
                    }
                }
                for (r, seen) in got.iter_mut().enumerate() {
                    if *seen {
                        continue;
                    }
                    let from = self.tokens.process_at_rank(r as i32);
                    if let Some((msg, _)) = from.immediate_matched_probe_with_tag(TOKEN_TAG) {
                        let mut theirs: Arrival = [0; 6];
                        msg.matched_receive_into(&mut theirs[..]);
                        *seen = true;
                        stop |= theirs[5] != 0;
                        if token_of(&theirs) != token_of(&mine) && mismatch.is_none() {
                            mismatch = Some((r, token_of(&theirs)));
                        }
                    }
                }
                mismatch.is_some() || (got.iter().all(|g| *g) && sends.iter().all(Option::is_none))
            });
            for req in sends.into_iter().flatten() {
                // SAFETY: the token stays readable (leaked below) for as long as MPI needs it.
                unsafe {
                    let _ = req.into_raw();
                }
            }
            result
        });
        let abandoned = result.is_err() || mismatch.is_some();
        if abandoned {
            Box::leak(mine);
        }
        result?;
        if stop && mismatch.is_none() {
            self.state.borrow_mut().stop_seen = true;
        }
        if let Some((r, theirs)) = mismatch {
            return Err(self.fail(format!(
                "the collectives do not line up across ranks: rank {} is at {current} but rank \
                 {r} is at {}; every rank must make the same collective calls in the same order \
                 with the same sizes (did a rank run an extra or a missing backward, batch or \
                 wait_for_everyone?); rerun with IVME_DEBUG_SYNC=1 to see every rank",
                self.rank,
                describe(&theirs)
            )));
        }
        Ok(())
    }
}
