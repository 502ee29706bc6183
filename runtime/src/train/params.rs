//! A prepared model's parameters as the training step holds them: the variables it computes
//! with, their f32 masters, which of them train or are buffers, and the window's running sums.
//! The fields are the train folder's own; the facade asks through the methods below.

use crate::error::Result;
use crate::optim::parts::PartStepper;
use crate::train::bucket::SyncBuffers;
use crate::train::shard::Sharded;
use crate::train::sync::gathered::Units;
use std::cell::RefCell;
use std::rc::Rc;

pub(crate) use crate::train::params_prepare::NewVariable;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, TensorId, Var};

/// The variables of one prepared model, ordered by name so every rank lays buffers out alike.
#[derive(Debug)]
pub(crate) struct ParamSet {
    /// Variable names, sorted.
    pub(in crate::train) names: Vec<String>,
    /// The variables the model computes with (low precision under fp16/bf16).
    pub(in crate::train) compute: Vec<Var>,
    /// The f32 master variables the optimizer updates (the same as `compute` in f32 runs).
    pub(in crate::train) master: Vec<Var>,
    /// Whether each variable is a buffer (state the forward writes; buffers.rs), not a
    /// parameter.
    pub(in crate::train) buffer: Vec<bool>,
    /// Whether a prepared optimizer steps each variable (clipping measures only those).
    pub(in crate::train) trained: Vec<bool>,
    /// Whether the end of the first window looked for buffers nobody declared (buffers.rs).
    pub(in crate::train) probed: bool,
    /// Frozen variables that received a gradient (dropped): parameters, not buffers, so the
    /// first window's probe for undeclared buffers leaves them out.
    pub(in crate::train) reached: Vec<bool>,
    /// Running sums of gradients within the current window, in f32.
    pub(in crate::train) sums: Vec<Option<Tensor>>,
    /// The persistent buffers of the allocation-free sync.
    pub(in crate::train) buffers: SyncBuffers,
    /// This process's slice of the model under sharding (shard.rs).
    pub(in crate::train) shard: Option<Sharded>,
    /// Under stage 3, the units whose weights are gathered per segment (sync/gathered.rs),
    /// shared with the thread's `Gathering`.
    pub(in crate::train) units: Option<Rc<RefCell<Units>>>,
    /// Under `overlap`, the model's optimizer, stepped in parts inside `backward`
    /// (overlap.rs).
    pub(in crate::train) overlap: Option<PartStepper>,
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

    /// Under stage 3, the units whose weights are gathered per segment (sync/gathered.rs).
    pub(crate) fn units(&self) -> Option<std::cell::Ref<'_, Units>> {
        Some(self.units.as_ref()?.borrow())
    }

    /// Gives this stage-3 model its units.
    pub(crate) fn set_units(&mut self, units: Rc<RefCell<Units>>) {
        self.units = Some(units);
    }

    /// Whether variable `i` belongs to a stage-3 unit (its weights are gathered on demand).
    pub(crate) fn in_unit(&self, i: usize) -> bool {
        self.units().is_some_and(|u| u.member(i))
    }

    /// Adds this backward's gradients to the window's sums; returns whether any variable of
    /// this set received a gradient (a stage-3 unit's arrived during the backward itself).
    pub(crate) fn accumulate(&mut self, store: &GradStore) -> Result<bool> {
        let mut any = self
            .units
            .as_ref()
            .is_some_and(|u| u.borrow_mut().took_fresh());
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

    /// `Some(sum)` when `id` is one of this model's variables (computed with, or master):
    /// its window sum so far, `None` inside when no backward of the window reached it.
    pub(crate) fn window_sum(&self, id: TensorId) -> Option<Option<&Tensor>> {
        let i = self
            .compute
            .iter()
            .zip(&self.master)
            .position(|(c, m)| c.as_tensor().id() == id || m.as_tensor().id() == id)?;
        Some(self.sums[i].as_ref())
    }

    /// The variable names, sorted.
    pub(crate) fn names(&self) -> &[String] {
        &self.names
    }

    /// Whether variable `i` is a parameter a prepared optimizer steps (not a buffer).
    pub(crate) fn trains(&self, i: usize) -> bool {
        self.trained[i] && !self.buffer[i]
    }

    /// Marks the variable `id` (one the model computes with) as a buffer; false when it is not
    /// this model's.
    pub(crate) fn mark_buffer(&mut self, id: TensorId) -> bool {
        let Some(i) = self.compute.iter().position(|c| c.as_tensor().id() == id) else {
            return false;
        };
        self.buffer[i] = true;
        if let Some(units) = &self.units {
            units.borrow_mut().mark_buffer(i);
        }
        true
    }

    /// Parameters (buffers left out) that train and that are frozen, in elements, and how many
    /// variables are frozen.
    pub(crate) fn parameter_counts(&self) -> (usize, usize, usize) {
        let (mut trained, mut frozen, mut vars) = (0, 0, 0);
        for (i, v) in self.master.iter().enumerate() {
            if self.buffer[i] {
                continue;
            }
            if self.trained[i] {
                trained += v.elem_count();
            } else {
                frozen += v.elem_count();
                vars += 1;
            }
        }
        (trained, frozen, vars)
    }

    /// Bytes this process holds for the model: the weights it computes with, the f32 masters
    /// kept beside them (this process's slice under sharding), and the window's gradient sums
    /// with the sync's buffers.
    pub(crate) fn held_bytes(&self) -> (usize, usize, usize) {
        use crate::observe::memory::bytes;
        let units = self.units();
        let freed = |i: usize| units.as_ref().is_some_and(|u| u.released(i));
        let weights = (0..self.compute.len())
            .filter(|&i| !freed(i))
            .map(|i| bytes(self.compute[i].as_tensor()))
            .sum();
        let masters = match &self.shard {
            Some(s) => s
                .masters
                .iter()
                .zip(&s.aliased)
                .filter(|(_, aliased)| !**aliased)
                .map(|(v, _)| bytes(v.as_tensor()))
                .sum(),
            None => self
                .compute
                .iter()
                .zip(&self.master)
                .filter(|(c, m)| c.as_tensor().id() != m.as_tensor().id())
                .map(|(_, m)| bytes(m.as_tensor()))
                .sum(),
        };
        let sums: usize = self.sums.iter().flatten().map(bytes).sum();
        (weights, masters, sums + self.buffers.bytes())
    }
}
