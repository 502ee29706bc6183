//! The sharded end of a window (ZeRO stages 1, 2 and 3): each process ends with its slice of
//! the mean gradient (stage 1 slices the whole mean, stage 2 reduce-scatters the window sums,
//! `scatter.rs`; stage 3 adds its units' slices, reduce-scattered during backward,
//! `gathered.rs`), the processes agree on the global norm and on overflow, and each steps its
//! optimizer over its slice and gathers the updated weights back into every process's model
//! (the units' excepted: their segments gather them).

use super::WindowEnd;
use crate::comm::ReduceOp;
use crate::error::{Error, Result};
use crate::optim::gradients::Gradients;
use crate::setup::config::Sharding;
use crate::train::params::ParamSet;
use crate::train::shard::{scale_all, Partial};
use crate::train::training::Training;
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor};

/// Ends a sharded window: the slices' mean gradients, agreed overflow and global norm,
/// clipped, then each touched model's optimizer stepped over its slice and the weights
/// gathered.
pub(super) fn end(training: &mut Training, end: &WindowEnd, touched: &[bool]) -> Result<Gradients> {
    let settings = end.settings;
    let need_norm = settings.clip_norm().is_some();
    let mut store = GradStore::default();
    let (mut overflow, mut squares) = (false, 0.0);
    for m in training.touched_mut(touched) {
        let p = m.take_sharded(end, need_norm, &mut store)?;
        overflow |= p.overflow;
        squares += p.squares;
    }
    // One small collective for what the slices cannot know alone: the global norm, and
    // (stage 2) whether any slice overflowed.
    let stage2 = matches!(
        settings.sharding(),
        Sharding::Gradients | Sharding::Parameters
    );
    if end.comm.world_size() > 1 && (need_norm || (stage2 && end.check_overflow)) {
        let local = Tensor::new(
            &[squares as f32, if overflow { 1.0 } else { 0.0 }],
            &Device::Cpu,
        )?;
        let agreed = end
            .comm
            .all_reduce(&local, ReduceOp::Sum)?
            .to_vec1::<f32>()?;
        squares = agreed[0] as f64;
        overflow = agreed[1] > 0.0;
    }
    let norm = need_norm.then(|| squares.sqrt());
    if overflow {
        return Ok(Gradients::synced(store, true).with_norm(norm));
    }
    if let (Some(max), Some(total)) = (settings.clip_norm(), norm) {
        // The same coefficient as the unsharded clip: max / (norm + 1e-6), at most 1.
        let coef = (max / (total + 1e-6)).min(1.0);
        if coef < 1.0 {
            scale_all(&mut store, training.shards(), |g| g * coef)?;
        }
    }
    if let Some(v) = settings.clip_value() {
        scale_all(&mut store, training.shards(), |g| g.clamp(-v, v))?;
    }
    for m in training.touched_mut(touched) {
        m.step_slice(end, &mut store)?;
    }
    Ok(Gradients::synced(store, false).with_norm(norm))
}

impl ParamSet {
    /// Ends the window for a sharded model: the mean gradient of each of this process's
    /// pieces into `store` (keyed by the piece masters), and this process's share of the
    /// overflow check and (with `want_norm`, for clipping) of the squared norm. Stage 1
    /// averages whole gradients as the replicated end does, then slices them; stage 2
    /// reduce-scatters the window sums (`scatter.rs`) when there is more than one process.
    fn take_sharded(
        &mut self,
        end: &WindowEnd,
        want_norm: bool,
        store: &mut GradStore,
    ) -> Result<Partial> {
        let stage = self.shard.as_ref().map(|s| s.stage);
        // On one process the slice is the whole model and stage 2's reduce-scatter would only
        // copy every gradient twice: both stages take the whole mean in place.
        let partial = if stage == Some(Sharding::Optimizer) || end.comm.world_size() == 1 {
            let mut full = GradStore::default();
            let overflow = self.take_synced(end, &mut full)?;
            let shard = self.shard.as_ref().expect("a sharded model");
            let partial = shard.slice_whole(&full, &self.master, want_norm, store)?;
            Partial {
                overflow,
                ..partial
            }
        } else {
            let shard = self.shard.as_ref().expect("a sharded model");
            let skip = match &self.units {
                Some(units) => units.borrow().skip_mask(&vec![false; self.sums.len()]),
                None => vec![false; self.sums.len()],
            };
            let (buffers, sums) = (&mut self.buffers, &mut self.sums);
            shard.reduce_scatter(end, buffers, sums, want_norm, &skip, store)?
        };
        // Stage 3: the units' slices were reduce-scattered segment by segment already.
        let Some(units) = &self.units else {
            return Ok(partial);
        };
        let factor = (end.inv_scale / end.comm.world_size() as f64) as f32;
        let more = units
            .borrow_mut()
            .take_means(factor, end.check_overflow, want_norm, store)?;
        Ok(Partial {
            overflow: partial.overflow || more.overflow,
            squares: partial.squares + more.squares,
        })
    }

    /// Steps this model's optimizer over its slice's gradients in `store`, then gathers every
    /// process's updated slice into the model's weights (buffers keep their own value).
    fn step_slice(&mut self, end: &WindowEnd, store: &mut GradStore) -> Result<()> {
        let shard = self.shard.as_mut().expect("a sharded model");
        let Some(step) = shard.stepper.as_mut() else {
            return Err(Error::Prepare(
                "the model is sharded but has no prepared optimizer: prepare its optimizer \
                 (accelerator.prepare((varmap, opt))) before the first optimizer step"
                    .into(),
            ));
        };
        step(store)?;
        shard.forget_runs(store);
        // Stage 3's units are not gathered here: their next segment gathers them.
        let skip = match &self.units {
            Some(units) => units.borrow().skip_mask(&self.buffer),
            None => self.buffer.clone(),
        };
        shard.gather_into(
            end.comm,
            end.settings.bucket_bytes(),
            &self.compute,
            Some(&skip),
        )
    }
}
