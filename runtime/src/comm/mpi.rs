//! CPU multi-process collectives over MPI (Open MPI or MPICH), one or many machines.
//!
//! MPI has no f16/bf16 types, so low-precision tensors travel as f32 and come back in their
//! own dtype. Tensors on a GPU are staged through host memory.
//!
//! Before every collective the ranks exchange arrival tokens under the job's [`Watch`], which
//! gives the wait a deadline, ends it early when a peer failed or left, and fails when the
//! ranks are at different calls; only then does the data move, with MPI's blocking
//! collectives (all ranks are known to be in them), which a watchdog thread holds to the same
//! deadline. Dropping the communicator finalizes MPI
//! only after every rank said goodbye, so a failing rank never hangs the job.

use super::host::{back, host_f32, shard_counts};
use super::ops::{describe, refuse_integer_mean, Op, OpKind};
use super::watch::{Ending, Watch};
use super::{CommOptions, Communicator, ReduceOp};
use crate::error::{Error, Result};
use candle_core::{CpuStorage, DType, Device, Tensor};
use mpi::collective::SystemOperation;
use mpi::datatype::{Equivalence, PartitionMut};
use mpi::environment::{Threading, Universe};
use mpi::raw::AsRaw;
use mpi::topology::Communicator as _;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{CommunicatorCollectives, Root};
use mpi::Count;
use std::mem::{forget, ManuallyDrop};

/// The MPI world of this run. Dropping it finalizes MPI (which cannot be started again) when
/// the run ended cleanly on every rank, and leaves MPI alone after a failure.
pub struct MpiComm {
    world: SimpleCommunicator,
    // Whether MPI may be called from a thread other than the one that started it, one thread
    // at a time (MPI_THREAD_SERIALIZED or more): the overlapped gradient sync needs it.
    serialized: bool,
    // Its control channel is freed only on a clean end, before MPI is finalized.
    watch: ManuallyDrop<Watch>,
    // Dropped (which finalizes MPI) only after a clean goodbye from every rank.
    universe: ManuallyDrop<Universe>,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiComm(rank {} of {})", self.rank(), self.world_size())
    }
}

impl MpiComm {
    /// Starts MPI; fails if this process already started it (one Accelerator per program).
    pub fn init(options: &CommOptions) -> Result<Self> {
        // Serialized (one thread at a time, any thread) lets the overlapped sync move its
        // buckets from a thread of its own; without it MPI starts as it always did.
        let started = match options.threads {
            true => mpi::initialize_with_threading(Threading::Serialized)
                .map(|(u, level)| (u, level >= Threading::Serialized)),
            false => mpi::initialize().map(|u| (u, false)),
        };
        let (universe, serialized) = started.ok_or_else(|| {
            Error::Setup(
                "MPI is already initialised in this process: create one Accelerator per program"
                    .into(),
            )
        })?;
        let world = universe.world();
        let watch = Watch::new(&world, options.timeout, options.debug_sync);
        Ok(MpiComm {
            world,
            serialized,
            watch: ManuallyDrop::new(watch),
            universe: ManuallyDrop::new(universe),
        })
    }

    fn op(op: ReduceOp) -> SystemOperation {
        match op {
            ReduceOp::Sum | ReduceOp::Mean => SystemOperation::sum(),
            ReduceOp::Max => SystemOperation::max(),
            ReduceOp::Min => SystemOperation::min(),
        }
    }

    /// Runs one collective under the watch: numbered, compared across ranks in debug mode,
    /// started only once every rank arrived at the same call, and counted as done only when it
    /// completed.
    pub(crate) fn collective<T>(&self, op: Op, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let seq = self.watch.enter(op)?;
        if self.watch.debug_sync {
            self.compare(seq, op)?;
        }
        self.watch.arrive()?;
        let transfer = self.watch.transfer();
        let out = f()?;
        drop(transfer);
        self.watch.leave_op();
        Ok(out)
    }

