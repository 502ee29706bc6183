//! The training step's path through the facade: `backward` scales the loss for fp16 and its
//! window, runs candle's backward and hands the micro-batch to the sync
//! ([`train::sync`](crate::train::sync)), which sums it into the window and, on the window's
//! last micro-batch, ends the window (synced, unscaled, clipped; sharded optimizers stepped);
//! then the loss scaler and the preemption agreement see the step's end. Clipping after the
//! fact, and reading a window's partial sums.

use crate::accelerator::Accelerator;
use crate::error::{Error, Result};
use crate::optim::gradients::Gradients;
use crate::setup::config::Sharding;
use crate::train::sync::{self, MicroBatch};
use crate::train::window::MicroStep;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use std::time::{Duration, Instant};

impl Accelerator {
    /// Reports that batch `index` of `batches_in_epoch` is next, for hand-made data sources:
    /// windows then end exactly where the data does.
    pub fn micro_step(&self, index: usize, batches_in_epoch: usize) {
        use crate::data::StepObserver;
        self.training.window().on_batch(index, batches_in_epoch, 0);
    }

    /// Computes gradients of `loss`: scaled for fp16 and for its accumulation window,
    /// summed over the window, then (on the window's last micro-batch) averaged across
    /// processes, unscaled and clipped. Pass the result to a prepared optimizer's `step`.
    pub fn backward(&mut self, loss: &Tensor) -> Result<Gradients> {
        self.refuse_backward_unprepared()?;
        self.stop_if_agreed()?;
        self.report_frozen_once();
        let MicroStep { window, sync } = self.training.window().for_backward();
        if sync {
            self.commit_pending_snapshot()?;
        }
        self.training.window().clock().count(sync);
        let started = Instant::now();
        let loss_scale = self.mixed.loss_scale();
        // Each micro-batch counts 1/window of its window's mean; the scale is undone after sync.
        let (store, recomputed) = self.scaled_backward(loss, loss_scale / window as f64)?;
        self.warn_unreached(&store);
        let micro = MicroBatch {
            store,
            ends_window: sync,
            loss_scale,
            scaled: self.mixed.scales_loss(),
            started,
            recomputed,
        };
        let taken = sync::take(&mut self.training, &self.sync, &*self.comm, micro)?;
        if let Some(began) = taken.sync_began {
            self.mixed.end_step(taken.grads.found_overflow())?;
            self.agree_on_stop()?;
            let clock = self.training.window().clock();
            clock.since(crate::observe::step_times::Phase::Sync, began);
        }
        Ok(taken.grads)
    }

    /// Refuses a backward that would need a prepared model to sync, accumulate or unscale.
    fn refuse_backward_unprepared(&self) -> Result<()> {
        let needs_models = self.state.world_size > 1
            || self.training.window().accum() > 1
            || self.mixed.scales_loss();
        if !self.training.models().is_empty() || !needs_models {
            return Ok(());
        }
        Err(Error::Prepare(
            "backward needs the model's VarMap prepared (accelerator.prepare(varmap) or \
             prepare_optimizer) to sync, accumulate or unscale its gradients"
                .into(),
        ))
    }

    /// Runs candle's backward on `loss` in f32, multiplied by `factor` (the fp16 scale over
    /// the window's size), after the loss guard has seen it; through the checkpointed
    /// segments when activation checkpointing is on. Returns the gradients and the time the
    /// segments took to run again.
    fn scaled_backward(&mut self, loss: &Tensor, factor: f64) -> Result<(GradStore, Duration)> {
        let loss = if loss.dtype() == DType::F32 {
            loss.clone()
        } else {
            loss.to_dtype(DType::F32)?
        };
        self.mixed.on_loss(&loss);
        let loss = if factor == 1.0 {
            loss
        } else {
            (loss * factor)?
        };
        self.backward_through_segments(&loss)
    }

