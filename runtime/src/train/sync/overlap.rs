//! The overlapped end of a window (`overlap = true`): the optimizer steps each bucket's part
//! of the gradient while the next buckets are still being averaged.
//!
//! A thread of the sync's own moves the buckets (pack, all-reduce, unpack: `bucket.rs`'s
//! loop, unchanged) and hands over what each bucket brought as it finishes: runs of variables'
//! means, and the variables now complete. The calling thread opens the optimizer's step once
//! and meanwhile updates each run where the optimizer can update runs (`optim/parts.rs`), a
//! whole variable once complete otherwise, so the optimizer's time hides behind the transfers
//! that follow. The numbers are the unoverlapped step's bit for bit: each element's update
//! reads only its own mean and state. The communicator is lent to the sync thread only when
//! its backend allows calls from another thread one at a time
//! (`Communicator::lends_to_threads`), and the calling thread makes no call on it until it has
//! joined that thread.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use super::WindowEnd;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::optim::parts::{Part, PartStepper};
use crate::train::bucket::{Finish, Landed, Work};
use crate::train::params::ParamSet;

/// What overlap cannot do well on this machine, as warnings: MPI did not grant a second
/// thread its calls, or the `local_world` processes here leave no core beside their compute
/// threads for the sync thread.
pub(crate) fn warnings(world: usize, local_world: usize, comm: &dyn Communicator) -> Vec<String> {
    let mut out = Vec::new();
    if world < 2 {
        return out;
    }
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let threads = rayon::current_num_threads();
    if local_world * (threads + 1) > cores {
        out.push(format!(
            "overlap = true with no core to spare: {local_world} process(es) here, each \
             computing on {threads} thread(s), leave none of the {cores} cores for the sync \
             thread, which then slows the step instead of hiding the optimizer (up to 33 % \
             slower on one core per process, docs/performance.md); run fewer processes per \
             machine, give each fewer compute threads (RAYON_NUM_THREADS), or turn overlap off"
        ));
    }
    if !comm.lends_to_threads() {
        out.push(format!(
            "overlap = true: {} cannot be called from a second thread here (MPI did not grant \
             MPI_THREAD_SERIALIZED, or another backend), so the optimizer steps inside \
             `backward` after the sync instead of during it",
            comm.name()
        ));
    }
    out
}

/// The communicator, lent to the sync thread for the length of one window's end.
struct Lent<'a>(&'a dyn Communicator);

// SAFETY: the communicator is used by one thread at a time: the sync thread while it runs,
// and the lending thread only after the scope joined it (spawning and joining order the two).
// `lends_to_threads` said its backend accepts calls from any thread under that rule (MPI with
// MPI_THREAD_SERIALIZED), and its Rust-side state (cells, counters) is touched by one thread
// at a time under the same ordering.
unsafe impl Send for Lent<'_> {}

impl ParamSet {
    /// Whether this window can end overlapped: several processes, a backend that lends itself
    /// to a thread, gradients the persistent buffers take, and more than one bucket.
    pub(in crate::train) fn can_overlap(
        &mut self,
        comm: &dyn Communicator,
        bucket_bytes: usize,
    ) -> bool {
        if comm.world_size() < 2 || !comm.lends_to_threads() || !self.buffers.fits(&self.sums) {
            return false;
        }
        let synced = self.synced_dropping_others();
        self.buffers.lay_out(&self.master, &synced, bucket_bytes) > 1
    }

    /// Ends the window overlapped (call after [`can_overlap`](Self::can_overlap) said yes):
    /// averages the sums bucket by bucket on a thread of its own while the model's optimizer
    /// updates what each bucket brought; moves the means into `store` keyed by master
    /// variable. Returns how many buckets' parts were stepped while a later bucket was still
    /// being averaged.
    pub(in crate::train) fn end_overlapped(
        &mut self,
        end: &WindowEnd,
        store: &mut GradStore,
    ) -> Result<u64> {
        let mut step = self.overlap.take().expect("a model prepared for overlap");
        let hidden = self.step_while_syncing(end, &mut step, store);
        self.overlap = Some(step);
        hidden
    }

