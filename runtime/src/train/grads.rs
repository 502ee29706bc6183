//! Gradients: accumulation over micro-batches, bucketed averaging across processes,
//! unscaling, overflow detection and clipping.

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::optim::parts::PartStepper;
use crate::setup::config::Sharding;
pub use crate::train::bucket::all_reduce_bucketed;
use crate::train::bucket::{Finish, SyncBuffers};
use crate::train::shard::{Partial, Sharded};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

pub use crate::train::window::{GradientState, MicroStep};

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
        self.refuse_if_stepped("clip_grad_norm")?;
        if max_norm <= 0.0 || norm_type <= 0.0 || norm_type.is_nan() {
            return Err(Error::config(
                "clip_grad_norm",
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
        self.refuse_if_stepped("clip_grad_value")?;
        if limit <= 0.0 || limit.is_nan() {
            return Err(Error::config(
                "clip_grad_value",
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

/// The variables of one prepared model, ordered by name so every rank lays buffers out alike.
#[derive(Debug)]
pub struct ParamSet {
    /// Variable names, sorted.
    pub names: Vec<String>,
    /// The variables the model computes with (low precision under fp16/bf16).
    pub compute: Vec<Var>,
    /// The f32 master variables the optimizer updates (the same as `compute` in f32 runs).
    pub master: Vec<Var>,
    /// Whether each variable is a buffer (state the forward writes; buffers.rs), not a
    /// parameter.
    pub(crate) buffer: Vec<bool>,
    /// Whether a prepared optimizer steps each variable (clipping measures only those).
    pub(crate) trained: Vec<bool>,
    /// Whether the end of the first window looked for buffers nobody declared (buffers.rs).
    pub(crate) probed: bool,
    /// Frozen variables that received a gradient (dropped): parameters, not buffers, so the
    /// first window's probe for undeclared buffers leaves them out.
    pub(crate) reached: Vec<bool>,
    /// Running sums of gradients within the current window, in f32.
    pub(crate) sums: Vec<Option<Tensor>>,
    /// The persistent buffers of the allocation-free sync.
    pub(crate) buffers: SyncBuffers,
    /// This process's slice of the model under sharding (shard.rs).
    pub(crate) shard: Option<Sharded>,
    /// Under `overlap`, the model's optimizer, stepped in parts inside `backward`
    /// (overlap.rs).
    pub(crate) overlap: Option<PartStepper>,
}

impl ParamSet {
    /// The indices of the variables whose gradients are synced: those a prepared optimizer
    /// holds, or all of them while none holds any (a model whose gradients the program uses
    /// itself).
    pub(crate) fn synced(&self) -> Vec<usize> {
        let some_trained = self.trained.iter().any(|t| *t);
        (0..self.trained.len())
            .filter(|&i| self.trained[i] || !some_trained)
            .collect()
    }

    /// [`synced`](Self::synced), after dropping the window sums of the others: a frozen
    /// variable's sum (one a checkpoint saved before its optimizer was prepared, say) is not
    /// kept across windows.
    pub(crate) fn synced_dropping_others(&mut self) -> Vec<usize> {
        let synced = self.synced();
        if synced.len() < self.sums.len() {
            let mut keep = vec![false; self.sums.len()];
            synced.iter().for_each(|&i| keep[i] = true);
            for (sum, k) in self.sums.iter_mut().zip(keep) {
                if !k {
                    *sum = None;
                }
            }
        }
        synced
    }

    /// The names of the variables a prepared optimizer steps, buffers left out.
    pub(crate) fn trained_names(&self) -> impl Iterator<Item = &str> {
        self.names
            .iter()
            .zip(self.trained.iter().zip(&self.buffer))
            .filter(|(_, (t, b))| **t && !**b)
            .map(|(n, _)| n.as_str())
    }

    /// The names of the variables no prepared optimizer steps that are not buffers.
    pub(crate) fn frozen_names(&self) -> impl Iterator<Item = &str> {
        self.names
            .iter()
            .zip(self.trained.iter().zip(&self.buffer))
            .filter(|(_, (t, b))| !**t && !**b)
            .map(|(n, _)| n.as_str())
    }

    /// Whether the model computes with separate low-precision copies.
    pub fn has_copies(&self) -> bool {
        self.compute
            .iter()
            .zip(&self.master)
            .any(|(c, m)| c.as_tensor().id() != m.as_tensor().id())
    }

    /// Adds this backward's gradients to the window's sums; returns whether any variable of
    /// this set received a gradient.
    pub(crate) fn accumulate(&mut self, store: &GradStore) -> Result<bool> {
        let mut any = false;
        let some_trained = self.trained.iter().any(|t| *t);
        for (i, (var, sum)) in self.compute.iter().zip(self.sums.iter_mut()).enumerate() {
            if let Some(g) = store.get(var.as_tensor()) {
                if self.buffer[i] {
                    return self.refuse_buffer_gradient(i).map(|_| false);
                }
                // A frozen variable's gradient (candle computes it anyway) is not summed,
                // synced or returned: nothing steps it.
                if some_trained && !self.trained[i] {
                    self.reached[i] = true;
                    continue;
                }
                let g = if g.dtype() == DType::F32 {
                    g.clone()
                } else {
                    g.to_dtype(DType::F32)?
                };
                *sum = Some(match sum.take() {
                    Some(s) => (s + g)?,
                    None => g,
                });
                any = true;
            }
        }
        Ok(any)
    }

    /// Ends the window for a sharded model: the mean gradient of each of this process's
    /// pieces into `store` (keyed by the piece masters), and this process's share of the
    /// overflow check and (with `want_norm`, for clipping) of the squared norm. Stage 1
    /// averages whole gradients as [`take_synced`](Self::take_synced) does, then slices them;
    /// stage 2 reduce-scatters the window sums (shard.rs) when there is more than one process.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn take_sharded(
        &mut self,
        comm: &dyn Communicator,
        position: u64,
        bucket_bytes: usize,
        inv_scale: f64,
        check_overflow: bool,
        want_norm: bool,
        store: &mut GradStore,
    ) -> Result<Partial> {
        let stage = self.shard.as_ref().map(|s| s.stage);
        // On one process the slice is the whole model and stage 2's reduce-scatter would only
        // copy every gradient twice: both stages take the whole mean in place.
        if stage == Some(Sharding::Optimizer) || comm.world_size() == 1 {
            let mut full = GradStore::default();
            let overflow = self.take_synced(
                comm,
                position,
                bucket_bytes,
                inv_scale,
                check_overflow,
                &mut full,
            )?;
            let shard = self.shard.as_ref().expect("a sharded model");
            let partial = shard.slice_whole(&full, &self.master, want_norm, store)?;
            return Ok(Partial {
                overflow,
                ..partial
            });
        }
        let shard = self.shard.as_ref().expect("a sharded model");
        shard.reduce_scatter(
            comm,
            position,
            bucket_bytes,
            &mut self.buffers,
            &mut self.sums,
            inv_scale,
            check_overflow,
            want_norm,
            store,
        )
    }

    /// Ends the window: averages the sums across processes (bucketed), unscales them, and
    /// returns them keyed by master variable plus whether any value is inf/NaN.
    pub(crate) fn take_synced(
        &mut self,
        comm: &dyn Communicator,
        position: u64,
        bucket_bytes: usize,
        inv_scale: f64,
        check_overflow: bool,
        store: &mut GradStore,
    ) -> Result<bool> {
        // A model no backward of this window touched (the other half of a GAN step, say)
        // sends nothing: every rank runs the same graph, so every rank skips it alike.
        if self.sums.iter().all(Option::is_none) {
            return Ok(false);
        }
        let world = comm.world_size();
        let synced = self.synced_dropping_others();
        if world > 1 && self.buffers.fits(&self.sums) {
            let finish = Finish {
                inv_world: 1.0 / world as f32,
                inv_scale: (inv_scale != 1.0).then_some(inv_scale as f32),
            };
            return self.buffers.sync(
                comm,
                &mut self.sums,
                &self.master,
                &synced,
                position,
                bucket_bytes,
                finish,
                check_overflow,
                store,
            );
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
            all_reduce_bucketed(comm, &mut grads, bucket_bytes, position)?;
        }
        let mut overflow = false;
        for ((i, keep), mut g) in present.into_iter().zip(grads) {
            if !keep {
                continue;
            }
            let var = &self.master[i];
            if inv_scale != 1.0 {
                g = (g * inv_scale)?;
            }
            if check_overflow && !overflow {
                overflow = !g.sum_all()?.to_scalar::<f32>()?.is_finite();
            }
            store.insert(var.as_tensor(), g);
        }
        Ok(overflow)
    }
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