    /// Clips synced gradients to a global `norm_type` norm of at most `max_norm` and returns
    /// the norm before clipping (`None` on accumulation micro-steps). The norm is taken over
    /// the variables prepared optimizers step: a frozen variable's gradient does not count.
    pub fn clip_grad_norm(
        &self,
        grads: &mut Gradients,
        max_norm: f64,
        norm_type: f64,
    ) -> Result<Option<f64>> {
        self.refuse_when_sharded(ivme_settings::CLIP_GRAD_NORM.name)?;
        let vars = self.training.trained_master_vars();
        grads.clip_norm(&vars, max_norm, norm_type)
    }

    /// Clamps synced gradients to `[-limit, limit]`.
    pub fn clip_grad_value(&self, grads: &mut Gradients, limit: f64) -> Result<()> {
        self.refuse_when_sharded(ivme_settings::CLIP_GRAD_VALUE.name)?;
        let vars = self.training.trained_master_vars();
        grads.clip_value(&vars, limit)
    }

    /// This rank's gradient of `var` accumulated so far in the current window, as the part of
    /// the window's mean it makes up: after `k` of `n` micro-batches, `(g₁ + … + g_k) / n`,
    /// with any fp16 loss scale undone. It is not yet averaged across processes.
    ///
    /// `var` may be the variable the model computes with or its f32 master. Returns `None`
    /// when no backward of the current window reached `var`, in particular right after a
    /// sync step (whose gradients [`backward`](Self::backward) returned). The result is a new
    /// f32 tensor: reading it changes nothing in the window.
    ///
    /// ```no_run
    /// # fn main() -> ivme::Result<()> {
    /// # let mut accelerator = ivme::Accelerator::builder().grad_accum(4).build()?;
    /// # let varmap = candle_nn::VarMap::new();
    /// # let w = varmap.get(3, "w", candle_nn::Init::Const(1.0), candle_core::DType::F32, accelerator.device())?;
    /// # let loss = w.sum_all()?;
    /// let grads = accelerator.backward(&loss)?;
    /// if !grads.is_sync_step() {
    ///     if let Some(g) = accelerator.accumulated_gradient(&candle_core::Var::from_tensor(&w)?)? {
    ///         accelerator.print(format!("partial gradient norm {}", g.sqr()?.sum_all()?.sqrt()?));
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub fn accumulated_gradient(&self, var: &Var) -> Result<Option<Tensor>> {
        let scale = self.mixed.loss_scale();
        Ok(match self.training.window_sum(var.as_tensor().id()) {
            None => None,
            Some(sum) if scale == 1.0 => Some(sum.copy()?),
            Some(sum) => Some((sum / scale)?),
        })
    }

    /// Refuses a call that cannot work once the optimizer step happens inside `backward`.
    pub(crate) fn refuse_when_sharded(&self, what: &str) -> Result<()> {
        if self.sync.sharding() == Sharding::No {
            return Ok(());
        }
        Err(Error::Usage(format!(
            "`{what}` is not available with sharding = {}: the optimizer step happens inside \
             `backward`, on this process's slice; {}",
            self.sync.sharding(),
            if [
                ivme_settings::CLIP_GRAD_NORM.name,
                ivme_settings::CLIP_GRAD_VALUE.name
            ]
            .contains(&what)
            {
                "set clipping on the builder (`.clip_grad_norm(x)`, `.clip_grad_value(x)`) or \
                 the attribute (`clip_grad_norm = x`) instead"
            } else {
                "train with sharding \"no\" where you need it (docs/sharding.md)"
            }
        )))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};
    use candle_nn::VarMap;

    use crate::{Accelerator, Precision};

    /// Gradient of `sum(w * x)` with respect to `w`, by hand: `x`.
    fn batch(i: usize) -> Tensor {
        Tensor::new(&[i as f32 + 1.0, -2.0 * i as f32, 0.5], &Device::Cpu).unwrap()
    }

