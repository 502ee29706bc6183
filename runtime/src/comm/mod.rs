//! Collective communication: one small trait, one file per backend.
//!
//! A single process is a world of size one whose collectives are identities, so neither ivme
//! nor the user's code branches on the world size.

use crate::error::Result;
use candle_core::Tensor;

#[cfg(feature = "mpi")]
mod host;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
#[cfg(feature = "mpi")]
mod ops;
mod single;
#[cfg(feature = "mpi")]
mod watch;

#[cfg(feature = "mpi")]
pub use self::mpi::MpiComm;
#[cfg(feature = "nccl")]
pub use self::nccl::NcclComm;
pub use single::SingleComm;

/// How values from every rank are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over ranks.
    Mean,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

/// The collectives ivme needs. Every rank must make the same calls in the same order with
/// tensors of the same shape and dtype; tensors may live on any device.
pub trait Communicator {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// The number of processes.
    fn world_size(&self) -> usize;
    /// Combines `t` from every rank with `op`; every rank gets the result.
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;
    /// Like [`all_reduce`](Self::all_reduce) with `Sum` or `Mean`, and fails on every rank
    /// when the ranks did not reach this call after the same number of collectives with the
    /// same `position` (where their data stands): the gradient sync uses it so that ranks that
    /// drifted apart never average gradients of different steps.
    fn all_reduce_checked(&self, t: &Tensor, op: ReduceOp, position: u64) -> Result<Tensor> {
        let _ = position;
        self.all_reduce(t, op)
    }
    /// Sums host buffer `send` across ranks into `recv` (of the same length), with the checks
    /// of [`all_reduce_checked`](Self::all_reduce_checked): the gradient sync's path, which
    /// reuses its buffers step after step instead of allocating tensors.
    fn all_reduce_sum_into(&self, send: &[f32], recv: &mut [f32], position: u64) -> Result<()> {
        check_lengths(send, recv)?;
        let t = Tensor::from_slice(send, send.len(), &candle_core::Device::Cpu)?;
        let r = self.all_reduce_checked(&t, ReduceOp::Sum, position)?;
        recv.copy_from_slice(&r.to_vec1::<f32>()?);
        Ok(())
    }
    /// Sums every rank's `send` and leaves this rank's shard of the sum in `recv`.
    ///
    /// Shards lie in rank order, rank `r`'s holding `counts[r]` values (they may differ, such
    /// as a shorter last shard): `send` holds all of them on every rank, `recv` this rank's.
    /// Every rank must pass the same `counts`, and fails on every rank, as
    /// [`all_reduce_checked`](Self::all_reduce_checked) does, when the ranks' data do not stand
    /// at the same `position`. With [`all_gather_into`](Self::all_gather_into) it is sharded
    /// data parallelism's gradient sync, into the caller's buffers.
    fn reduce_scatter_sum_into(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
        position: u64,
    ) -> Result<()> {
        let start = check_shards(
            self.world_size(),
            self.rank(),
            counts,
            recv.len(),
            send.len(),
        )?;
        let mut full = vec![0f32; send.len()];
        self.all_reduce_sum_into(send, &mut full, position)?;
        recv.copy_from_slice(&full[start..start + recv.len()]);
        Ok(())
    }
    /// Concatenates every rank's shard `send`, in rank order, into every rank's `recv`.
    ///
    /// Rank `r`'s shard holds `counts[r]` elements of `elem_bytes` bytes each: any dtype,
    /// moved as bytes, so f16/bf16 shards travel at their own size. Every rank must pass the
    /// same `counts`.
    fn all_gather_into(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        elem_bytes: usize,
    ) -> Result<()> {
        let bytes: Vec<usize> = counts.iter().map(|c| c * elem_bytes).collect();
        check_shards(
            self.world_size(),
            self.rank(),
            &bytes,
            send.len(),
            recv.len(),
        )?;
        let parts = self.all_gather_bytes(send)?;
        let mut at = 0;
        for (part, n) in parts.iter().zip(&bytes) {
            if part.len() != *n {
                return Err(crate::Error::Comm(format!(
                    "all_gather_into: a rank sent {} bytes for a shard of {n}",
                    part.len()
                )));
            }
            recv[at..at + n].copy_from_slice(part);
            at += n;
        }
        Ok(())
    }
    /// Every rank gets rank `root`'s `t`.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;
    /// Concatenates every rank's `t` along dimension 0, in rank order.
    fn all_gather(&self, t: &Tensor) -> Result<Tensor>;
    /// Every rank gets rank `root`'s bytes (the lengths may differ before the call).
    fn broadcast_bytes(&self, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>>;
    /// Every rank gets every rank's bytes, in rank order (lengths may differ).
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Returns once every rank has reached it.
    fn barrier(&self) -> Result<()>;
    /// Whether any rank asked to stop for a preemption (setup/preempt.rs): the same answer on
    /// every rank that calls it at the same point of the run. The default runs one small
    /// all-reduce; the MPI communicator reads what the arrival tokens of its collectives carried.
    fn agree_to_stop(&self) -> Result<bool> {
        let mine = crate::setup::preempt::requested();
        if self.world_size() == 1 {
            return Ok(mine);
        }
        let flag = Tensor::new(&[if mine { 1f32 } else { 0.0 }], &candle_core::Device::Cpu)?;
        Ok(self.all_reduce(&flag, ReduceOp::Max)?.to_vec1::<f32>()?[0] > 0.0)
    }
    /// The backend's name, for reports.
    fn name(&self) -> &'static str;
    /// Whether this communicator may be used from another thread while the thread that made
    /// it leaves it alone (MPI started with `MPI_THREAD_SERIALIZED`): the overlapped gradient
    /// sync moves its buckets from a thread of its own only then.
    fn lends_to_threads(&self) -> bool {
        false
    }
}

/// Fails unless a reduction's send and receive buffers have the same length.
pub(crate) fn check_lengths(send: &[f32], recv: &[f32]) -> Result<()> {
    if send.len() == recv.len() {
        Ok(())
    } else {
        Err(crate::Error::Comm(format!(
            "all_reduce_sum_into: the send buffer holds {} values but the receive buffer {}",
            send.len(),
            recv.len()
        )))
    }
}

/// Checks a sharded collective's layout: one count per rank, this rank's shard of `mine`
/// elements, all shards `whole` together. Returns where this rank's shard starts.
pub(crate) fn check_shards(
    world: usize,
    rank: usize,
    counts: &[usize],
    mine: usize,
    whole: usize,
) -> Result<usize> {
    let total: usize = counts.iter().sum();
    if counts.len() != world || counts.get(rank) != Some(&mine) || total != whole {
        return Err(crate::Error::Comm(format!(
            "a sharded collective on rank {rank} of {world} got shard sizes {counts:?} \
             (total {total}) for a shard of {mine} and a whole of {whole}: give one size per \
             rank, this rank's equal to its shard, adding up to the whole"
        )));
    }
    Ok(counts[..rank].iter().sum())
}

/// Wraps a communicator and counts the collectives it runs and the bytes each process hands
/// them, so tests and reports can show that skipped micro-steps communicate nothing and that
/// frozen weights move no bytes.
pub struct Counted {
    inner: Box<dyn Communicator>,
    count: std::sync::atomic::AtomicU64,
    bytes: std::sync::atomic::AtomicU64,
    /// The profile's recorder, when profiling: each collective becomes a span.
    trace: Option<std::sync::Arc<crate::observe::profile::trace::Trace>>,
}

impl Counted {
    /// Counts the collectives of `inner`.
    pub fn new(inner: Box<dyn Communicator>) -> Self {
        Counted {
            inner,
            count: std::sync::atomic::AtomicU64::new(0),
            bytes: std::sync::atomic::AtomicU64::new(0),
            trace: None,
        }
    }

