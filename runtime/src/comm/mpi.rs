//! CPU multi-process collectives over MPI (Open MPI or MPICH), one or many machines.
//!
//! MPI has no f16/bf16 types, so low-precision tensors travel as f32 and come back in their
//! own dtype. Tensors on a GPU are staged through host memory.

use super::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::Communicator as _;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{CommunicatorCollectives, Root};
use mpi::Count;

/// The MPI world of this run. Dropping it finalizes MPI, which cannot be started again.
pub struct MpiComm {
    world: SimpleCommunicator,
    // Held only to keep MPI alive: its drop finalizes MPI.
    _universe: Universe,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiComm(rank {} of {})", self.rank(), self.world_size())
    }
}

impl MpiComm {
    /// Starts MPI; fails if this process already started it (one Accelerator per program).
    pub fn init() -> Result<Self> {
        let universe = mpi::initialize().ok_or_else(|| {
            Error::Setup(
                "MPI is already initialised in this process: create one Accelerator per program"
                    .into(),
            )
        })?;
        let world = universe.world();
        Ok(MpiComm {
            world,
            _universe: universe,
        })
    }

    fn op(op: ReduceOp) -> SystemOperation {
        match op {
            ReduceOp::Sum | ReduceOp::Mean => SystemOperation::sum(),
            ReduceOp::Max => SystemOperation::max(),
            ReduceOp::Min => SystemOperation::min(),
        }
    }
}

// Brings a tensor to a contiguous host vector of a type MPI can reduce.
fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

fn back(data: Vec<f32>, like: &Tensor) -> Result<Tensor> {
    let t = Tensor::from_vec(data, like.shape(), &Device::Cpu)?;
    Ok(t.to_dtype(like.dtype())?.to_device(like.device())?)
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn world_size(&self) -> usize {
        self.world.size() as usize
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        match t.dtype() {
            DType::F64 => {
                let send = t.flatten_all()?.to_vec1::<f64>()?;
                let mut recv = vec![0f64; send.len()];
                self.world
                    .all_reduce_into(&send[..], &mut recv[..], Self::op(op));
                if op == ReduceOp::Mean {
                    let n = self.world_size() as f64;
                    recv.iter_mut().for_each(|x| *x /= n);
                }
                Ok(Tensor::from_vec(recv, t.shape(), &Device::Cpu)?.to_device(t.device())?)
            }
            DType::I64 | DType::U32 | DType::U8 if op == ReduceOp::Mean => Err(Error::Comm(
                "a mean of integer tensors is not exact; reduce with Sum and divide as floats"
                    .into(),
            )),
            DType::I64 | DType::U32 | DType::U8 => {
                let send = t.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?;
                let mut recv = vec![0i64; send.len()];
                self.world
                    .all_reduce_into(&send[..], &mut recv[..], Self::op(op));
                let r = Tensor::from_vec(recv, t.shape(), &Device::Cpu)?;
                Ok(r.to_dtype(t.dtype())?.to_device(t.device())?)
            }
            _ => {
                let send = host_f32(t)?;
                let mut recv = vec![0f32; send.len()];
                self.world
                    .all_reduce_into(&send[..], &mut recv[..], Self::op(op));
                if op == ReduceOp::Mean {
                    let inv = 1.0 / self.world_size() as f32;
                    recv.iter_mut().for_each(|x| *x *= inv);
                }
                back(recv, t)
            }
        }
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let root_proc = self.world.process_at_rank(root as i32);
        match t.dtype() {
            DType::F64 => {
                let mut data = t.flatten_all()?.to_vec1::<f64>()?;
                root_proc.broadcast_into(&mut data[..]);
                Ok(Tensor::from_vec(data, t.shape(), &Device::Cpu)?.to_device(t.device())?)
            }
            DType::I64 | DType::U32 | DType::U8 => {
                let mut data = t.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?;
                root_proc.broadcast_into(&mut data[..]);
                let r = Tensor::from_vec(data, t.shape(), &Device::Cpu)?;
                Ok(r.to_dtype(t.dtype())?.to_device(t.device())?)
            }
            _ => {
                // f16/bf16 widen to f32 exactly, so the round trip is lossless.
                let mut data = host_f32(t)?;
                root_proc.broadcast_into(&mut data[..]);
                back(data, t)
            }
        }
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        // Shapes must agree, or MPI would read past buffers: check first, cheaply.
        let dims: Vec<u8> = t
            .dims()
            .iter()
            .flat_map(|d| (*d as u64).to_le_bytes())
            .collect();
        let all_dims = self.all_gather_bytes(&dims)?;
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
    }

    fn broadcast_bytes(&self, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        let root_proc = self.world.process_at_rank(root as i32);
        let mut len = bytes.len() as u64;
        root_proc.broadcast_into(&mut len);
        let mut buf = if self.rank() == root {
            bytes
        } else {
            vec![0u8; len as usize]
        };
        if len > 0 {
            root_proc.broadcast_into(&mut buf[..]);
        }
        Ok(buf)
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let n = self.world_size();
        let len = bytes.len() as Count;
        let mut counts = vec![0 as Count; n];
        self.world.all_gather_into(&len, &mut counts[..]);
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
        Ok(counts
            .iter()
            .zip(&displs)
            .map(|(&c, &d)| recv[d as usize..(d + c) as usize].to_vec())
            .collect())
    }

    fn barrier(&self) -> Result<()> {
        self.world.barrier();
        Ok(())
    }

    fn name(&self) -> &'static str {
        "mpi"
    }
}
