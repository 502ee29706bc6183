//! The Accelerator's side of Hugging Face model files: the prepared models' weights saved as
//! `model.safetensors` (or shards with an index json) and loaded back on every rank.

use crate::accelerator::Accelerator;
use crate::checkpoint::model::{load_checkpoint_in_model, save_model, LoadReport, ShardSize};
use crate::error::Result;
use crate::train::params::ParamSet;
use candle_core::Tensor;
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
        let tensors = self.whole_masters()?;
        let written = if self.is_main_process() {
            save_model(&tensors, dir, shard).map(|_| ())
        } else {
            Ok(())
        };
        self.agree("saving the model", written)
    }

    /// Every prepared model's f32 master weights, whole, by name (model by model, in name
    /// order). Under sharding they are put together from every process's slice: a collective
    /// that every process calls. Under ZeRO-3 this, not the `VarMap`, is where a block's
    /// weights can be read: its variables hold no elements outside the block's segment.
    pub fn whole_masters(&self) -> Result<Vec<(String, Tensor)>> {
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        for m in self.training.models() {
            tensors.extend(m.names().iter().cloned().zip(m.whole_masters(&*self.comm)?));
        }
        Ok(tensors)
    }

    /// Loads a model file or folder (single or sharded) into the prepared models' weights on
    /// every rank, refreshing their low-precision copies. The f32 masters take the file's
    /// values as they are (under sharding too: each process's slice comes from them, not from
    /// the weights rounded to the compute dtype).
    pub fn load_model(&self, path: &Path) -> Result<LoadReport> {
        self.load_named(path, |m, i| Some(m.names()[i].clone()))
    }

    /// Loads the file or folder at `path` into the prepared models' variables that `key`
    /// names (by the name the file holds them under; `None` leaves a variable out), as
    /// [`load_model`](Self::load_model) says.
    pub(crate) fn load_named(
        &self,
        path: &Path,
        key: impl Fn(&ParamSet, usize) -> Option<String>,
    ) -> Result<LoadReport> {
        let mut standins = Vec::with_capacity(self.training.models().len());
        let mut vars = Vec::new();
        for m in self.training.models() {
            let (keyed, standin) = m.load_targets(&*self.comm, &key)?;
            vars.extend(keyed);
            standins.push(standin);
        }
        let report = load_checkpoint_in_model(&vars, path, self.device())?;
        for (m, standin) in self.training.models().iter().zip(standins) {
            m.take_loaded(standin)?;
        }
        Ok(report)
    }
}