    /// Records each collective as a span of `trace` (a profile) too.
    pub(crate) fn recording_into(
        mut self,
        trace: std::sync::Arc<crate::observe::profile::trace::Trace>,
    ) -> Self {
        self.trace = Some(trace);
        self
    }

    /// Runs one collective, recorded when profiling.
    fn timed<T>(&self, run: impl FnOnce() -> T) -> T {
        let Some(trace) = &self.trace else {
            return run();
        };
        let start = std::time::Instant::now();
        let out = run();
        trace.record(
            crate::observe::profile::SpanKind::Collective,
            start,
            std::time::Instant::now(),
        );
        out
    }

    /// Collectives run so far.
    pub fn count(&self) -> u64 {
        self.count.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes this process has handed to collectives so far (what it sends into each one: a
    /// tensor's size in its dtype, a buffer's length), in a world of one too.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn tick(&self) {
        self.count
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn tick_bytes(&self, bytes: usize) {
        self.tick();
        self.bytes
            .fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Counted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}(rank {} of {})",
            self.inner.name(),
            self.rank(),
            self.world_size()
        )
    }
}

impl Communicator for Counted {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.tick_bytes(tensor_bytes(t));
        self.timed(|| self.inner.all_reduce(t, op))
    }
    fn all_reduce_checked(&self, t: &Tensor, op: ReduceOp, position: u64) -> Result<Tensor> {
        self.tick_bytes(tensor_bytes(t));
        self.timed(|| self.inner.all_reduce_checked(t, op, position))
    }
    fn all_reduce_sum_into(&self, send: &[f32], recv: &mut [f32], position: u64) -> Result<()> {
        self.tick_bytes(std::mem::size_of_val(send));
        self.timed(|| self.inner.all_reduce_sum_into(send, recv, position))
    }
    fn reduce_scatter_sum_into(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
        position: u64,
    ) -> Result<()> {
        self.tick_bytes(std::mem::size_of_val(send));
        self.timed(|| {
            self.inner
                .reduce_scatter_sum_into(send, recv, counts, position)
        })
    }
    fn all_gather_into(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        elem_bytes: usize,
    ) -> Result<()> {
        self.tick_bytes(send.len());
        self.timed(|| self.inner.all_gather_into(send, recv, counts, elem_bytes))
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.tick_bytes(tensor_bytes(t));
        self.timed(|| self.inner.broadcast(t, root))
    }
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        self.tick_bytes(tensor_bytes(t));
        self.timed(|| self.inner.all_gather(t))
    }
    fn broadcast_bytes(&self, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        self.tick_bytes(bytes.len());
        self.timed(|| self.inner.broadcast_bytes(bytes, root))
    }
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.tick_bytes(bytes.len());
        self.timed(|| self.inner.all_gather_bytes(bytes))
    }
    fn agree_to_stop(&self) -> Result<bool> {
        self.inner.agree_to_stop()
    }

    fn barrier(&self) -> Result<()> {
        self.tick();
        self.timed(|| self.inner.barrier())
    }
    fn lends_to_threads(&self) -> bool {
        self.inner.lends_to_threads()
    }
    fn name(&self) -> &'static str {
        self.inner.name()
    }
}

