//! Checks a load makes before it changes anything: that a saved loss scaler can work and fits
//! this run's precision. (Model and optimizer tensors are checked as they are put into this
//! run's layout: see `reshard.rs`.)

use std::path::Path;

use super::format::unfit;
use crate::error::Result;
use crate::precision::scaler::LossScaler;

/// Refuses a scaler that cannot work, or one whose presence does not match this run's
/// precision (fp16 has a scaler, other precisions none).
pub(crate) fn check_scaler(file: &Path, s: Option<&LossScaler>, live_has: bool) -> Result<()> {
    match (s, live_has) {
        (Some(_), false) => return Err(unfit(file, "holds an fp16 loss scaler but this run does not use fp16: resume with the precision that saved it")),
        (None, true) => return Err(unfit(file, "holds no loss scaler but this run uses fp16: resume with the precision that saved it")),
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
            return Err(unfit(file, format!("holds a loss scaler that cannot work ({s:?}): scale and growth_factor must be finite and positive, growth_factor >= 1, 0 < backoff_factor <= 1, growth_interval >= 1")));
        }
    }
    Ok(())
}
