//! Mixed precision's home: the policy, the fp16 loss scaler, the NaN-loss guard and the exact
//! f32 initial values ([`MixedPrecision`]), and the one place the low-precision copies of the
//! f32 master weights are refreshed ([`refresh_copy`]).

pub mod autocast;
pub(crate) mod exact_init;
pub(crate) mod model_dtype;
pub mod scaler;

use candle_core::{DType, Tensor, Var};

use crate::error::Result;
use crate::precision::exact_init::ExactMasters;
use crate::precision::model_dtype::LossGuard;
use crate::precision::scaler::LossScaler;
use crate::setup::config::Precision;
use crate::stateful::Shared;

/// The last name segments candle gives the state its layers keep outside the weights.
const CANDLE_BUFFER_NAMES: &[&str] = &["running_mean", "running_var", "num_batches_tracked"];

/// Whether `name` is one of the statistics candle's BatchNorm keeps (by its last segment):
/// a buffer, kept in f32 and never given a master.
pub(crate) fn is_batch_norm_statistic(name: &str) -> bool {
    let last = name.rsplit('.').next().unwrap_or(name);
    CANDLE_BUFFER_NAMES.contains(&last)
}

/// Rounds `master` (f32) into `compute`, the low-precision copy the model computes with,
/// after the master changed (an optimizer step, a load). Does nothing when the model computes
/// with the master itself (f32 runs).
pub(crate) fn refresh_copy(compute: &Var, master: &Var) -> Result<()> {
    if compute.as_tensor().id() != master.as_tensor().id() {
        compute.set(&master.as_tensor().to_dtype(compute.dtype())?)?;
    }
    Ok(())
}

/// The Accelerator's precision part: the policy, the fp16 loss scaler, the guard that stops a
/// run whose loss is NaN in 16 bits, and the exact f32 initial values of low-precision variables
/// (`var_builder`). Everything mixed precision keeps between steps lives here.
#[derive(Debug)]
pub(crate) struct MixedPrecision {
    policy: Precision,
    scaler: Option<LossScaler>,
    guard: LossGuard,
    exact: ExactMasters,
}

impl MixedPrecision {
    /// The part for `policy`; fp16 starts its loss scale at `initial_scale` (or the default).
    pub fn new(policy: Precision, initial_scale: Option<f64>) -> Self {
        let scaler = (policy == Precision::Fp16).then(|| LossScaler {
            scale: initial_scale.unwrap_or(LossScaler::default().scale),
            ..LossScaler::default()
        });
        MixedPrecision {
            policy,
            scaler,
            guard: LossGuard::default(),
            exact: Shared::new(Default::default()),
        }
    }

    /// The precision policy.
    pub fn policy(&self) -> Precision {
        self.policy
    }

    /// The dtype autocast scopes compute in (`None` under f32).
    pub fn autocast_dtype(&self) -> Option<DType> {
        (self.policy != Precision::No).then(|| self.policy.compute_dtype())
    }

    /// The fp16 loss scaler, when there is one.
    pub fn scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// Whether losses are scaled (fp16), so gradients must be unscaled and checked for
    /// overflow.
    pub fn scales_loss(&self) -> bool {
        self.scaler.is_some()
    }

    /// The factor losses are multiplied by (1 without fp16).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, |s| s.scale)
    }

    /// Shows the guard a micro-batch's loss (in f32).
    pub fn on_loss(&mut self, loss: &Tensor) {
        self.guard.record(self.policy, loss);
    }

    /// Ends an optimizer step: the guard checks the step's losses, and the scaler learns
    /// whether the gradients overflowed.
    pub fn end_step(&mut self, overflow: bool) -> Result<()> {
        self.guard.at_sync(self.policy, overflow)?;
        if let Some(s) = &mut self.scaler {
            s.update(overflow);
        }
        Ok(())
    }

    /// Refuses a prepared variable `name` of dtype `dt` that would train wrongly under this
    /// policy: a BatchNorm running `statistic` not in f32 (candle's BatchNorm updates it with
    /// f32 batch statistics), or an f32 parameter (not a `buffer`) under fp16/bf16, which
    /// would silently train in f32.
    pub(crate) fn check_variable(
        &self,
        name: &str,
        dt: DType,
        statistic: bool,
        buffer: bool,
    ) -> Result<()> {
        if self.policy == Precision::No {
            return Ok(());
        }
        if statistic && dt != DType::F32 {
            return Err(crate::Error::Precision(format!(
                "`{name}` (a BatchNorm running statistic) is {dt:?}: candle 0.11's BatchNorm \
                 updates its statistics with f32 batch statistics, so its first training step \
                 would fail with a dtype mismatch; build the model with \
                 `accelerator.var_builder(&varmap, DType::F32)`, which keeps BatchNorm's \
                 statistics in f32 under {} (or `#[accelerate]`, which writes that call)",
                self.policy
            )));
        }
        if dt == DType::F32 && !buffer {
            return Err(crate::Error::Precision(format!(
                "precision is {} but variable `{name}` is f32, so the model would silently \
                 train in f32; create it with `accelerator.var_builder(&varmap, DType::F32)` \
                 (exact f32 masters) or `VarBuilder::from_varmap(&varmap, \
                 accelerator.param_dtype(DType::F32), accelerator.device())`",
                self.policy
            )));
        }
        Ok(())
    }

    /// Puts back a loaded checkpoint's scaler.
    pub fn restore_scaler(&mut self, scaler: Option<LossScaler>) {
        self.scaler = scaler;
    }

    /// The exact f32 initial values of variables `var_builder` made, by tensor id.
    pub fn exact_masters(&self) -> &ExactMasters {
        &self.exact
    }
}
