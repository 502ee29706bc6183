//! The gradients `backward` returns: the window's mean on a sync step, empty on the other
//! micro-steps; clipping them by the global norm or by value.

use crate::error::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

/// The gradients [`Accelerator::backward`](crate::Accelerator::backward) returns.
///
/// On the last micro-batch of an accumulation window they are the window's mean gradient,
/// averaged across processes, unscaled and clipped, keyed by the f32 master variables the
/// optimizer updates. On other micro-batches they are empty and
/// [`is_sync_step`](Self::is_sync_step) is false, which a prepared optimizer reads to skip.
#[derive(Debug)]
pub struct Gradients {
    store: GradStore,
    sync: bool,
    overflow: bool,
    norm: Option<f64>,
    /// Whether the optimizer already stepped on them inside `backward` (under `overlap`):
    /// clipping them now would change nothing the step used, so it is refused.
    stepped: bool,
}

impl Gradients {
    pub(crate) fn accumulating() -> Self {
        Gradients {
            store: GradStore::default(),
            sync: false,
            overflow: false,
            norm: None,
            stepped: false,
        }
    }

    pub(crate) fn synced(store: GradStore, overflow: bool) -> Self {
        Gradients {
            store,
            sync: true,
            overflow,
            norm: None,
            stepped: false,
        }
    }

    /// The same gradients, marked as already applied by an optimizer stepped in `backward`.
    pub(crate) fn stepped(mut self) -> Self {
        self.stepped = true;
        self
    }

    /// Refuses a change to gradients an optimizer already applied.
    fn refuse_if_stepped(&self, what: &str) -> Result<()> {
        if !self.stepped {
            return Ok(());
        }
        Err(Error::Usage(format!(
            "`{what}` after `backward` changes nothing here: with overlap = true the optimizer \
             already stepped on these gradients inside `backward`; set clipping on the builder \
             (`.clip_grad_norm(x)`, `.clip_grad_value(x)`) or the attribute instead"
        )))
    }

    /// The same gradients with the global norm already computed (sharded clipping).
    pub(crate) fn with_norm(mut self, norm: Option<f64>) -> Self {
        self.norm = norm;
        self
    }

    /// Whether these gradients end a window, so the optimizer really steps.
    pub fn is_sync_step(&self) -> bool {
        self.sync
    }

    /// Whether fp16 loss scaling overflowed (inf/NaN): the step is skipped and the scale
    /// lowered.
    pub fn found_overflow(&self) -> bool {
        self.overflow
    }

    /// The global gradient norm measured by clipping, when clipping by norm ran.
    pub fn grad_norm(&self) -> Option<f64> {
        self.norm
    }

    /// The gradient of `var` (a master variable), if it has one.
    pub fn get(&self, var: &Var) -> Option<&Tensor> {
        self.store.get(var.as_tensor())
    }

    /// The underlying candle store, as a candle optimizer expects it.
    pub fn store(&self) -> &GradStore {
        &self.store
    }

    /// Clips every gradient by the global `norm_type` norm (PyTorch's `clip_grad_norm_`
    /// formula) and returns that norm, or `None` on an accumulation micro-step.
    pub fn clip_norm(
        &mut self,
        vars: &[Var],
        max_norm: f64,
        norm_type: f64,
    ) -> Result<Option<f64>> {
        if !self.sync {
            return Ok(None);
        }
        self.refuse_if_stepped(ivme_settings::CLIP_GRAD_NORM.name)?;
        if max_norm <= 0.0 || norm_type <= 0.0 || norm_type.is_nan() {
            return Err(Error::config(
                ivme_settings::CLIP_GRAD_NORM.name,
                format!("max_norm {max_norm}, norm_type {norm_type}"),
                "use a positive max_norm and a norm_type > 0 (2.0, or f64::INFINITY)",
            ));
        }
        let grads: Vec<&Tensor> = vars
            .iter()
            .filter_map(|v| self.store.get(v.as_tensor()))
            .collect();
        let total = global_norm(&grads, norm_type)?;
        // The small epsilon keeps the coefficient finite for zero gradients, as PyTorch does.
        let coef = (max_norm / (total + 1e-6)).min(1.0);
        if coef < 1.0 {
            for v in vars {
                if let Some(g) = self.store.remove(v.as_tensor()) {
                    self.store.insert(v.as_tensor(), (g * coef)?);
                }
            }
        }
        self.norm = Some(total);
        Ok(Some(total))
    }

    /// Clamps every gradient to `[-limit, limit]`; does nothing on an accumulation micro-step.
    pub fn clip_value(&mut self, vars: &[Var], limit: f64) -> Result<()> {
        if !self.sync {
            return Ok(());
        }
        self.refuse_if_stepped(ivme_settings::CLIP_GRAD_VALUE.name)?;
        if limit <= 0.0 || limit.is_nan() {
            return Err(Error::config(
                ivme_settings::CLIP_GRAD_VALUE.name,
                limit,
                "use a positive limit",
            ));
        }
        for v in vars {
            if let Some(g) = self.store.remove(v.as_tensor()) {
                self.store.insert(v.as_tensor(), g.clamp(-limit, limit)?);
            }
        }
        Ok(())
    }
}

/// The `p`-norm of all `grads` taken together (`p = inf` is the largest magnitude).
pub fn global_norm(grads: &[&Tensor], p: f64) -> Result<f64> {
    let mut acc = 0f64;
    for g in grads {
        let g = g.to_dtype(DType::F32)?.abs()?;
        if p.is_infinite() {
            acc = acc.max(g.max_all()?.to_scalar::<f32>()? as f64);
        } else if p == 2.0 {
            acc += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        } else {
            acc += g.powf(p)?.sum_all()?.to_scalar::<f32>()? as f64;
        }
    }
    Ok(if p.is_infinite() {
        acc
    } else {
        acc.powf(1.0 / p)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn global_norm_matches_hand_computation() -> Result<()> {
        let d = candle_core::Device::Cpu;
        let a = Tensor::new(&[3f32, 0.0], &d)?;
        let b = Tensor::new(&[[4f32]], &d)?;
        assert!((global_norm(&[&a, &b], 2.0)? - 5.0).abs() < 1e-9);
        assert!((global_norm(&[&a, &b], f64::INFINITY)? - 4.0).abs() < 1e-9);
        assert!((global_norm(&[&a, &b], 1.0)? - 7.0).abs() < 1e-9);
        Ok(())
    }
}
