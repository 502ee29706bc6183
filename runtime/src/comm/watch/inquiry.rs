//! Asking the peers where they are, when a collective waits too long: the timeout's error
//! and the late-wait warning are built from their answers.

use super::{Kind, Watch, INQUIRY};
use crate::comm::ops::{Current, Op, OpKind};
use crate::error::Error;
use std::time::{Duration, Instant};

impl Watch {
    /// Asks the peers where they are and builds the timeout error from their answers.
    pub(super) fn timed_out(&self, current: Option<Current>, waited: Duration) -> Error {
        let what = current.map_or_else(|| "the end of the run".to_string(), |c| c.to_string());
        let msg = format!(
            "{what} timed out on rank {} after {:.1} s; {}. Raise the limit with \
             `collective_timeout` (builder or attribute), `ivme launch --collective_timeout` or \
             IVME_COLLECTIVE_TIMEOUT if a rank legitimately takes this long",
            self.rank,
            waited.as_secs_f64(),
            self.inquire(current, None)
        );
        self.fail(msg)
    }

    /// Says once that `current` waits far longer than collectives recently did, naming the
    /// ranks that have not arrived and what they answer; the deadline still ends the job.
    pub(super) fn warn_late(&self, current: Option<Current>, waited: Duration) {
        let what = current.map_or_else(|| "the end of the run".to_string(), |c| c.to_string());
        // Each in its own statement: the inquiry handles control messages, which borrow the
        // state mutably.
        let recent = self.state.borrow().waits.describe();
        let answers = self.inquire(current, current);
        warn_user!(
            "{what} has waited {:.1} s on rank {}, far longer than collectives recently took \
             ({recent}); {answers}. The job ends at the collective deadline ({:.0} s) unless \
             they arrive",
            waited.as_secs_f64(),
            self.rank,
            self.timeout.as_secs_f64()
        );
    }

    /// Asks the peers where they are; says who has not arrived at `current` and where the
    /// others are. Control messages read meanwhile are handled as if in `waiting`.
    fn inquire(&self, current: Option<Current>, waiting: Option<Current>) -> String {
        let gone: Vec<Option<u64>> = self.state.borrow().left.clone();
        let asked: Vec<usize> = self.peers().filter(|&r| gone[r].is_none()).collect();
        for &r in &asked {
            self.send(r, [Kind::Where as u64, 0, 0, 0]);
        }
        let mut answers: Vec<Option<[u64; 4]>> = vec![None; self.size];
        let start = Instant::now();
        while start.elapsed() < INQUIRY && asked.iter().any(|&r| answers[r].is_none()) {
            while let Some((from, msg)) = self.receive() {
                if msg[0] == Kind::Here as u64 {
                    answers[from] = Some(msg);
                } else {
                    // Another rank's inquiry or goodbye: answer it. `waiting` is the collective
                    // that goes on waiting after a warning (none after a timeout): a goodbye
                    // that means it can never complete is recorded as the job's failure, which
                    // the wait's next poll returns.
                    let _ = self.handle(from, msg, waiting);
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut missing = Vec::new();
        let mut elsewhere = Vec::new();
        for r in self.peers() {
            if let Some(done) = gone[r] {
                elsewhere.push(format!("rank {r} left after {done} collectives"));
                continue;
            }
            match answers[r] {
                None => missing.push(r),
                Some([_, 0, _, done]) => {
                    elsewhere.push(format!(
                        "rank {r} is outside any collective after {done} (computing, or stuck)"
                    ));
                    missing.push(r);
                }
                Some([_, seq, kind, count]) => {
                    let same =
                        current.is_some_and(|c| c.seq + 1 == seq && c.op.kind as u64 == kind);
                    if !same {
                        let op = OpKind::from_code(kind).map(|k| Op {
                            kind: k,
                            count,
                            root: 0,
                            position: 0,
                        });
                        let op = op.map_or_else(|| "an unknown call".into(), |o| o.to_string());
                        elsewhere.push(format!("rank {r} waits in collective #{seq} ({op})"));
                        missing.push(r);
                    }
                }
            }
        }
        let missing = if missing.is_empty() {
            "every rank answered".to_string()
        } else {
            format!(
                "not arrived: {}",
                missing
                    .iter()
                    .map(|r| format!("rank {r}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        let detail = if elsewhere.is_empty() {
            " (no answer: stopped, deadlocked, or busy outside ivme's collectives)".to_string()
        } else {
            format!("; {}", elsewhere.join("; "))
        };
        format!("{missing}{detail}")
    }
}
