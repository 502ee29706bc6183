//! The world of one process: every collective is an identity.

use super::{Communicator, ReduceOp};
use crate::error::Result;
use candle_core::Tensor;

/// The communicator of a lone process.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleComm;

impl Communicator for SingleComm {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce(&self, t: &Tensor, _op: ReduceOp) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn all_reduce_sum_into(&self, send: &[f32], recv: &mut [f32], _position: u64) -> Result<()> {
        super::check_lengths(send, recv)?;
        recv.copy_from_slice(send);
        Ok(())
    }
    fn broadcast(&self, t: &Tensor, _root: usize) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn broadcast_bytes(&self, bytes: Vec<u8>, _root: usize) -> Result<Vec<u8>> {
        Ok(bytes)
    }
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![bytes.to_vec()])
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn name(&self) -> &'static str {
        "single"
    }
}
