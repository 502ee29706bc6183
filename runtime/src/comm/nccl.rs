//! Collectives on CUDA tensors with NCCL: on the device, in the tensors' own dtype (bf16 and
//! f16 included), ordered on candle's stream with the kernels that made the tensors.
//!
//! The launcher's MPI stays underneath as the control channel:
//!
//! - rank 0's NCCL unique id reaches the other ranks through an MPI broadcast;
//! - every NCCL call is first announced under MPI's watch, so it has the MPI backend's
//!   collective deadline, fault reports and position checks (ranks whose data drifted apart
//!   fail before any gradient moves), and counts as done only once the stream finished it;
//! - bytes, barriers, host buffers and tensors on the CPU travel over MPI.
//!
//! Selected by [`open`](super::open) when the device is CUDA and more than one process runs.
//! The gradient sync's device path (`bucket::all_reduce_bucketed`: flattened buckets, one
//! `all_reduce_checked` each) then reduces on the GPU; the sharded stages' host buffers still
//! go over MPI.

use super::mpi::MpiComm;
use super::ops::{refuse_integer_mean, Op, OpKind};
use super::{CommOptions, Communicator, ReduceOp};
use crate::error::{Error, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use candle_core::cuda::cudarc::nccl::safe::{self as nccl, NcclType};
use candle_core::cuda::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, DType, Device, InplaceOp1, Layout, Storage, Tensor,
};

/// NCCL for CUDA tensors, with MPI as the control channel.
pub struct NcclComm {
    control: MpiComm,
    nccl: nccl::Comm,
    device: CudaDevice,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm(rank {} of {})", self.rank(), self.world_size())
    }
}

fn nccl_error(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Comm(format!("NCCL {what} failed: {e:?}"))
}

impl NcclComm {
    /// Starts MPI and, unless ranks share a GPU, joins the NCCL world on `device`'s stream
    /// (rank 0's NCCL id shared over MPI).
    ///
    /// NCCL refuses two ranks on one GPU, so when more ranks than GPUs run on a machine (they
    /// share them round-robin, `state::select_device`) the job stays on MPI, which stages GPU
    /// tensors through host memory: slower, but it runs, and rank 0 says so.
    pub fn open(device: &CudaDevice, options: &CommOptions) -> Result<Box<dyn Communicator>> {
        let control = MpiComm::init(options)?;
        let mine = format!(
            "{}/{}",
            crate::setup::state::host_name(),
            device.cuda_stream().context().ordinal()
        );
        let mut places = control.all_gather_bytes(mine.as_bytes())?;
        places.sort();
        if places.windows(2).any(|w| w[0] == w[1]) {
            if control.rank() == 0 {
                tracing::warn!(
                    "ranks share a GPU (more processes than GPUs on a machine): their \
                     collectives go over MPI through host memory instead of NCCL"
                );
            }
            return Ok(Box::new(control));
        }
        Ok(Box::new(NcclComm::join(control, device)?))
    }

    /// Shares rank 0's NCCL id over `control` and joins the NCCL world on `device`'s stream.
    fn join(control: MpiComm, device: &CudaDevice) -> Result<Self> {
        let id = if control.rank() == 0 {
            let id = nccl::Id::new().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
            id.internal().iter().map(|&c| c as u8).collect()
        } else {
            Vec::new()
        };
        let bytes = control.broadcast_bytes(id, 0)?;
        let internal: [std::ffi::c_char; 128] =
            std::array::from_fn(|i| bytes.get(i).copied().unwrap_or(0) as std::ffi::c_char);
        if bytes.len() != internal.len() {
            return Err(Error::Comm(format!(
                "the NCCL id from rank 0 has {} bytes, not {}",
                bytes.len(),
                internal.len()
            )));
        }
        let (rank, world) = (control.rank(), control.world_size());
        // Under the watch: a rank that died or stalled since the id's broadcast ends the
        // others' wait at the deadline, instead of leaving them in NCCL's blocking init.
        let nccl = control.collective(Op::new(OpKind::NcclInit, 0), || {
            nccl::Comm::from_rank(
                device.cuda_stream(),
                rank,
                world,
                nccl::Id::uninit(internal),
            )
            .map_err(|e| nccl_error("ncclCommInitRank", e))
        })?;
        Ok(NcclComm {
            control,
            nccl,
            device: device.clone(),
        })
    }

    /// Runs `f` (which enqueues NCCL work) under MPI's watch, then waits for the stream.
    fn guarded<T>(&self, op: Op, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.control.collective(op, || {
            let out = f()?;
            self.device
                .cuda_stream()
                .synchronize()
                .map_err(|e| nccl_error("stream synchronize", e))?;
            Ok(out)
        })
    }

    /// A contiguous copy of `t` this call owns, changed in place by `op`.
    fn in_place(&self, t: &Tensor, op: &Collective<'_>) -> Result<Tensor> {
        let out = t.contiguous()?.copy()?;
        out.inplace_op1(op)?;
        Ok(out)
    }
}

fn is_cuda(t: &Tensor) -> bool {
    matches!(t.device(), Device::Cuda(_))
}

fn nccl_op(op: ReduceOp) -> nccl::ReduceOp {
    match op {
        ReduceOp::Sum => nccl::ReduceOp::Sum,
        ReduceOp::Mean => nccl::ReduceOp::Avg,
        ReduceOp::Max => nccl::ReduceOp::Max,
        ReduceOp::Min => nccl::ReduceOp::Min,
    }
}

