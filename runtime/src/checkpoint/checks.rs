//! Checks a load makes before it changes anything: that a saved optimizer state fits the
//! model's variables, and that a saved loss scaler can work and fits this run's precision.

use std::path::Path;

use candle_core::Var;

use super::format::bad;
use crate::error::Result;
use crate::scaler::LossScaler;
use crate::stateful::StateDict;

/// Refuses an optimizer state whose per-variable tensors (`variable::key`, e.g. AdamW's
/// `exp_avg`, SGD's `momentum_buffer`) do not name a variable of this run's models or do not
/// have that variable's dtype and shape. The optimizer checks its scalars itself when loading,
/// all or nothing; this catches what it would only see after other objects were loaded.
pub(super) fn check_optimizer(
    dir: &Path,
    name: &str,
    saved: &StateDict,
    vars: &[(String, Var)],
) -> Result<()> {
    let file = dir.join(format!("rank0/{name}.safetensors"));
    for (full, t) in &saved.tensors {
        let Some((var, _key)) = full.split_once("::") else {
            return Err(bad(
                &file,
                format!("has `{full}`, which is not `variable::key`: was it saved by an ivme optimizer?"),
            ));
        };
        let matching: Vec<&Var> = vars
            .iter()
            .filter(|(n, _)| n == var)
            .map(|(_, v)| v)
            .collect();
        if matching.is_empty() {
            return Err(bad(
                &file,
                format!("has state for `{var}`, which no prepared model has: was it saved by this model?"),
            ));
        }
        if !matching
            .iter()
            .any(|v| v.dims() == t.dims() && v.dtype() == t.dtype())
        {
            let v = matching[0];
            return Err(bad(
                &file,
                format!(
                    "has `{full}` as {:?} {:?} but the variable `{var}` is {:?} {:?}; was it saved by this model and optimizer?",
                    t.dtype(),
                    t.dims(),
                    v.dtype(),
                    v.dims()
                ),
            ));
        }
    }
    Ok(())
}

/// Refuses a scaler that cannot work, or one whose presence does not match this run's
/// precision (fp16 has a scaler, other precisions none).
pub(super) fn check_scaler(file: &Path, s: Option<&LossScaler>, live_has: bool) -> Result<()> {
    match (s, live_has) {
        (Some(_), false) => return Err(bad(file, "holds an fp16 loss scaler but this run does not use fp16: resume with the precision that saved it")),
        (None, true) => return Err(bad(file, "holds no loss scaler but this run uses fp16: resume with the precision that saved it")),
        _ => {}
    }
    if let Some(s) = s {
        let ok = s.scale.is_finite()
            && s.scale > 0.0
            && s.growth_factor.is_finite()
            && s.growth_factor >= 1.0
            && s.backoff_factor > 0.0
            && s.backoff_factor <= 1.0
            && s.growth_interval >= 1;
        if !ok {
            return Err(bad(file, format!("holds a loss scaler that cannot work ({s:?}): scale and growth_factor must be finite and positive, growth_factor >= 1, 0 < backoff_factor <= 1, growth_interval >= 1")));
        }
    }
    Ok(())
}
