//! Buffers: model state that is not a parameter.
//!
//! A *buffer* is a variable of a prepared model that the forward writes and no gradient
//! reaches: BatchNorm's running statistics, a step counter, a user's moving average. candle
//! keeps them as variables of the model's `VarMap`, beside the weights, so ivme tells them
//! apart: by candle's names for BatchNorm's statistics (`running_mean`, `running_var`,
//! `num_batches_tracked`) and by [`Accelerator::register_buffer`].
//!
//! A buffer's value lives in the model's variable (what the forward reads and writes), never
//! in a master: at the end of every accumulation window the buffers of the models that window
//! trained are brought to agreement across processes ([`BufferSync`]), with one collective for
//! all of a model's buffers, and then *mirrored* into their masters (the f32 master, or this
//! process's slice under sharding), so that checkpoints, `save_model` and a resume hold the
//! value the ranks agree on. Nothing is ever written from a master into a buffer during
//! training: the sharded all-gather and the low-precision refresh both skip them.

use crate::accelerator::Accelerator;
use crate::comm::{Communicator, ReduceOp};
use crate::config::BufferSync;
use crate::error::{Error, Result};
use crate::grads::ParamSet;
use candle_core::{DType, Tensor, Var};

/// The last name segments candle gives the state its layers keep outside the weights.
const CANDLE_BUFFER_NAMES: &[&str] = &["running_mean", "running_var", "num_batches_tracked"];

/// Whether `name` is one of the statistics candle's BatchNorm keeps (by its last segment).
pub(crate) fn is_batch_norm_statistic(name: &str) -> bool {
    let last = name.rsplit('.').next().unwrap_or(name);
    CANDLE_BUFFER_NAMES.contains(&last)
}

impl ParamSet {
    /// The names of this model's buffers, in name order.
    pub(crate) fn buffer_names(&self) -> impl Iterator<Item = &str> {
        self.names
            .iter()
            .zip(&self.buffer)
            .filter(|(_, b)| **b)
            .map(|(n, _)| n.as_str())
    }

    /// Brings this model's buffers to agreement across processes as `mode` says (one
    /// collective for all of them), then mirrors them into their masters.
    pub(crate) fn sync_buffers(&self, comm: &dyn Communicator, mode: BufferSync) -> Result<()> {
        let idx: Vec<usize> = (0..self.buffer.len()).filter(|&i| self.buffer[i]).collect();
        if idx.is_empty() {
            return Ok(());
        }
        let world = comm.world_size();
        if world > 1 && mode != BufferSync::Local {
            // MPI has no half types: the buffers travel as f32 (exact for bf16/f16 values).
            let flat = idx
                .iter()
                .map(|&i| {
                    self.compute[i]
                        .as_tensor()
                        .flatten_all()?
                        .to_dtype(DType::F32)
                })
                .collect::<candle_core::Result<Vec<Tensor>>>()?;
            let all = Tensor::cat(&flat, 0)?;
            let agreed = match mode {
                BufferSync::Broadcast => comm.broadcast(&all, 0)?,
                _ => (comm.all_reduce(&all, ReduceOp::Sum)? / world as f64)?,
            };
            let mut at = 0;
            for &i in &idx {
                let var = &self.compute[i];
                let n = var.elem_count();
                let value = agreed.narrow(0, at, n)?.reshape(var.dims())?;
                var.set(&value.to_dtype(var.dtype())?)?;
                at += n;
            }
        }
        self.mirror_buffers()
    }

