//! Turning a training checkpoint of any layout (any number of processes, sharded or not) into a
//! Hugging Face model folder: `model.safetensors`, or numbered shards with an index json.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor};
use serde_json::Value;

use super::format::bad;
use super::layout::{Layout, Runs, Whole};
use super::model::{save_model, ShardSize};
use super::names::{self, Kind};
use super::store::{read_manifest, read_rank_with};
use crate::error::Result;

/// How [`merge_weights`] writes the model folder.
#[derive(Debug, Clone, Default)]
pub struct MergeOptions {
    /// Cut the weights into files of at most this size, with a `model.safetensors.index.json`
    /// (one `model.safetensors` otherwise).
    pub max_shard_size: Option<ShardSize>,
    /// Write the weights in this dtype (as saved, the f32 masters, otherwise).
    pub dtype: Option<DType>,
}

/// What [`merge_weights`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Merged {
    /// How many tensors the model folder holds.
    pub tensors: usize,
    /// How many numbers they hold together.
    pub parameters: usize,
    /// How many processes saved the checkpoint.
    pub world_size: usize,
    /// The sharding stage of the run that saved it.
    pub sharding: String,
    /// The files written, in order.
    pub files: Vec<PathBuf>,
}

/// Writes the model weights of the training checkpoint `checkpoint` (written by
/// [`save_state`](crate::Accelerator::save_state) on any number of processes, with any sharding
/// stage) to `out` as a Hugging Face model folder that candle's `VarBuilder` and Python's
/// `safetensors` read. Every file read is checked against the manifest's checksums; the weights
/// of all saved models go into one folder, so their variable names must not clash.
///
/// ```no_run
/// use ivme::checkpoint::{merge_weights, MergeOptions, ShardSize};
/// let options = MergeOptions {
///     max_shard_size: Some(ShardSize::parse("2GB")?),
///     dtype: Some(candle_core::DType::BF16),
/// };
/// let merged = merge_weights(
///     "runs/demo/checkpoints/checkpoint_7".as_ref(),
///     "hf-model".as_ref(),
///     &options,
/// )?;
/// println!("{} tensors in {:?}", merged.tensors, merged.files);
/// # Ok::<(), ivme::Error>(())
/// ```
pub fn merge_weights(checkpoint: &Path, out: &Path, options: &MergeOptions) -> Result<Merged> {
    let manifest = read_manifest(checkpoint)?;
    let layout = Layout::of(checkpoint, &manifest)?;
    let ranks = if layout.is_sharded() {
        (0..manifest.world_size).collect()
    } else {
        vec![0]
    };
    // Per model component: its runs from every rank folder and the shapes it recorded.
    let mut models: BTreeMap<usize, (Runs, Value)> = BTreeMap::new();
    for r in ranks {
        let state = read_rank_with(checkpoint, r, |c| {
            matches!(names::parse(c), Some((Kind::Model, _)))
        })?;
        for c in state.components {
            let Some((Kind::Model, i)) = names::parse(&c.name) else {
                continue;
            };
            let file = checkpoint.join(format!("rank{r}/{}.safetensors", c.name));
            let (runs, shapes) = models.entry(i).or_insert((Runs::default(), Value::Null));
            runs.add(&file, c.tensors)?;
            if shapes.is_null() {
                *shapes = c.json.get("shapes").cloned().unwrap_or(Value::Null);
            }
        }
    }
    if models.is_empty() {
        return Err(bad(checkpoint, "holds no model weights"));
    }
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    let mut names = BTreeSet::new();
    for (i, (mut runs, shapes)) in models {
        let file = checkpoint.join(format!("rank*/model_{i}.safetensors"));
        for key in runs.keys() {
            let dims = match runs.whole_shape(&key) {
                Some(d) => d,
                None => serde_json::from_value(shapes[&key].clone())
                    .map_err(|_| bad(&file, format!("does not record the shape of `{key}`")))?,
            };
            let dtype = runs.dtype(&key).unwrap_or(DType::F32);
            let numel = dims.iter().product();
            let whole = Whole { dims: &dims, dtype };
            let t = runs.take(&file, &key, 0, numel, &whole)?.reshape(dims)?;
            let t = match options.dtype {
                Some(dt) if dt != t.dtype() => t.to_dtype(dt)?,
                _ => t,
            };
            if !names.insert(key.clone()) {
                return Err(bad(
                    checkpoint,
                    format!(
                        "has `{key}` in more than one model, so they cannot share one model \
                         folder; load the checkpoint and save each model with save_model"
                    ),
                ));
            }
            tensors.push((key, t));
        }
    }
    let parameters = tensors.iter().map(|(_, t)| t.elem_count()).sum();
    let files = save_model(&tensors, out, options.max_shard_size)?;
    Ok(Merged {
        tensors: tensors.len(),
        parameters,
        world_size: manifest.world_size,
        sharding: layout.sharding,
        files,
    })
}