    /// Debug mode: every rank shows the others which call it is at before making it.
    fn compare(&self, seq: u64, op: Op) -> Result<()> {
        let mine = vec![seq, op.kind as u64, op.count, op.root, op.position];
        let n = self.world_size();
        let mut all = vec![0u64; 5 * n];
        // Non-blocking with the deadline: the peers may not have arrived yet.
        let res = mpi::request::scope(|s| {
            let req = self
                .world
                .immediate_all_gather_into(s, &mine[..], &mut all[..]);
            self.watch.wait(req)
        });
        let (mine, all) = keep_or_leak(res, (mine, all))?;
        let rows: Vec<&[u64]> = all.chunks(5).collect();
        if rows.iter().all(|r| **r == mine[..]) {
            return Ok(());
        }
        let each: Vec<String> = rows
            .iter()
            .enumerate()
            .map(|(r, row)| {
                let token = [row[0], row[1], row[2], row[3], row[4]];
                format!("rank {r} is at {}", describe(&token))
            })
            .collect();
        Err(self.watch.fail(format!(
            "the ranks are not at the same collective (IVME_DEBUG_SYNC): {}; every rank must \
             make the same collective calls in the same order with the same shapes",
            each.join(", ")
        )))
    }

    // Below, every rank is known to be in the same call (see `Watch::arrive`): the data moves
    // with MPI's blocking collectives.

    /// Reduces `send` into `recv` (the caller's `vec![0; n]`, which the allocator hands out as
    /// fresh zero pages instead of writing every element first).
    fn all_reduce_vec<T: Equivalence>(
        &self,
        send: Vec<T>,
        mut recv: Vec<T>,
        op: ReduceOp,
    ) -> Vec<T> {
        self.world
            .all_reduce_into(&send[..], &mut recv[..], Self::op(op));
        recv
    }

    fn bcast_vec<T: Equivalence>(&self, mut buf: Vec<T>, root: usize) -> Vec<T> {
        self.world
            .process_at_rank(root as i32)
            .broadcast_into(&mut buf[..]);
        buf
    }

    fn gather_bytes(&self, bytes: &[u8]) -> Vec<Vec<u8>> {
        let n = self.world_size();
        let mut counts = vec![0 as Count; n];
        self.world
            .all_gather_into(&(bytes.len() as Count), &mut counts[..]);
        let displs: Vec<Count> = counts
            .iter()
            .scan(0, |acc, &c| {
                let d = *acc;
                *acc += c;
                Some(d)
            })
            .collect();
        let total: Count = counts.iter().sum();
        let mut recv = vec![0u8; total as usize];
        {
            let mut part = PartitionMut::new(&mut recv[..], &counts[..], &displs[..]);
            self.world.all_gather_varcount_into(bytes, &mut part);
        }
        counts
            .iter()
            .zip(&displs)
            .map(|(&c, &d)| recv[d as usize..(d + c) as usize].to_vec())
            .collect()
    }

    fn reduce_f32(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        // A contiguous f32 tensor in host memory is sent from its own storage, uncopied.
        if t.device().is_cpu() && t.dtype() == DType::F32 {
            let (storage, layout) = t.storage_and_layout();
            if let (candle_core::Storage::Cpu(CpuStorage::F32(data)), Some((a, b))) =
                (&*storage, layout.contiguous_offsets())
            {
                let mut recv = vec![0f32; b - a];
                self.world
                    .all_reduce_into(&data[a..b], &mut recv[..], Self::op(op));
                drop(storage);
                return back(self.mean(recv, op), t);
            }
        }
        let send = host_f32(t)?;
        let zeros = vec![0f32; send.len()];
        let recv = self.all_reduce_vec(send, zeros, op);
        back(self.mean(recv, op), t)
    }

    fn mean(&self, mut v: Vec<f32>, op: ReduceOp) -> Vec<f32> {
        if op == ReduceOp::Mean {
            let inv = 1.0 / self.world_size() as f32;
            v.iter_mut().for_each(|x| *x *= inv);
        }
        v
    }
}

/// Hands the buffers back after a completed collective; after a failed one MPI may still
/// write into them, so they are leaked instead.
fn keep_or_leak<B>(res: Result<()>, buffers: B) -> Result<B> {
    match res {
        Ok(()) => Ok(buffers),
        Err(e) => {
            forget(buffers);
            Err(e)
        }
    }
}

