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

use crate::comm::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::precision::is_batch_norm_statistic;
use crate::setup::config::BufferSync;
use crate::train::params::ParamSet;
use candle_core::{DType, Tensor};

impl ParamSet {
    /// The names of this model's buffers, in name order.
    pub(crate) fn buffer_names(&self) -> impl Iterator<Item = &str> {
        self.names
            .iter()
            .zip(&self.buffer)
            .filter(|(_, b)| **b)
            .map(|(n, _)| n.as_str())
    }

    /// A copy of each buffer's current value, to be put back by [`Self::restore_buffers`]
    /// (around a checkpointed segment's recompute, which would update them a second time).
    pub(crate) fn buffer_values(&self) -> Result<Vec<(usize, Tensor)>> {
        (0..self.buffer.len())
            .filter(|&i| self.buffer[i])
            .map(|i| Ok((i, self.compute[i].as_tensor().copy()?)))
            .collect()
    }

    /// Puts back the buffer values [`Self::buffer_values`] copied.
    pub(crate) fn restore_buffers(&self, values: &[(usize, Tensor)]) -> Result<()> {
        for (i, value) in values {
            self.compute[*i].set(value)?;
        }
        Ok(())
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
                    for (k, p) in shard.plan.pieces.iter().enumerate() {
                        // A master that is the buffer itself holds its value already.
                        if p.param == i && !shard.aliased[k] {
                            shard.set_piece(k, &flat.narrow(0, p.from, p.len)?)?;
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
            .filter(|&i| !self.buffer[i] && self.sums[i].is_none() && !self.reached[i])
            // A stage-3 unit's variables are gathered per segment: they are not buffers.
            .filter(|&i| !self.in_unit(i))
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
                    for (k, p) in shard.plan.pieces.iter().enumerate() {
                        if p.param == i {
                            let dt = self.compute[i].dtype();
                            let rounded = shard.flat(k)?.to_dtype(dt)?.to_dtype(DType::F32)?;
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
