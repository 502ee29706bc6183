//! The training step's path through the facade: `backward` scales the loss for fp16 and its
//! window, adds the micro-batch's gradients to each model's window sums, and on a window's last
//! micro-batch hands them to the sync strategy ([`train::sync`](crate::train::sync):
//! replicated or sharded); clipping, and reading a window's partial sums.

use crate::accelerator::Accelerator;
use crate::comm::Communicator;
use crate::comm::ReduceOp;
use crate::error::{Error, Result};
use crate::observe::step_times::Phase;
use crate::optim::parts::Part;
use crate::setup::config::Sharding;
use crate::train::grads::{Gradients, MicroStep};
use crate::train::shard::scale_all;
use crate::train::sync::Strategy;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use std::time::Instant;

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
        if self.training.models().is_empty()
            && (self.state.world_size > 1
                || self.training.window().accum() > 1
                || self.mixed.scales_loss())
        {
            return Err(Error::Prepare(
                "backward needs the model's VarMap prepared (accelerator.prepare(varmap) or \
                 prepare_optimizer) to sync, accumulate or unscale its gradients"
                    .into(),
            ));
        }
        self.stop_if_agreed()?;
        self.report_frozen_once();
        let MicroStep { window, sync } = self.training.window().for_backward();
        if sync {
            self.commit_pending_snapshot()?;
        }
        let clock = self.training.window().clock().clone();
        clock.count(sync);
        let start = Instant::now();
        let scale = self.mixed.loss_scale();
        // Each micro-batch counts 1/window of its window's mean; the scale is undone after sync.
        let store = self.scaled_backward(loss, scale / window as f64)?;
        self.warn_unreached(&store);
        if sync && self.passes_through() {
            clock.since(Phase::Backward, start);
            let start = Instant::now();
            self.agree_on_stop()?;
            let grads = self.end_in_place(store);
            clock.since(Phase::Sync, start);
            return grads;
        }
        let touched = self.accumulate(&store)?;
        drop(store);
        clock.since(Phase::Backward, start);
        if !sync {
            return Ok(Gradients::accumulating());
        }
        let start = Instant::now();
        let grads = self.end_window(&touched, 1.0 / scale)?;
        self.mixed.end_step(grads.found_overflow())?;
        self.agree_on_stop()?;
        clock.since(Phase::Sync, start);
        Ok(grads)
    }

    /// Runs candle's backward on `loss` in f32, multiplied by `factor` (the fp16 scale over
    /// the window's size), after the loss guard has seen it.
    fn scaled_backward(&mut self, loss: &Tensor, factor: f64) -> Result<GradStore> {
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
        Ok(loss.backward()?)
    }

    /// Adds this micro-batch's gradients to each model's window sums; says which models the
    /// loss reached.
    fn accumulate(&mut self, store: &GradStore) -> Result<Vec<bool>> {
        self.training
            .models_mut()
            .iter_mut()
            .map(|m| m.accumulate(store))
            .collect()
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
        self.refuse_when_sharded("clip_grad_norm")?;
        let vars = self.training.trained_master_vars();
        grads.clip_norm(&vars, max_norm, norm_type)
    }

    /// Clamps synced gradients to `[-limit, limit]`.
    pub fn clip_grad_value(&self, grads: &mut Gradients, limit: f64) -> Result<()> {
        self.refuse_when_sharded("clip_grad_value")?;
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
        let id = var.as_tensor().id();
        let scale = self.mixed.loss_scale();
        for m in self.training.models() {
            let found = m
                .compute
                .iter()
                .zip(&m.master)
                .position(|(c, ms)| c.as_tensor().id() == id || ms.as_tensor().id() == id);
            if let Some(i) = found {
                return Ok(match &m.sums[i] {
                    None => None,
                    Some(sum) if scale == 1.0 => Some(sum.copy()?),
                    Some(sum) => Some((sum / scale)?),
                });
            }
        }
        Ok(None)
    }
    /// Ends the window on its last micro-batch: the gradients the optimizer gets, whether
    /// fp16 overflowed and (when clipping measured it) the global norm.
    pub(crate) fn end_window(&mut self, touched: &[bool], inv_scale: f64) -> Result<Gradients> {
        let position = self.training.window().position();
        self.end_window_buffers(touched)?;
        match self.sync.strategy() {
            Strategy::Sharded => {
                let (store, overflow, norm) = self.step_sharded(touched, position, inv_scale)?;
                Ok(Gradients::synced(store, overflow).with_norm(norm))
            }
            Strategy::Replicated => self.end_replicated(touched, position, inv_scale),
        }
    }

    /// Ends a replicated window: every model's whole mean gradient, unscaled, checked and
    /// clipped. Under `overlap` the models' optimizers step here too: bucket by bucket during
    /// the sync where nothing needs every gradient first (no fp16 overflow check, no
    /// clipping), after it otherwise.
    fn end_replicated(
        &mut self,
        touched: &[bool],
        position: u64,
        inv_scale: f64,
    ) -> Result<Gradients> {
        let mut out = GradStore::default();
        let mut overflow = false;
        let pipeline = self.sync.overlap()
            && !self.mixed.scales_loss()
            && self.sync.clip_norm().is_none()
            && self.sync.clip_value().is_none();
        let bucket = self.sync.bucket_bytes();
        let mut hidden = 0;
        // Whether each touched model's optimizer still has to step (under overlap).
        let mut to_step = Vec::new();
        // Only the models this loss reached end their window here: another model trained in
        // the same micro-step (a second loss, a GAN's other half) ends it at its own backward.
        for m in self.training.touched_mut(touched) {
            if pipeline && m.overlap.is_some() && m.can_overlap(&self.comm, bucket) {
                let mut step = m.overlap.take().expect("checked");
                let done = m.end_overlapped(&self.comm, position, bucket, &mut step, &mut out);
                m.overlap = Some(step);
                hidden += done?;
                to_step.push(false);
                continue;
            }
            overflow |= m.take_synced(
                &self.comm,
                position,
                bucket,
                inv_scale,
                self.mixed.scales_loss(),
                &mut out,
            )?;
            to_step.push(m.overlap.is_some());
        }
        self.training.window().clock().overlapped(hidden);
        let mut grads = Gradients::synced(out, overflow);
        if overflow {
            return Ok(grads);
        }
        self.clip(&mut grads)?;
        let mut stepped = false;
        for m in self.training.touched_mut(touched) {
            stepped |= m.overlap.is_some();
        }
        let models = self.training.touched_mut(touched);
        for (m, _) in models.zip(to_step).filter(|(_, s)| *s) {
            let step = m.overlap.as_mut().expect("checked");
            step.step(Part::Open)?;
            step.step(Part::Vars(grads.store()))?;
        }
        Ok(if stepped { grads.stepped() } else { grads })
    }

    /// Whether a one-micro-batch window's gradients are already final as candle computed
    /// them: replicated over the identity communicator, no loss scale, no low-precision copies
    /// and nothing summed from earlier micro-batches.
    pub(crate) fn passes_through(&self) -> bool {
        self.sync.strategy() == Strategy::Replicated
            && !self.sync.overlap()
            && self.comm.world_size() == 1
            && !self.mixed.scales_loss()
            && self
                .training
                .models()
                .iter()
                .all(|m| !m.has_copies() && m.sums.iter().all(Option::is_none))
    }

    /// Ends a window that [`passes_through`](Self::passes_through): candle's store, clipped.
    pub(crate) fn end_in_place(&self, store: GradStore) -> Result<Gradients> {
        let mut grads = Gradients::synced(store, false);
        self.clip(&mut grads)?;
        Ok(grads)
    }

    /// Clips synced, replicated gradients as the builder set: by the global norm, or by value.
    fn clip(&self, grads: &mut Gradients) -> Result<()> {
        if self.sync.clip_norm().is_none() && self.sync.clip_value().is_none() {
            return Ok(());
        }
        let vars = self.training.trained_master_vars();
        if let Some(n) = self.sync.clip_norm() {
            grads.clip_norm(&vars, n, 2.0)?;
        }
        if let Some(v) = self.sync.clip_value() {
            grads.clip_value(&vars, v)?;
        }
        Ok(())
    }
    /// The end of an accumulation window when the models are sharded (see the module docs):
    /// returns the pieces' gradients, whether the step overflowed, and the global norm.
    pub(crate) fn step_sharded(
        &mut self,
        touched: &[bool],
        position: u64,
        inv_scale: f64,
    ) -> Result<(GradStore, bool, Option<f64>)> {
        let mut store = GradStore::default();
        let check = self.mixed.scales_loss();
        let need_norm = self.sync.clip_norm().is_some();
        let (mut overflow, mut squares) = (false, 0.0);
        for m in self.training.touched_mut(touched) {
            let p = m.take_sharded(
                &self.comm,
                position,
                self.sync.bucket_bytes(),
                inv_scale,
                check,
                need_norm,
                &mut store,
            )?;
            overflow |= p.overflow;
            squares += p.squares;
        }
        // One small collective for what the slices cannot know alone: the global norm, and
        // (stage 2) whether any slice overflowed.
        let stage2 = self.sync.sharding() == Sharding::Gradients;
        if self.state.world_size > 1 && (need_norm || (stage2 && check)) {
            let local = Tensor::new(
                &[squares as f32, if overflow { 1.0 } else { 0.0 }],
                &Device::Cpu,
            )?;
            let agreed = self
                .comm
                .all_reduce(&local, ReduceOp::Sum)?
                .to_vec1::<f32>()?;
            squares = agreed[0] as f64;
            overflow = agreed[1] > 0.0;
        }
        let norm = need_norm.then(|| squares.sqrt());
        if overflow {
            return Ok((store, true, norm));
        }
        if let (Some(max), Some(total)) = (self.sync.clip_norm(), norm) {
            // The same coefficient as the unsharded clip: max / (norm + 1e-6), at most 1.
            let coef = (max / (total + 1e-6)).min(1.0);
            if coef < 1.0 {
                scale_all(&mut store, self.training.shards(), |g| g * coef)?;
            }
        }
        if let Some(v) = self.sync.clip_value() {
            scale_all(&mut store, self.training.shards(), |g| g.clamp(-v, v))?;
        }
        for m in self.training.touched_mut(touched) {
            let shard = m.shard.as_mut().expect("a sharded model");
            let Some(step) = shard.stepper.as_mut() else {
                return Err(Error::Prepare(
                    "the model is sharded but has no prepared optimizer: prepare its optimizer \
                     (accelerator.prepare((varmap, opt))) before the first optimizer step"
                        .into(),
                ));
            };
            step(&store)?;
            shard.forget_runs(&mut store);
            shard.gather_into(
                &self.comm,
                self.sync.bucket_bytes(),
                &m.compute,
                Some(&m.buffer),
            )?;
        }
        Ok((store, false, norm))
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
            match what {
                "clip_grad_norm" | "clip_grad_value" => {
                    "set clipping on the builder (`.clip_grad_norm(x)`, `.clip_grad_value(x)`) \
                     or the attribute (`clip_grad_norm = x`) instead"
                }
                _ => "train with sharding \"no\" where you need it (docs/sharding.md)",
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