fn is_int(dt: DType) -> bool {
    matches!(dt, DType::I64 | DType::U32 | DType::U8)
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn world_size(&self) -> usize {
        self.world.size() as usize
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        refuse_integer_mean(t.dtype(), op)?;
        let desc = Op::new(OpKind::AllReduce, t.elem_count());
        self.collective(desc, || match t.dtype() {
            DType::F64 => {
                let send = t.flatten_all()?.to_vec1::<f64>()?;
                let zeros = vec![0f64; send.len()];
                let mut recv = self.all_reduce_vec(send, zeros, op);
                if op == ReduceOp::Mean {
                    let n = self.world_size() as f64;
                    recv.iter_mut().for_each(|x| *x /= n);
                }
                Ok(Tensor::from_vec(recv, t.shape(), &Device::Cpu)?.to_device(t.device())?)
            }
            dt if is_int(dt) => {
                let send = t.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?;
                let zeros = vec![0i64; send.len()];
                let recv = self.all_reduce_vec(send, zeros, op);
                let r = Tensor::from_vec(recv, t.shape(), &Device::Cpu)?;
                Ok(r.to_dtype(t.dtype())?.to_device(t.device())?)
            }
            _ => self.reduce_f32(t, op),
        })
    }

    fn all_reduce_checked(&self, t: &Tensor, op: ReduceOp, position: u64) -> Result<Tensor> {
        let desc = Op::new(OpKind::GradSync, t.elem_count()).at(position);
        // The position travels in the arrival token: ranks whose data stands at different
        // batches fail here instead of averaging gradients of different steps.
        self.collective(desc, || self.reduce_f32(t, op))
    }

    fn all_reduce_sum_into(&self, send: &[f32], recv: &mut [f32], position: u64) -> Result<()> {
        super::check_lengths(send, recv)?;
        let desc = Op::new(OpKind::GradSync, send.len()).at(position);
        // Every rank is in this call once the tokens matched, so the blocking reduction
        // returns with `recv` filled: nothing of the caller's buffers outlives the call.
        self.collective(desc, || {
            self.world
                .all_reduce_into(send, recv, SystemOperation::sum());
            Ok(())
        })
    }

    fn reduce_scatter_sum_into(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
        position: u64,
    ) -> Result<()> {
        super::check_shards(
            self.world_size(),
            self.rank(),
            counts,
            recv.len(),
            send.len(),
        )?;
        let counts = shard_counts(counts, 1)?;
        // Checked like the gradient all-reduce: ranks whose data drifted apart fail here.
        let desc = Op::new(OpKind::ReduceScatter, send.len()).at(position);
        self.collective(desc, || {
            // SAFETY: `send` holds the sum of `counts` f32 values and `recv` this rank's count
            // (checked above); every rank is in this call, so the blocking reduction returns
            // with both buffers released.
            unsafe {
                mpi::ffi::MPI_Reduce_scatter(
                    send.as_ptr().cast(),
                    recv.as_mut_ptr().cast(),
                    counts.as_ptr(),
                    f32::equivalent_datatype().as_raw(),
                    SystemOperation::sum().as_raw(),
                    self.world.as_raw(),
                );
            }
            Ok(())
        })
    }

    fn all_gather_into(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        elem_bytes: usize,
    ) -> Result<()> {
        let whole: usize = counts.iter().sum();
        let mine = counts.get(self.rank()).copied().unwrap_or(0);
        super::check_shards(self.world_size(), self.rank(), counts, mine, whole)?;
        let bytes = shard_counts(counts, elem_bytes)?;
        if send.len() != mine * elem_bytes || recv.len() != whole * elem_bytes {
            return Err(Error::Comm(format!(
                "all_gather_into: {} bytes to send and {} to receive for a shard of {mine} and \
                 a whole of {whole} elements of {elem_bytes} bytes",
                send.len(),
                recv.len()
            )));
        }
        let displs: Vec<Count> = bytes
            .iter()
            .scan(0, |acc, &c| {
                let d = *acc;
                *acc += c;
                Some(d)
            })
            .collect();
        let desc = Op::new(OpKind::AllGatherInto, recv.len());
        self.collective(desc, || {
            let mut part = PartitionMut::new(recv, &bytes[..], &displs[..]);
            self.world.all_gather_varcount_into(send, &mut part);
            Ok(())
        })
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let desc = Op::new(OpKind::Broadcast, t.elem_count()).rooted(root);
        self.collective(desc, || match t.dtype() {
            DType::F64 => {
                let data = self.bcast_vec(t.flatten_all()?.to_vec1::<f64>()?, root);
                Ok(Tensor::from_vec(data, t.shape(), &Device::Cpu)?.to_device(t.device())?)
            }
            dt if is_int(dt) => {
                let data = t.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?;
                let data = self.bcast_vec(data, root);
                let r = Tensor::from_vec(data, t.shape(), &Device::Cpu)?;
                Ok(r.to_dtype(t.dtype())?.to_device(t.device())?)
            }
            // f16/bf16 widen to f32 exactly, so the round trip is lossless.
            _ => back(self.bcast_vec(host_f32(t)?, root), t),
        })
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let desc = Op::new(OpKind::AllGather, t.elem_count());
        self.collective(desc, || {
            // Shapes must agree, or MPI would read past buffers: check first, cheaply.
            let dims: Vec<u8> = t
                .dims()
                .iter()
                .flat_map(|d| (*d as u64).to_le_bytes())
                .collect();
            let all_dims = self.gather_bytes(&dims);
            if let Some((r, _)) = all_dims.iter().enumerate().find(|(_, d)| **d != dims) {
                return Err(Error::Comm(format!(
                    "all_gather: rank {} has shape {:?} but rank {r} has another; pad with \
                     `pad_across_processes` first",
                    self.rank(),
                    t.dims()
                )));
            }
            let send = host_f32(t)?;
            let mut recv = vec![0f32; send.len() * self.world_size()];
            self.world.all_gather_into(&send[..], &mut recv[..]);
            let mut dims = t.dims().to_vec();
            if dims.is_empty() {
                dims.push(self.world_size());
            } else {
                dims[0] *= self.world_size();
            }
            let r = Tensor::from_vec(recv, dims, &Device::Cpu)?;
            Ok(r.to_dtype(t.dtype())?.to_device(t.device())?)
        })
    }

    fn broadcast_bytes(&self, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        let desc = Op::new(OpKind::BroadcastBytes, 0).rooted(root);
        self.collective(desc, || {
            let len = self.bcast_vec(vec![bytes.len() as u64], root)[0];
            let buf = if self.rank() == root {
                bytes
            } else {
                vec![0u8; len as usize]
            };
            if len == 0 {
                return Ok(buf);
            }
            Ok(self.bcast_vec(buf, root))
        })
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let desc = Op::new(OpKind::AllGatherBytes, 0);
        self.collective(desc, || Ok(self.gather_bytes(bytes)))
    }

    fn agree_to_stop(&self) -> Result<bool> {
        if self.world_size() == 1 {
            return Ok(crate::setup::preempt::requested());
        }
        Ok(self.watch.stop_seen())
    }

    fn barrier(&self) -> Result<()> {
        let desc = Op::new(OpKind::Barrier, 0);
        // Every rank arriving at the same call is the barrier.
        self.collective(desc, || Ok(()))
    }

    fn name(&self) -> &'static str {
        "mpi"
    }

    fn lends_to_threads(&self) -> bool {
        self.serialized
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        match self.watch.finish(std::thread::panicking()) {
            // SAFETY: each is dropped exactly once, here, the control channel before MPI is
            // finalized; nothing uses MPI after this.
            Ending::Clean => unsafe {
                ManuallyDrop::drop(&mut self.watch);
                ManuallyDrop::drop(&mut self.universe);
            },
            // Finalizing could wait forever for a peer stuck in a collective: the process ends
            // without it, and the launcher ends the other ranks.
            Ending::Failed => {}
        }
    }
}