/// A tensor's size in bytes, in its own dtype.
fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// How long a collective may wait for its peers unless told otherwise: long enough for a
/// peer to save a large checkpoint, short enough that a stuck job does not idle for hours.
pub const DEFAULT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// How a multi-process communicator watches its collectives.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CommOptions {
    /// How long one collective may wait for the other ranks before the job fails, naming
    /// the collective and the ranks that had not arrived.
    pub timeout: std::time::Duration,
    /// Compare every collective across ranks before running it (kind, sequence number, size),
    /// failing with what each rank was doing when they differ. Costs one small collective per
    /// collective: a debugging aid.
    pub debug_sync: bool,
    /// Start MPI so that a thread other than the one that started it may make calls, one
    /// thread at a time (`MPI_THREAD_SERIALIZED`): what the overlapped sync needs.
    pub threads: bool,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            timeout: DEFAULT_TIMEOUT,
            debug_sync: false,
            threads: false,
        }
    }
}

/// Opens the communicator for a layout on the process's (already chosen) device: the
/// single-process world for one process, NCCL for several on CUDA devices (with the `nccl`
/// feature), MPI otherwise.
pub fn open(
    world_size: usize,
    device: &candle_core::Device,
    options: &CommOptions,
) -> Result<Box<dyn Communicator>> {
    if world_size <= 1 {
        return Ok(Box::new(SingleComm));
    }
    #[cfg(feature = "nccl")]
    if let candle_core::Device::Cuda(cuda) = device {
        return NcclComm::open(cuda, options);
    }
    let _ = device;
    #[cfg(feature = "mpi")]
    {
        Ok(Box::new(MpiComm::init(options)?))
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = options;
        Err(crate::Error::Setup(format!(
            "the launcher started {world_size} processes but ivme was built without the `mpi` \
             feature; enable it (default features) or run one process"
        )))
    }
}
