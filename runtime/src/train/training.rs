//! What is being trained: the prepared models, the prepared optimizers and where the
//! accumulation window stands. One part of the [`Accelerator`](crate::Accelerator); the other
//! parts read it through this narrow API and never touch its lists directly.

use crate::comm::Communicator;
use crate::error::Result;
use crate::optim::accelerated::PreparedSlot;
use crate::setup::config::BufferSync;
use crate::stateful::StateDict;
use crate::train::params::ParamSet;
use crate::train::reach::{Reach, Unreached};
use crate::train::window::GradientState;
use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};
use std::sync::Arc;

/// The prepared models and optimizers, in preparation order, and the shared window state.
pub(crate) struct Training {
    models: Vec<ParamSet>,
    optimizers: Vec<Box<dyn PreparedSlot>>,
    window: Arc<GradientState>,
    /// Variables registered as buffers before their model was prepared.
    pending_buffers: Vec<TensorId>,
    /// Whether what trains has been reported (at the first backward).
    reported: bool,
    /// Which trained variables the first backward passes reached (reach.rs).
    reach: Reach,
    /// The trained variables they did not, once known.
    unreached: Option<Unreached>,
}

impl Training {
    /// Nothing prepared yet; windows of `grad_accum` micro-batches.
    pub(crate) fn new(grad_accum: usize) -> Self {
        Training {
            models: Vec::new(),
            optimizers: Vec::new(),
            window: Arc::new(GradientState::new(grad_accum)),
            pending_buffers: Vec::new(),
            reported: false,
            reach: Reach::default(),
            unreached: None,
        }
    }

    /// Notes which variables a backward pass reached; returns, once, the trained variables
    /// the first watched passes never reached (reach.rs).
    pub(crate) fn note_reach(&mut self, store: &GradStore) -> Option<&Unreached> {
        let found = self.reach.note(&self.models, store)?;
        self.unreached = Some(found);
        self.unreached.as_ref()
    }

    /// The trained variables the first backward passes did not reach, once known.
    #[cfg(test)]
    pub(crate) fn unreached(&self) -> Option<&Unreached> {
        self.unreached.as_ref()
    }

    /// True the first time it is asked, false after.
    pub(crate) fn first_report(&mut self) -> bool {
        !std::mem::replace(&mut self.reported, true)
    }

    /// The prepared models, in preparation order.
    pub(crate) fn models(&self) -> &[ParamSet] {
        &self.models
    }

    /// The sharded models' slices.
    pub(crate) fn shards(&self) -> impl Iterator<Item = &crate::train::shard::Sharded> {
        self.models.iter().filter_map(|m| m.shard.as_ref())
    }

    /// The prepared models, to accumulate into or restore.
    pub(crate) fn models_mut(&mut self) -> &mut [ParamSet] {
        &mut self.models
    }

