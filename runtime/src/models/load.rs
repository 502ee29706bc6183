//! A Hugging Face folder's weights put into a model's variables.

use crate::checkpoint::load_checkpoint_in_model;
use crate::error::{Error, Result};
use candle_nn::VarMap;
use std::path::Path;

/// Sets every variable of `varmap` from the safetensors of `folder` (`model.safetensors`, or
/// the shards an index json names), each on its variable's device in its dtype. Refused,
/// with nothing changed, when a variable has no tensor or a tensor of another shape (each named
/// with both shapes), or when the folder holds tensors no variable takes (so a config that does
/// not match its weights is caught); the rotary tables' `inv_freq` buffers older exports carry
/// and a tied head's `lm_head.weight` are ignored.
pub fn load_weights(varmap: &VarMap, folder: impl AsRef<Path>) -> Result<()> {
    let folder = folder.as_ref();
    let mut vars: Vec<(String, candle_core::Var)> = varmap
        .data()
        .lock()
        .map_err(|_| Error::Usage("the VarMap's lock is poisoned".into()))?
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let Some(device) = vars.first().map(|(_, v)| v.device().clone()) else {
        return Err(Error::Usage(
            "load_weights: the VarMap holds no variable yet: build the model first".into(),
        ));
    };
    let tied = !vars.iter().any(|(n, _)| n == "lm_head.weight");
    let report = load_checkpoint_in_model(&vars, folder, &device)?;
    let unexpected: Vec<&String> = report
        .unexpected
        .iter()
        .filter(|n| {
            let buffer = n.ends_with("rotary_emb.inv_freq");
            let tied_head = tied && n.as_str() == "lm_head.weight";
            !buffer && !tied_head
        })
        .collect();
    if !unexpected.is_empty() {
        return Err(Error::Usage(format!(
            "{} holds {} tensor(s) the model has no variable for (does config.json match the \
             weights?): {}",
            folder.display(),
            unexpected.len(),
            unexpected
                .iter()
                .take(8)
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(())
}
