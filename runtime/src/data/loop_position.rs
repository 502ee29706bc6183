//! Where the attribute's loops over plain collections stand: the position saved with the
//! training state, and the live cursor the loops move.

use crate::error::{Error, Result};

/// Where the attribute's batch loops over plain collections stand, saved with the training
/// state so a resumed run continues mid-epoch like a `DataLoader` does.
///
/// Each time a sharded loop starts is one *pass* (an epoch, in the usual loop): the cursor
/// counts the passes begun and the batches the current one has handed out. After a load, the
/// passes the checkpoint had finished come back empty (the user's epoch loop runs through them
/// without training) and the one it was in resumes at the next batch.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LoopPosition {
    /// The pass in progress (0 for the first), or the next to begin between passes.
    pub pass: u64,
    /// Batches of that pass already handed out on this rank.
    pub next: usize,
    /// Batches at the start of the pass that a run on another number of processes had
    /// already used; this rank's share splits the rest. Zero except after such a resume.
    #[serde(default)]
    pub skip: usize,
    /// Batches of the pass used by all ranks together, up to this position.
    #[serde(default)]
    pub done: usize,
}

impl LoopPosition {
    /// The position a run on another number of processes resumes from: the same pass, with
    /// the batches this position had used skipped. A mid-pass position written before
    /// positions counted every rank's batches is refused.
    pub fn for_new_world(&self) -> Result<LoopPosition> {
        if self.next > 0 && self.done == 0 {
            return Err(Error::Usage(
                "the saved position of the attribute's batch loop does not say how many \
                 batches all ranks had used (it was written by an older ivme), so it cannot be \
                 moved to another number of processes; resume on the number that saved it"
                    .into(),
            ));
        }
        Ok(LoopPosition {
            pass: self.pass,
            next: 0,
            skip: self.done,
            done: self.done,
        })
    }
}

/// The live cursor behind [`LoopPosition`].
#[derive(Debug, Default)]
pub struct LoopCursor {
    position: LoopPosition,
    begun: u64,
    resume: Option<LoopPosition>,
}

impl LoopCursor {
    /// The position to save.
    pub fn position(&self) -> LoopPosition {
        self.position
    }

    /// Continues from `p` (a loaded checkpoint's position) at the next passes this process
    /// begins.
    pub fn resume_from(&mut self, p: LoopPosition) {
        self.position = p;
        self.resume = Some(p);
    }

    /// Ends the pass in progress: the position moves to the start of the next.
    pub(crate) fn end_pass(&mut self) {
        self.position = LoopPosition {
            pass: self.position.pass + 1,
            ..LoopPosition::default()
        };
    }

    /// Records that this rank has handed out `next` batches of the pass, and all ranks
    /// together `done`.
    pub(crate) fn handed_out(&mut self, next: usize, done: usize) {
        (self.position.next, self.position.done) = (next, done);
    }

    /// Begins a pass: `None` for a pass the loaded checkpoint had finished, else where to
    /// start (`skip` and `next` of the position).
    pub(crate) fn begin(&mut self) -> Option<(usize, usize)> {
        let pass = self.begun;
        self.begun += 1;
        match self.resume {
            Some(r) if pass < r.pass => return None,
            Some(r) if pass == r.pass => {
                self.resume = None;
                self.position = r;
                return Some((r.skip, r.next));
            }
            _ => self.resume = None,
        }
        self.position = LoopPosition {
            pass,
            ..LoopPosition::default()
        };
        Some((0, 0))
    }
}
