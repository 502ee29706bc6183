//! What ivme's optimizers share: widening to f32 for their maths, checking variables they
//! are re-bound to, and reading a saved state back.

use super::OptimizerState;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Shape, Tensor, Var};

/// Widens to f32 for the optimizer maths; f32 tensors pass through untouched.
pub(super) fn to_f32(t: &Tensor) -> candle_core::Result<Tensor> {
    if t.dtype() == DType::F32 {
        Ok(t.clone())
    } else {
        t.to_dtype(DType::F32)
    }
}

/// Checks that `new` can stand in for `old` position for position: same count, shapes and
/// devices (the optimizer state stays where it is).
pub(super) fn check_replacement(old: &[Var], new: &[Var], who: &str) -> Result<()> {
    if old.len() != new.len() {
        return Err(Error::Usage(format!(
            "{who}::replace_vars got {} variables but the optimizer updates {}: pass one \
             replacement per variable, in the order of `vars()`",
            new.len(),
            old.len()
        )));
    }
    for (i, (o, n)) in old.iter().zip(new).enumerate() {
        if o.shape() != n.shape() {
            return Err(Error::Usage(format!(
                "{who}::replace_vars: variable {i} has shape {:?} but its replacement has shape \
                 {:?}: pass replacements in the order of `vars()`",
                o.dims(),
                n.dims()
            )));
        }
        if !o.device().same_device(n.device()) {
            return Err(Error::Usage(format!(
                "{who}::replace_vars: variable {i} is on {:?} but its replacement is on {:?}: \
                 move the replacement to the optimizer's device first",
                o.device().location(),
                n.device().location()
            )));
        }
    }
    Ok(())
}

/// Checks that a saved state has one entry per variable.
pub(super) fn check_count(state: &OptimizerState, n: usize, who: &str) -> Result<()> {
    if state.tensors.len() != n {
        return Err(Error::Usage(format!(
            "{who} state has {} variables but this optimizer updates {n}: load a state saved \
             from the same model and optimizer",
            state.tensors.len()
        )));
    }
    Ok(())
}

/// Finds the state tensor `name` of variable `i`, checks it has the `shape` the optimizer keeps
/// for it (the variable's, or its run's) and brings it to f32 on `device`.
pub(super) fn find_tensor(
    entry: &[(String, Tensor)],
    name: &str,
    i: usize,
    shape: &Shape,
    device: &Device,
    who: &str,
) -> Result<Tensor> {
    let Some((_, t)) = entry.iter().find(|(n, _)| n == name) else {
        return Err(Error::Usage(format!(
            "{who} state for variable {i} has no `{name}` tensor: load a state saved by the same \
             kind of optimizer"
        )));
    };
    if t.shape() != shape {
        return Err(Error::Usage(format!(
            "{who} state `{name}` for variable {i} has shape {:?} but the variable has shape \
             {:?}: load a state saved from the same model, with variables in the same order",
            t.dims(),
            shape.dims()
        )));
    }
    Ok(t.to_device(device)?.to_dtype(DType::F32)?)
}

/// Reads a required number from saved scalars.
pub(super) fn read_f64(scalars: &serde_json::Value, key: &str, who: &str) -> Result<f64> {
    scalars.get(key).and_then(|v| v.as_f64()).ok_or_else(|| {
        Error::Usage(format!(
            "{who} state has no number `{key}`: load a state saved by the same kind of optimizer"
        ))
    })
}

/// Reads a required non-negative integer from saved scalars.
pub(super) fn read_u64(scalars: &serde_json::Value, key: &str, who: &str) -> Result<u64> {
    scalars.get(key).and_then(|v| v.as_u64()).ok_or_else(|| {
        Error::Usage(format!(
            "{who} state has no integer `{key}`: load a state saved by the same kind of optimizer"
        ))
    })
}