    /// [`end_overlapped`](Self::end_overlapped)'s work, with the model's optimizer `step`.
    fn step_while_syncing(
        &mut self,
        end: &WindowEnd,
        step: &mut PartStepper,
        store: &mut GradStore,
    ) -> Result<u64> {
        let (comm, position) = (end.comm, end.position);
        let world = comm.world_size();
        let synced = self.synced_dropping_others();
        let buckets = self
            .buffers
            .lay_out(&self.master, &synced, end.settings.bucket_bytes());
        let finish = Finish {
            inv_world: 1.0 / world as f32,
            inv_scale: None,
        };
        step.step(Part::Open)?;
        let lent = Lent(comm);
        let moved = AtomicUsize::new(0);
        let (buffers, sums, master) = (&mut self.buffers, &mut self.sums, &self.master);
        // How far each variable's step got: none, some runs (and every run so far), or whole.
        let mut state = vec![Stepped::Not; master.len()];
        let mut hidden = 0u64;
        std::thread::scope(|s| {
            let (tx, rx) = mpsc::channel::<Vec<Arrived>>();
            let moved = &moved;
            let mover = std::thread::Builder::new()
                .name("ivme-sync".into())
                .spawn_scoped(s, move || {
                    let lent = lent;
                    let work = Work {
                        sums,
                        master,
                        position,
                        finish,
                        check_overflow: false,
                    };
                    let mut bucket = Vec::new();
                    buffers.run(lent.0, work, |l| match l {
                        Landed::Span { at, from, len, sum } => {
                            bucket.push(Arrived::Run(at, from, len, sum.clone()))
                        }
                        Landed::Whole(i, t) => bucket.push(Arrived::Whole(i, t)),
                        Landed::BucketEnd => {
                            moved.fetch_add(1, Ordering::AcqRel);
                            // The receiver stays until every bucket is in; a failed step
                            // still lets the transfers finish, so the ranks stay in step.
                            let _ = tx.send(std::mem::take(&mut bucket));
                        }
                    })
                })
                .map_err(|e| Error::Setup(format!("could not start the sync thread: {e}")))?;
            let mut failed = None;
            for bucket in rx {
                if failed.is_none() && moved.load(Ordering::Acquire) < buckets {
                    hidden += 1;
                }
                for arrived in bucket {
                    if let Arrived::Whole(i, t) = &arrived {
                        store.insert(master[*i].as_tensor(), t.clone());
                    }
                    if failed.is_none() {
                        failed = step_arrived(step, master, &mut state, arrived).err();
                    }
                }
            }
            let moved = mover
                .join()
                .map_err(|_| Error::Comm("the gradient sync thread panicked".into()))?;
            moved?;
            failed.map_or(Ok(()), Err)
        })?;
        Ok(hidden)
    }
}

/// What the sync thread hands over: a run of a variable's mean in place in its sum (the sum
/// itself, shared), or a variable's complete mean.
enum Arrived {
    Run(usize, usize, usize, Tensor),
    Whole(usize, Tensor),
}

/// How far a variable's step got in this window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stepped {
    Not,
    Runs,
    Whole,
}

/// Steps what arrived: a run as it lands where the optimizer can update runs (then the
/// complete variable only has its copy refreshed), the whole variable otherwise.
fn step_arrived(
    step: &mut PartStepper,
    master: &[Var],
    state: &mut [Stepped],
    arrived: Arrived,
) -> Result<()> {
    match arrived {
        Arrived::Run(i, from, len, sum) => {
            // A variable whose first run the optimizer declined waits to be stepped whole.
            if state[i] == Stepped::Not && from != 0 {
                return Ok(());
            }
            let grad = sum.flatten_all()?.narrow(0, from, len)?;
            let did = step.step(Part::Span {
                var: &master[i],
                from,
                grad: &grad,
            })?;
            match (did, state[i]) {
                (true, _) => state[i] = Stepped::Runs,
                (false, Stepped::Not) => {}
                (false, _) => {
                    return Err(Error::Usage(
                        "the optimizer updated some runs of a variable and declined another".into(),
                    ))
                }
            }
        }
        Arrived::Whole(i, t) => {
            if state[i] == Stepped::Runs {
                step.step(Part::Done(&master[i]))?;
            } else {
                let mut grads = GradStore::default();
                grads.insert(master[i].as_tensor(), t);
                step.step(Part::Vars(&grads))?;
            }
            state[i] = Stepped::Whole;
        }
    }
    Ok(())
}
