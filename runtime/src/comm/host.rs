//! Between tensors and the host buffers MPI moves: f32 host copies, and shard sizes as MPI
//! counts.

use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use mpi::Count;

/// Shard sizes (times `scale`) as MPI counts, which are 32-bit.
pub(super) fn shard_counts(counts: &[usize], scale: usize) -> Result<Vec<Count>> {
    counts
        .iter()
        .map(|&c| {
            c.checked_mul(scale)
                .and_then(|b| Count::try_from(b).ok())
                .ok_or_else(|| {
                    Error::Comm(format!(
                        "a shard of {c} elements is too large for one MPI call (2^31 units at most)"
                    ))
                })
        })
        .collect()
}

/// Brings a tensor to a contiguous host vector of a type MPI can reduce.
pub(super) fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// A reduced host vector back as a tensor of `like`'s shape, dtype and device.
pub(super) fn back(data: Vec<f32>, like: &Tensor) -> Result<Tensor> {
    let t = Tensor::from_vec(data, like.shape(), &Device::Cpu)?;
    Ok(t.to_dtype(like.dtype())?.to_device(like.device())?)
}
