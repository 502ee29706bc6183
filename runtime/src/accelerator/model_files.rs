//! The Accelerator's side of Hugging Face model files: the prepared models' weights saved as
//! `model.safetensors` (or shards with an index json) and loaded back on every rank.

use crate::accelerator::Accelerator;
use crate::checkpoint::model::{load_checkpoint_in_model, save_model, LoadReport, ShardSize};
use crate::error::Result;
use crate::train::grads::ParamSet;
use candle_core::{DType, Tensor, Var};
use std::path::Path;

impl Accelerator {
    /// Waits for every process, then the main process writes the models' f32 weights as
    /// `model.safetensors`, or as shards of at most `max_shard_size` ("500MB", "1GB", bytes)
    /// with an index json: the Hugging Face layout.
    pub fn save_model(&self, dir: &Path, max_shard_size: Option<&str>) -> Result<()> {
        let shard = max_shard_size.map(ShardSize::parse).transpose()?;
        self.wait_for_everyone()?;
        // Under sharding the f32 masters are put together from every process's slice (the
        // model's weights may be rounded to the compute dtype).
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        for m in self.training.models() {
            tensors.extend(m.names.iter().cloned().zip(self.whole_masters(m)?));
        }
        let written = if self.is_main_process() {
            save_model(&tensors, dir, shard).map(|_| ())
        } else {
            Ok(())
        };
        self.agree("saving the model", written)
    }

    /// `m`'s f32 master values, whole: put together from every process's slice under sharding
    /// (a collective: every process calls it).
    pub(crate) fn whole_masters(&self, m: &ParamSet) -> Result<Vec<Tensor>> {
        Ok(match &m.shard {
            Some(s) => s.gathered(&self.comm, &m.compute)?,
            None => m.master.iter().map(|v| v.as_tensor().clone()).collect(),
        })
    }

    /// Loads a model file or folder (single or sharded) into the prepared models' weights on
    /// every rank, refreshing their low-precision copies. The f32 masters take the file's
    /// values as they are (under sharding too: each process's slice comes from them, not from
    /// the weights rounded to the compute dtype).
    pub fn load_model(&self, path: &Path) -> Result<LoadReport> {
        self.load_named(path, |m, i| Some(m.names[i].clone()))
    }

    /// Loads the file or folder at `path` into the prepared models' variables that `key`
    /// names (by the name the file holds them under; `None` leaves a variable out), as
    /// [`load_model`](Self::load_model) says.
    pub(crate) fn load_named(
        &self,
        path: &Path,
        key: impl Fn(&ParamSet, usize) -> Option<String>,
    ) -> Result<LoadReport> {
        // Under sharding no process holds whole masters: f32 stand-ins, starting from the
        // current weights, receive the file's values.
        let mut standins: Vec<Option<Vec<Var>>> = Vec::with_capacity(self.training.models().len());
        let mut vars = Vec::new();
        let keyed = |m: &ParamSet, values: &[Var]| -> Vec<(String, Var)> {
            (0..values.len())
                .filter_map(|i| key(m, i).map(|k| (k, values[i].clone())))
                .collect()
        };
        for m in self.training.models() {
            match &m.shard {
                Some(_) => {
                    let whole = m
                        .compute
                        .iter()
                        .map(|c| Ok(Var::from_tensor(&c.as_tensor().to_dtype(DType::F32)?)?))
                        .collect::<Result<Vec<Var>>>()?;
                    vars.extend(keyed(m, &whole));
                    standins.push(Some(whole));
                }
                None => {
                    vars.extend(keyed(m, &m.master));
                    standins.push(None);
                }
            }
        }
        let report = load_checkpoint_in_model(&vars, path, self.device())?;
        for (m, whole) in self.training.models().iter().zip(standins) {
            match (&m.shard, whole) {
                (Some(shard), Some(whole)) => {
                    shard.reslice(&whole)?;
                    for (c, w) in m.compute.iter().zip(&whole) {
                        crate::precision::refresh_copy(c, w)?;
                    }
                }
                _ => {
                    for (c, master) in m.compute.iter().zip(&m.master) {
                        crate::precision::refresh_copy(c, master)?;
                    }
                }
            }
        }
        Ok(report)
    }
}