    /// Writes each buffer's current value into its master (the f32 master, or this process's
    /// pieces of it under sharding), so that what is saved is what the model holds.
    pub(crate) fn mirror_buffers(&self) -> Result<()> {
        for i in (0..self.buffer.len()).filter(|&i| self.buffer[i]) {
            let value = self.compute[i].as_tensor();
            match &self.shard {
                Some(shard) => {
                    let flat = value.flatten_all()?.to_dtype(DType::F32)?;
                    for (p, m) in shard.plan.pieces.iter().zip(&shard.masters) {
                        if p.param == i {
                            m.set(&flat.narrow(0, p.from, p.len)?)?;
                        }
                    }
                }
                None => {
                    let master = &self.master[i];
                    if master.as_tensor().id() != value.id() {
                        master.set(&value.to_dtype(DType::F32)?)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// At the end of this model's first window: the variables no gradient reached whose
    /// value the forward changed (it differs from the master, or from rank 0's) are buffers
    /// nobody declared (a user's counter or moving average held in the `VarMap`); they become
    /// buffers from now on, so they are neither reset from a master nor left to drift apart.
    /// Returns their names. Every process calls it (one broadcast and one small all-reduce
    /// when some variable got no gradient; nothing otherwise).
    pub(crate) fn adopt_undeclared_buffers(
        &mut self,
        comm: &dyn Communicator,
    ) -> Result<Vec<String>> {
        if std::mem::replace(&mut self.probed, true) {
            return Ok(Vec::new());
        }
        let candidates: Vec<usize> = (0..self.names.len())
            .filter(|&i| !self.buffer[i] && self.sums[i].is_none())
            .collect();
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        let differ = |a: &Tensor, b: &Tensor| -> Result<bool> {
            Ok(a.ne(b)?
                .to_dtype(DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()?
                > 0.0)
        };
        let mut changed = Vec::with_capacity(candidates.len());
        let mut flat = Vec::with_capacity(candidates.len());
        for &i in &candidates {
            let value = self.compute[i]
                .as_tensor()
                .flatten_all()?
                .to_dtype(DType::F32)?;
            let mut moved = false;
            match &self.shard {
                Some(shard) => {
                    for (p, m) in shard.plan.pieces.iter().zip(&shard.masters) {
                        if p.param == i {
                            let dt = self.compute[i].dtype();
                            let rounded = m.as_tensor().to_dtype(dt)?.to_dtype(DType::F32)?;
                            moved |= differ(&value.narrow(0, p.from, p.len)?, &rounded)?;
                        }
                    }
                }
                None if self.master[i].as_tensor().id() != self.compute[i].as_tensor().id() => {
                    let master = self.master[i].as_tensor().flatten_all()?;
                    let rounded = master
                        .to_dtype(self.compute[i].dtype())?
                        .to_dtype(DType::F32)?;
                    moved = differ(&value, &rounded)?;
                }
                None => {}
            }
            changed.push(moved);
            flat.push(value);
        }
        if comm.world_size() > 1 {
            let mine = Tensor::cat(&flat, 0)?;
            let root = comm.broadcast(&mine, 0)?;
            let mut at = 0;
            for (k, v) in flat.iter().enumerate() {
                let n = v.elem_count();
                changed[k] |= differ(v, &root.narrow(0, at, n)?)?;
                at += n;
            }
            let flags: Vec<f32> = changed.iter().map(|c| f32::from(u8::from(*c))).collect();
            let n = flags.len();
            let any = comm
                .all_reduce(
                    &Tensor::from_vec(flags, n, &candle_core::Device::Cpu)?,
                    ReduceOp::Max,
                )?
                .to_vec1::<f32>()?;
            for (c, a) in changed.iter_mut().zip(any) {
                *c = a > 0.0;
            }
        }
        let mut adopted = Vec::new();
        for (&i, c) in candidates.iter().zip(changed) {
            if c {
                self.buffer[i] = true;
                adopted.push(self.names[i].clone());
            }
        }
        Ok(adopted)
    }

    /// Refuses a gradient that reached a buffer: the variable is not what its name says.
    pub(crate) fn refuse_buffer_gradient(&self, i: usize) -> Result<()> {
        Err(Error::Prepare(format!(
            "`{}` is treated as a buffer (state the forward writes, which no optimizer steps: {}) \
             but the loss reached it with a gradient; rename the parameter, or do not register \
             it as a buffer",
            self.names[i],
            if is_batch_norm_statistic(&self.names[i]) {
                "its name is one of BatchNorm's running statistics"
            } else {
                "it was registered with `register_buffer`"
            }
        )))
    }
}

impl Accelerator {
    /// Marks `var` as a buffer of its model: state the forward writes and no optimizer steps
    /// (a counter, a moving average), kept equal across processes as the
    /// [`buffers`](crate::AcceleratorBuilder::buffers) setting says, saved and resumed with
    /// the model, and never overwritten from a master weight. BatchNorm's running statistics
    /// are buffers without this call. Call it before or after preparing the model, before
    /// the first backward.
    ///
    /// ```no_run
    /// # fn main() -> ivme::Result<()> {
    /// let mut accelerator = ivme::Accelerator::new()?;
    /// let varmap = candle_nn::VarMap::new();
    /// let vb = accelerator.var_builder(&varmap, candle_core::DType::F32);
    /// let seen = vb.get_with_hints(1, "seen", candle_nn::Init::Const(0.0))?;
    /// accelerator.register_buffer(&candle_core::Var::from_tensor(&seen)?)?;
    /// # Ok(()) }
    /// ```
    pub fn register_buffer(&mut self, var: &Var) -> Result<()> {
        let id = var.as_tensor().id();
        for m in self.training.models_mut() {
            if let Some(i) = m.compute.iter().position(|c| c.as_tensor().id() == id) {
                m.buffer[i] = true;
                return Ok(());
            }
        }
        self.training.add_pending_buffer(id);
        Ok(())
    }

    /// The buffers of every prepared model, by name, model by model in name order.
    pub fn buffer_names(&self) -> Vec<String> {
        self.training
            .models()
            .iter()
            .flat_map(|m| m.buffer_names().map(str::to_string))
            .collect()
    }

    /// Brings the buffers of the models this window trained to agreement (see the module
    /// docs); every process calls it at the end of each window.
    pub(crate) fn end_window_buffers(&mut self, touched: &[bool]) -> Result<()> {
        let mode = self.sync.buffers();
        let main = self.is_main_process();
        for m in self.training.touched_mut(touched) {
            let adopted = m.adopt_undeclared_buffers(&self.comm)?;
            if main && !adopted.is_empty() {
                // Printed, as the builder's warnings are: it changes what trains.
                eprintln!(
                    "ivme: {} received no gradient but changed in the forward, so they are kept \
                     as buffers (agreed across processes as `buffers = {mode}` says, never \
                     stepped); call `accelerator.register_buffer(&var)` to say so and silence \
                     this",
                    adopted.join(", ")
                );
            }
            m.sync_buffers(&self.comm, mode)?;
        }
        Ok(())
    }
}
