//! Gradients: accumulation over micro-batches, bucketed averaging across processes,
//! unscaling, overflow detection and clipping.

use crate::comm::Communicator;
use crate::data::StepObserver;
use crate::error::{Error, Result};
pub use crate::train::bucket::all_reduce_bucketed;
use crate::train::bucket::{Finish, SyncBuffers};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use std::sync::Mutex;

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
}

impl Gradients {
    pub(crate) fn accumulating() -> Self {
        Gradients {
            store: GradStore::default(),
            sync: false,
            overflow: false,
            norm: None,
        }
    }

    pub(crate) fn synced(store: GradStore, overflow: bool) -> Self {
        Gradients {
            store,
            sync: true,
            overflow,
            norm: None,
        }
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

/// Where the current micro-batch sits in its accumulation window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MicroStep {
    /// Number of micro-batches in this window (shorter for a last, partial window).
    pub window: usize,
    /// Whether this micro-batch ends its window (gradients are synced and applied).
    pub sync: bool,
}

#[derive(Debug, Default)]
struct Cursor {
    // Set once a prepared loader (or `Accelerator::micro_step`) reports batches: from then on
    // the data says where windows end, which is what makes a short last window exact.
    data_driven: bool,
    pending: Option<MicroStep>,
    // Without data reports, each backward call is the next micro-batch.
    auto_index: u64,
    // Padding samples at the end of the batch handed out last (for gather_for_metrics).
    last_padding: usize,
    // The index in its epoch of the batch a data source handed out last, plus one (0: none).
    last_batch: u64,
}

/// Tracks accumulation windows for one Accelerator.
#[derive(Debug)]
pub struct GradientState {
    accum: usize,
    cursor: Mutex<Cursor>,
}

impl GradientState {
    /// A state for windows of `accum` micro-batches.
    pub fn new(accum: usize) -> Self {
        GradientState {
            accum: accum.max(1),
            cursor: Mutex::new(Cursor::default()),
        }
    }

    /// The configured window length.
    pub fn accum(&self) -> usize {
        self.accum
    }

    /// Where batch `index` of `total` sits: windows start at multiples of the window length
    /// and the last one may be shorter.
    pub fn locate(accum: usize, index: usize, total: usize) -> MicroStep {
        let start = index - index % accum;
        let window = accum.min(total.saturating_sub(start)).max(1);
        MicroStep {
            window,
            sync: index % accum == accum - 1 || index + 1 >= total,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cursor> {
        // A poisoned lock only means another thread panicked mid-update of plain integers.
        self.cursor.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The micro-step the next backward belongs to, without consuming it.
    pub fn peek(&self) -> MicroStep {
        let c = self.lock();
        match (c.data_driven, c.pending) {
            (true, Some(s)) => s,
            _ => {
                let pos = (c.auto_index % self.accum as u64) as usize;
                MicroStep {
                    window: self.accum,
                    sync: pos == self.accum - 1,
                }
            }
        }
    }

    /// The micro-step a backward call belongs to; advances the automatic counter when no
    /// data source drives the windows.
    pub(crate) fn for_backward(&self) -> MicroStep {
        let step = self.peek();
        let mut c = self.lock();
        if !(c.data_driven && c.pending.is_some()) {
            c.auto_index += 1;
        }
        step
    }

    /// Padding samples at the end of the batch a prepared data source handed out last.
    pub fn last_padding(&self) -> usize {
        self.lock().last_padding
    }

    /// Where the data stands, for the cross-rank check of the gradient sync: the index of the
    /// batch handed out last plus one (0 when no data source reports batches), combined with
    /// the automatic micro-step counter. Equal on every rank of a program in step.
    pub fn position(&self) -> u64 {
        let c = self.lock();
        c.last_batch ^ c.auto_index.rotate_left(32)
    }

    /// The automatic micro-step counter (for checkpoints).
    pub fn auto_index(&self) -> u64 {
        self.lock().auto_index
    }

    /// Restores the automatic micro-step counter.
    pub fn set_auto_index(&self, i: u64) {
        self.lock().auto_index = i;
    }
}

impl StepObserver for GradientState {
    fn on_batch(&self, index: usize, batches_in_epoch: usize, padding: usize) {
        let step = Self::locate(self.accum, index, batches_in_epoch);
        let mut c = self.lock();
        c.data_driven = true;
        c.pending = Some(step);
        c.last_padding = padding;
        c.last_batch = index as u64 + 1;
    }
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
    /// Running sums of gradients within the current window, in f32.
    pub(crate) sums: Vec<Option<Tensor>>,
    /// The persistent buffers of the allocation-free sync.
    pub(crate) buffers: SyncBuffers,
    /// This process's slice of the model under sharding (shard.rs).
    pub(crate) shard: Option<crate::train::shard::Sharded>,
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
        let synced = self.synced();
        if synced.len() < self.sums.len() {
            // A frozen variable's sum (one a checkpoint saved before its optimizer was
            // prepared, say) is dropped, not kept across windows.
            let mut keep = vec![false; self.sums.len()];
            synced.iter().for_each(|&i| keep[i] = true);
            for (sum, k) in self.sums.iter_mut().zip(keep) {
                if !k {
                    *sum = None;
                }
            }
        }
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
    fn windows_are_full_then_short_at_the_end() {
        let l = |i, n| GradientState::locate(3, i, n);
        assert_eq!(
            l(0, 4),
            MicroStep {
                window: 3,
                sync: false
            }
        );
        assert_eq!(
            l(2, 4),
            MicroStep {
                window: 3,
                sync: true
            }
        );
        assert_eq!(
            l(3, 4),
            MicroStep {
                window: 1,
                sync: true
            }
        );
        assert_eq!(
            GradientState::locate(2, 4, 5),
            MicroStep {
                window: 1,
                sync: true
            }
        );
        assert_eq!(
            GradientState::locate(1, 0, 5),
            MicroStep {
                window: 1,
                sync: true
            }
        );
    }

    #[test]
    fn without_data_every_backward_is_the_next_micro_step() {
        let s = GradientState::new(2);
        assert!(!s.for_backward().sync);
        assert!(s.for_backward().sync);
        assert!(!s.for_backward().sync);
    }

    #[test]
    fn data_reports_drive_the_windows() {
        let s = GradientState::new(3);
        s.on_batch(3, 4, 0);
        assert_eq!(
            s.for_backward(),
            MicroStep {
                window: 1,
                sync: true
            }
        );
        // A second backward on the same batch (a second model) is the same micro-step.
        assert_eq!(
            s.for_backward(),
            MicroStep {
                window: 1,
                sync: true
            }
        );
    }

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
