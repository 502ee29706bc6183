//! The replicated end of a window (plain data parallelism): every process averages the whole
//! gradients (bucketed, `bucket.rs`), unscales them, looks for fp16 overflow and clips them as
//! the settings say; under `overlap` the models' optimizers step here too (`overlap.rs`).

use super::WindowEnd;
use crate::error::Result;
use crate::optim::gradients::Gradients;
use crate::optim::parts::Part;
use crate::train::bucket::{all_reduce_bucketed, Finish, Work};
use crate::train::params::ParamSet;
use crate::train::training::Training;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

/// Ends a replicated window: every touched model's whole mean gradient, unscaled, checked and
/// clipped. Under `overlap` the models' optimizers step here too: bucket by bucket during the
/// sync where nothing needs every gradient first (no fp16 overflow check, no clipping), after
/// it otherwise.
pub(super) fn end(training: &mut Training, end: &WindowEnd, touched: &[bool]) -> Result<Gradients> {
    let settings = end.settings;
    let pipeline = settings.overlap()
        && !end.check_overflow
        && settings.clip_norm().is_none()
        && settings.clip_value().is_none();
    let mut out = GradStore::default();
    let mut overflow = false;
    let mut hidden = 0;
    // Whether each touched model's optimizer still has to step (under overlap).
    let mut to_step = Vec::new();
    // Only the models this loss reached end their window here: another model trained in the
    // same micro-step (a second loss, a GAN's other half) ends it at its own backward.
    for m in training.touched_mut(touched) {
        if pipeline && m.overlap.is_some() && m.can_overlap(end.comm, settings.bucket_bytes()) {
            hidden += m.end_overlapped(end, &mut out)?;
            to_step.push(false);
            continue;
        }
        overflow |= m.take_synced(end, &mut out)?;
        to_step.push(m.overlap.is_some());
    }
    training.window().clock().overlapped(hidden);
    let mut grads = Gradients::synced(out, overflow);
    if overflow {
        return Ok(grads);
    }
    clip(training, end, &mut grads)?;
    let stepped = training.touched_mut(touched).any(|m| m.overlap.is_some());
    let models = training.touched_mut(touched);
    for (m, _) in models.zip(to_step).filter(|(_, s)| *s) {
        let step = m.overlap.as_mut().expect("checked");
        step.step(Part::Open)?;
        step.step(Part::Vars(grads.store()))?;
    }
    Ok(if stepped { grads.stepped() } else { grads })
}

/// Whether a one-micro-batch window's gradients are already final as candle computed them:
/// replicated over the identity communicator, no loss scale, no low-precision copies and
/// nothing summed from earlier micro-batches.
pub(super) fn passes_through(training: &Training, end: &WindowEnd) -> bool {
    end.settings.strategy() == super::Strategy::Replicated
        && !end.settings.overlap()
        && end.comm.world_size() == 1
        && !end.check_overflow
        && end.inv_scale == 1.0
        && training
            .models()
            .iter()
            .all(|m| !m.has_copies() && m.sums.iter().all(Option::is_none))
}

/// Ends a window that [`passes_through`]: candle's store, clipped.
pub(super) fn end_in_place(
    training: &Training,
    end: &WindowEnd,
    store: GradStore,
) -> Result<Gradients> {
    let mut grads = Gradients::synced(store, false);
    clip(training, end, &mut grads)?;
    Ok(grads)
}

/// Clips synced, replicated gradients as the settings say: by the global norm, or by value.
fn clip(training: &Training, end: &WindowEnd, grads: &mut Gradients) -> Result<()> {
    let (norm, value) = (end.settings.clip_norm(), end.settings.clip_value());
    if norm.is_none() && value.is_none() {
        return Ok(());
    }
    let vars = training.trained_master_vars();
    if let Some(n) = norm {
        grads.clip_norm(&vars, n, 2.0)?;
    }
    if let Some(v) = value {
        grads.clip_value(&vars, v)?;
    }
    Ok(())
}

impl ParamSet {
    /// Ends the window: averages the sums across processes (bucketed), unscales them, and
    /// puts them in `store` keyed by master variable; returns whether any value is inf/NaN.
    pub(in crate::train) fn take_synced(
        &mut self,
        end: &WindowEnd,
        store: &mut GradStore,
    ) -> Result<bool> {
        // A model no backward of this window touched (the other half of a GAN step, say)
        // sends nothing: every rank runs the same graph, so every rank skips it alike.
        if self.sums.iter().all(Option::is_none) {
            return Ok(false);
        }
        let (comm, inv_scale) = (end.comm, end.inv_scale);
        let world = comm.world_size();
        let synced = self.synced_dropping_others();
        let bucket_bytes = end.settings.bucket_bytes();
        if world > 1 && self.buffers.fits(&self.sums) {
            let work = Work {
                sums: &mut self.sums,
                master: &self.master,
                position: end.position,
                finish: Finish {
                    inv_world: 1.0 / world as f32,
                    inv_scale: (inv_scale != 1.0).then_some(inv_scale as f32),
                },
                check_overflow: end.check_overflow,
            };
            return self.buffers.sync(comm, work, &synced, bucket_bytes, store);
        }
        // The synced variables' sums, in order; frozen ones move nothing.
        let mut grads: Vec<Tensor> = Vec::with_capacity(synced.len());
        let mut present: Vec<(usize, bool)> = Vec::with_capacity(synced.len());
        for &i in &synced {
            let var = &self.master[i];
            match self.sums[i].take() {
                Some(g) => {
                    grads.push(g);
                    present.push((i, true));
                }
                // Every rank must send the same layout, so an unused variable sends zeros.
                None if world > 1 => {
                    grads.push(Tensor::zeros(var.shape(), DType::F32, var.device())?);
                    present.push((i, false));
                }
                None => {}
            }
        }
        if world > 1 {
            all_reduce_bucketed(comm, &mut grads, bucket_bytes, end.position)?;
        }
        let mut overflow = false;
        for ((i, keep), mut g) in present.into_iter().zip(grads) {
            if !keep {
                continue;
            }
            if inv_scale != 1.0 {
                g = (g * inv_scale)?;
            }
            if end.check_overflow && !overflow {
                overflow = !g.sum_all()?.to_scalar::<f32>()?.is_finite();
            }
            store.insert(self.master[i].as_tensor(), g);
        }
        Ok(overflow)
    }
}
