//! Low-precision copies of the f32 master weights: the one place they are refreshed.

use candle_core::Var;

use crate::error::Result;

/// Rounds `master` (f32) into `compute`, the low-precision copy the model computes with,
/// after the master changed (an optimizer step, a load). Does nothing when the model computes
/// with the master itself (f32 runs).
pub(crate) fn refresh_copy(compute: &Var, master: &Var) -> Result<()> {
    if compute.as_tensor().id() != master.as_tensor().id() {
        compute.set(&master.as_tensor().to_dtype(compute.dtype())?)?;
    }
    Ok(())
}
