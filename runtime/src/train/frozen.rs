//! Frozen variables at prepare: nothing steps them, so instead of broadcasting them from rank 0
//! every process shows the others a checksum of its own, and a difference (a base loaded from
//! another file, weights drawn unseeded) stops the job naming the variable.

use crate::comm::Communicator;
use crate::error::{Error, Result};
use candle_core::{DType, Var};

/// Fails on every process unless each variable of `frozen` (by name, in the same order on every
/// process) holds the same values everywhere. One small all-gather; nothing in a world of one.
pub(crate) fn check_equal(comm: &dyn Communicator, frozen: &[(String, Var)]) -> Result<()> {
    if comm.world_size() == 1 || frozen.is_empty() {
        return Ok(());
    }
    let mut mine = Vec::with_capacity(4 * frozen.len());
    for (_, var) in frozen {
        let values = var
            .as_tensor()
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        let mut hasher = crc32fast::Hasher::new();
        values.iter().for_each(|v| hasher.update(&v.to_le_bytes()));
        mine.extend_from_slice(&hasher.finalize().to_le_bytes());
    }
    let all = comm.all_gather_bytes(&mine)?;
    for (rank, theirs) in all.iter().enumerate().skip(1) {
        let differs = theirs
            .chunks(4)
            .zip(all[0].chunks(4))
            .position(|(a, b)| a != b);
        if let Some(k) = differs {
            return Err(Error::Prepare(format!(
                "the frozen variable `{}` holds other values on rank {rank} than on rank 0; \
                 frozen variables (held by no prepared optimizer) are not broadcast, so every \
                 process must build them alike: load the same pretrained weights on every \
                 process, or draw them with `accelerator.var_builder(..)` (seeded)",
                frozen[k].0
            )));
        }
    }
    Ok(())
}