    /// The models a micro-step's loss reached (`touched[i]` for model `i`), to end their
    /// window: another model trained in the same micro-step ends it at its own backward.
    pub(crate) fn touched_mut<'a>(
        &'a mut self,
        touched: &'a [bool],
    ) -> impl Iterator<Item = &'a mut ParamSet> + 'a {
        self.models
            .iter_mut()
            .zip(touched)
            .filter(|(_, t)| **t)
            .map(|(m, _)| m)
    }

    /// Adds a prepared model; it is model `models().len() - 1` from now on.
    pub(crate) fn add_model(&mut self, model: ParamSet) {
        self.models.push(model);
    }

    /// Remembers that the variable `id` is a buffer, for when its model is prepared.
    pub(crate) fn add_pending_buffer(&mut self, id: TensorId) {
        self.pending_buffers.push(id);
    }

    /// Whether the variable `id` was registered as a buffer before its model was prepared.
    pub(crate) fn is_pending_buffer(&self, id: TensorId) -> bool {
        self.pending_buffers.contains(&id)
    }

    /// The prepared optimizers, in preparation order.
    pub(crate) fn optimizers(&self) -> &[Box<dyn PreparedSlot>] {
        &self.optimizers
    }

    /// The prepared optimizers, to restore.
    pub(crate) fn optimizers_mut(&mut self) -> &mut [Box<dyn PreparedSlot>] {
        &mut self.optimizers
    }

    /// Adds a prepared optimizer.
    pub(crate) fn add_optimizer(&mut self, optimizer: Box<dyn PreparedSlot>) {
        self.optimizers.push(optimizer);
    }

    /// Where the accumulation window stands (shared with prepared loaders).
    pub(crate) fn window(&self) -> &Arc<GradientState> {
        &self.window
    }

    /// Real optimizer steps taken so far (the first optimizer's count; 0 before any).
    pub(crate) fn steps(&self) -> u64 {
        self.optimizers.first().map_or(0, |o| o.steps())
    }

    /// The f32 masters clipping measures, model by model in name order: those a prepared
    /// optimizer steps, as PyTorch clips only what has a `.grad` (a frozen variable's gradient,
    /// which candle computes all the same, must not shrink the trained ones); every variable
    /// of a model no optimizer was prepared for.
    pub(crate) fn trained_master_vars(&self) -> Vec<Var> {
        self.models
            .iter()
            .flat_map(|m| {
                let any = m.trained.iter().any(|t| *t);
                m.master
                    .iter()
                    .zip(&m.trained)
                    .filter(move |(_, t)| **t || !any)
                    .map(|(v, _)| v.clone())
            })
            .collect()
    }

    /// (name, f32 master) pairs of every model, model by model in name order.
    pub(crate) fn named_master_vars(&self) -> Vec<(String, Var)> {
        self.models
            .iter()
            .flat_map(|m| m.names.iter().cloned().zip(m.master.iter().cloned()))
            .collect()
    }

    /// A copy of every prepared model's buffers, to put back with [`Self::restore_buffers`].
    pub(crate) fn buffer_values(&self) -> Result<Vec<Vec<(usize, Tensor)>>> {
        self.models.iter().map(ParamSet::buffer_values).collect()
    }

    /// Puts back the buffers [`Self::buffer_values`] copied.
    pub(crate) fn restore_buffers(&self, values: &[Vec<(usize, Tensor)>]) -> Result<()> {
        for (model, values) in self.models.iter().zip(values) {
            model.restore_buffers(values)?;
        }
        Ok(())
    }

    /// Brings the buffers of the models this window trained (`touched`) to agreement as `mode`
    /// says, after adopting as buffers the variables that changed in the forward without a
    /// gradient (warned once, on the main process: it changes what trains).
    pub(crate) fn end_window_buffers(
        &mut self,
        comm: &dyn Communicator,
        mode: BufferSync,
        touched: &[bool],
    ) -> Result<()> {
        let main = comm.rank() == 0;
        for m in self.touched_mut(touched) {
            let adopted = m.adopt_undeclared_buffers(comm)?;
            if main && !adopted.is_empty() {
                warn_user!(
                    "{} received no gradient but changed in the forward, so they are kept \
                     as buffers (agreed across processes as `buffers = {mode}` says, never \
                     stepped); call `accelerator.register_buffer(&var)` to say so and silence \
                     this",
                    adopted.join(", ")
                );
            }
            m.sync_buffers(comm, mode)?;
        }
        Ok(())
    }

    /// The window sum of the variable `id` (the one a model computes with, or its master)
    /// so far, if a backward of the current window reached it.
    pub(crate) fn window_sum(&self, id: TensorId) -> Option<&Tensor> {
        self.models.iter().find_map(|m| m.window_sum(id))?
    }

    /// Each model's saved state (its f32 masters, or this process's slice), in preparation
    /// order.
    pub(crate) fn model_states(&self) -> Result<Vec<StateDict>> {
        self.models.iter().map(ParamSet::state_dict).collect()
    }

    /// Each prepared optimizer's state, in preparation order.
    pub(crate) fn optimizer_states(&self) -> Result<Vec<StateDict>> {
        self.optimizers.iter().map(|o| o.state_dict()).collect()
    }

    /// The window's partial sums so far, `{model}::{variable}`: this rank's own.
    pub(crate) fn window_sums(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (i, m) in self.models.iter().enumerate() {
            for (name, s) in m.window_sums()? {
                out.push((format!("{i}::{name}"), s));
            }
        }
        Ok(out)
    }
}