    fn run(precision: Precision, tol: f32) {
        let mut acc = Accelerator::builder()
            .cpu(true)
            .grad_accum(3)
            .precision(precision)
            .build()
            .unwrap();
        let varmap = VarMap::new();
        let dtype = acc.param_dtype(DType::F32);
        varmap
            .get(3, "w", candle_nn::Init::Const(0.0), dtype, &Device::Cpu)
            .unwrap();
        let varmap = acc.prepare(varmap).unwrap();
        let w: Var = varmap.data().lock().unwrap()["w"].clone();
        let mut expected = vec![0f32; 3];
        for i in 0..3 {
            let x = batch(i).to_dtype(dtype).unwrap();
            let loss = (w.as_tensor() * &x).unwrap().sum_all().unwrap();
            let grads = acc.backward(&loss).unwrap();
            for (e, x) in expected.iter_mut().zip(batch(i).to_vec1::<f32>().unwrap()) {
                *e += x / 3.0;
            }
            let got = acc.accumulated_gradient(&w).unwrap();
            if i < 2 {
                assert!(!grads.is_sync_step());
                let got = got.expect("a partial gradient").to_vec1::<f32>().unwrap();
                for (g, e) in got.iter().zip(&expected) {
                    assert!(
                        (g - e).abs() <= tol,
                        "{precision:?} micro-step {i}: {got:?} vs {expected:?}"
                    );
                }
            } else {
                assert!(grads.is_sync_step());
                assert!(got.is_none(), "the sync step took the window's sums");
            }
        }
    }

    /// Under overlap the optimizer steps inside `backward` (on one process after the window's
    /// sums are in), to candle-nn's numbers; the prepared optimizer's `step` then changes
    /// nothing, clipping afterwards is refused, and overlap with sharding is refused at build.
    #[test]
    fn overlap_steps_inside_backward_and_refuses_clipping_afterwards() {
        use candle_nn::Optimizer;
        let mut acc = Accelerator::builder()
            .cpu(true)
            .overlap(true)
            .build()
            .unwrap();
        let varmap = VarMap::new();
        varmap
            .get(
                3,
                "w",
                candle_nn::Init::Const(0.5),
                DType::F32,
                &Device::Cpu,
            )
            .unwrap();
        let varmap = acc.prepare(varmap).unwrap();
        let w: Var = varmap.data().lock().unwrap()["w"].clone();
        let opt = crate::optim::AdamW::new(vec![w.clone()], Default::default()).unwrap();
        let mut opt = acc.prepare(opt).unwrap();
        let reference = Var::new(&[0.5f32, 0.5, 0.5], &Device::Cpu).unwrap();
        let mut plain = candle_nn::AdamW::new(vec![reference.clone()], Default::default()).unwrap();
        for i in 0..2 {
            let x = batch(i);
            let mut grads = acc
                .backward(&(w.as_tensor() * &x).unwrap().sum_all().unwrap())
                .unwrap();
            let after_backward = w.as_tensor().to_vec1::<f32>().unwrap();
            opt.step(&grads).unwrap();
            assert_eq!(w.as_tensor().to_vec1::<f32>().unwrap(), after_backward);
            plain
                .backward_step(&(reference.as_tensor() * &x).unwrap().sum_all().unwrap())
                .unwrap();
            assert_eq!(
                after_backward,
                reference.as_tensor().to_vec1::<f32>().unwrap()
            );
            let e = acc.clip_grad_norm(&mut grads, 1.0, 2.0).unwrap_err();
            assert!(e.to_string().contains("already stepped"), "{e}");
        }
        assert_eq!(opt.steps(), 2);
        let e = Accelerator::builder()
            .cpu(true)
            .overlap(true)
            .sharding(crate::Sharding::Gradients)
            .build()
            .unwrap_err();
        assert!(e.to_string().contains("under sharding"), "{e}");
    }

    #[test]
    fn the_partial_window_gradient_is_the_running_share_of_the_mean() {
        run(Precision::No, 1e-6);
        // Under fp16 the loss scale is undone.
        run(Precision::Fp16, 2e-3);
    }
}