/// An in-place NCCL collective on a tensor's own storage.
enum Collective<'a> {
    AllReduce(&'a nccl::Comm, ReduceOp),
    Broadcast(&'a nccl::Comm, usize),
}

impl Collective<'_> {
    fn run<T: NcclType + CudaDType + DeviceRepr>(
        &self,
        storage: &mut CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<()> {
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("NCCL needs a contiguous tensor".into()))?;
        let slice = storage.as_cuda_slice_mut::<T>()?;
        let mut view = slice.slice_mut(start..end);
        let done = match self {
            Collective::AllReduce(comm, op) => comm.all_reduce_in_place(&mut view, &nccl_op(*op)),
            Collective::Broadcast(comm, root) => comm.broadcast_in_place(&mut view, *root as i32),
        };
        done.map(|_| ())
            .map_err(|e| candle_core::Error::Msg(format!("NCCL {}: {e:?}", self.name())))
    }
}

impl InplaceOp1 for Collective<'_> {
    fn name(&self) -> &'static str {
        match self {
            Collective::AllReduce(..) => "ncclAllReduce",
            Collective::Broadcast(..) => "ncclBroadcast",
        }
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("{} runs on CUDA tensors only", self.name())
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        match storage.dtype() {
            DType::F32 => self.run::<f32>(storage, layout),
            DType::F64 => self.run::<f64>(storage, layout),
            DType::F16 => self.run::<half::f16>(storage, layout),
            DType::BF16 => self.run::<half::bf16>(storage, layout),
            DType::U8 => self.run::<u8>(storage, layout),
            DType::U32 => self.run::<u32>(storage, layout),
            DType::I64 => self.run::<i64>(storage, layout),
            other => candle_core::bail!("NCCL has no {other:?} type"),
        }
    }
}

/// Every rank's contiguous `t`, concatenated in rank order into fresh device memory.
fn gather<T: NcclType + CudaDType + DeviceRepr + ValidAsZeroBits>(
    comm: &nccl::Comm,
    device: &CudaDevice,
    t: &Tensor,
) -> Result<CudaStorage> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        return Err(Error::Comm("all_gather: not a CUDA tensor".into()));
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| Error::Comm("all_gather needs a contiguous tensor".into()))?;
    let src = s.as_cuda_slice::<T>()?.slice(start..end);
    let mut recv = device.alloc_zeros::<T>((end - start) * comm.world_size())?;
    comm.all_gather(&src, &mut recv)
        .map_err(|e| nccl_error("ncclAllGather", e))?;
    Ok(CudaStorage::wrap_cuda_slice(recv, device.clone()))
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.control.rank()
    }

    fn world_size(&self) -> usize {
        self.control.world_size()
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        if !is_cuda(t) {
            return self.control.all_reduce(t, op);
        }
        refuse_integer_mean(t.dtype(), op)?;
        let desc = Op::new(OpKind::AllReduce, t.elem_count());
        self.guarded(desc, || {
            self.in_place(t, &Collective::AllReduce(&self.nccl, op))
        })
    }

    fn all_reduce_checked(&self, t: &Tensor, op: ReduceOp, position: u64) -> Result<Tensor> {
        if !is_cuda(t) {
            return self.control.all_reduce_checked(t, op, position);
        }
        let desc = Op::new(OpKind::GradSync, t.elem_count()).at(position);
        self.guarded(desc, || {
            self.in_place(t, &Collective::AllReduce(&self.nccl, op))
        })
    }

    fn all_reduce_sum_into(&self, send: &[f32], recv: &mut [f32], position: u64) -> Result<()> {
        self.control.all_reduce_sum_into(send, recv, position)
    }

    fn reduce_scatter_sum_into(
        &self,
        send: &[f32],
        recv: &mut [f32],
        counts: &[usize],
        position: u64,
    ) -> Result<()> {
        self.control
            .reduce_scatter_sum_into(send, recv, counts, position)
    }

    fn all_gather_into(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        elem_bytes: usize,
    ) -> Result<()> {
        self.control.all_gather_into(send, recv, counts, elem_bytes)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if !is_cuda(t) {
            return self.control.broadcast(t, root);
        }
        let desc = Op::new(OpKind::Broadcast, t.elem_count()).rooted(root);
        self.guarded(desc, || {
            self.in_place(t, &Collective::Broadcast(&self.nccl, root))
        })
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        if !is_cuda(t) {
            return self.control.all_gather(t);
        }
        let t = if t.rank() == 0 {
            t.reshape(1)?
        } else {
            t.contiguous()?
        };
        let mut dims = t.dims().to_vec();
        dims[0] *= self.world_size();
        let desc = Op::new(OpKind::AllGather, t.elem_count());
        let (comm, device) = (&self.nccl, &self.device);
        let storage = self.guarded(desc, || match t.dtype() {
            DType::F32 => gather::<f32>(comm, device, &t),
            DType::F64 => gather::<f64>(comm, device, &t),
            DType::F16 => gather::<half::f16>(comm, device, &t),
            DType::BF16 => gather::<half::bf16>(comm, device, &t),
            DType::U8 => gather::<u8>(comm, device, &t),
            DType::U32 => gather::<u32>(comm, device, &t),
            DType::I64 => gather::<i64>(comm, device, &t),
            other => Err(Error::Comm(format!("NCCL has no {other:?} type"))),
        })?;
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            dims,
            BackpropOp::none(),
            false,
        ))
    }

    fn broadcast_bytes(&self, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        self.control.broadcast_bytes(bytes, root)
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.control.all_gather_bytes(bytes)
    }

    fn barrier(&self) -> Result<()> {
        self.control.barrier()
    }

    fn agree_to_stop(&self) -> Result<bool> {
        self.control.agree_to_stop()
    }

    fn name(&self) -> &'static str {
        "nccl"
    }
}
