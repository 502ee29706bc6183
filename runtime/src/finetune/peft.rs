//! Adapters in the layout PEFT users load: `adapter_model.safetensors` with keys under
//! `base_model.model.`, and `adapter_config.json`; and folding one into its base.

use super::base::base_files;
use super::LoraConfig;
use crate::checkpoint::fsio::Staged;
use crate::checkpoint::model::{save_model, ShardSize, INDEX_FILE};
use crate::error::io_at;
use crate::error::{Error, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The adapter's weights file.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The adapter's settings file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The prefix PEFT puts before the model's own names.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// Whether `name` is a LoRA factor (`….lora_A.weight`, `….lora_B.weight`).
fn lora_factor(name: &str) -> Option<(&str, char)> {
    for (part, which) in [
        (".lora_A.weight", 'A'),
        (".lora_B.weight", 'B'),
        (".lora_A.default.weight", 'A'),
        (".lora_B.default.weight", 'B'),
    ] {
        if let Some(module) = name.strip_suffix(part) {
            return Some((module, which));
        }
    }
    None
}

/// Writes the trained tensors (`tensors`, by the model's names) as a PEFT adapter in `dir`:
/// LoRA factors and the modules trained whole (`modules_to_save`: a new head, unfrozen
/// layers), with the settings and `base`. Every file is written before any replaces an older
/// one. Returns the files written.
pub(crate) fn write_adapter(
    dir: &Path,
    tensors: &[(String, Tensor)],
    config: &LoraConfig,
    adapted: &[String],
    base: Option<&Path>,
) -> Result<Vec<PathBuf>> {
    let mut whole = BTreeSet::new();
    let mut items: Vec<(String, &Tensor)> = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        if lora_factor(name).is_none() {
            let module = name.rsplit_once('.').map_or(name.as_str(), |(m, _)| m);
            whole.insert(module.to_string());
        }
        items.push((format!("{PEFT_PREFIX}{name}"), t));
    }
    items.sort_by(|a, b| a.0.cmp(&b.0));
    let alpha = if config.alpha.fract() == 0.0 {
        json!(config.alpha as i64)
    } else {
        json!(config.alpha)
    };
    let settings = json!({
        "peft_type": "LORA",
        "task_type": null,
        "base_model_name_or_path": base.map(|b| b.display().to_string()),
        "r": config.rank,
        "lora_alpha": alpha,
        "lora_dropout": config.dropout,
        "target_modules": adapted,
        "modules_to_save": if whole.is_empty() { Value::Null } else { json!(whole) },
        "bias": "none",
        "fan_in_fan_out": false,
        "use_rslora": false,
        "init_lora_weights": true,
        "inference_mode": true,
    });
    std::fs::create_dir_all(dir).map_err(io_at("creating folder", dir))?;
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let mut staged = Staged::default();
    let weights = dir.join(ADAPTER_WEIGHTS);
    let refs: Vec<(&str, &Tensor)> = items.iter().map(|(n, t)| (n.as_str(), *t)).collect();
    staged.write(&weights, |w| {
        crate::checkpoint::format::write_safetensors(w, &refs, Some(&metadata)).map(drop)
    })?;
    let settings_path = dir.join(ADAPTER_CONFIG);
    let text = serde_json::to_vec_pretty(&settings)?;
    staged.write(&settings_path, |w| {
        std::io::Write::write_all(w, &text).map_err(io_at("writing", &settings_path))
    })?;
    staged.commit()?;
    Ok(vec![weights, settings_path])
}

/// What [`merge_adapter`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterMerge {
    /// Base weights that received `W + scale · B A`, by name.
    pub merged: Vec<String>,
    /// Base tensors replaced by the adapter's trained copy (`modules_to_save`).
    pub replaced: Vec<String>,
    /// Tensors the base did not have (a new head), taken from the adapter.
    pub added: Vec<String>,
    /// The scale applied: `lora_alpha / r` (or `/ sqrt(r)` under rsLoRA).
    pub scale: f64,
    /// The files written in the output folder.
    pub files: Vec<PathBuf>,
}

fn bad(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::Usage(format!("{}: {msg}", path.display()))
}

/// The LoRA scale an adapter's settings give, refusing settings ivme cannot fold.
fn scale_of(settings: &Value, path: &Path) -> Result<f64> {
    let kind = settings["peft_type"].as_str().unwrap_or("LORA");
    if kind != "LORA" {
        return Err(bad(
            path,
            format!("is a {kind} adapter; only LORA adapters can be merged"),
        ));
    }
    let r = settings["r"]
        .as_f64()
        .filter(|r| *r > 0.0)
        .ok_or_else(|| bad(path, "has no positive `r` (the LoRA rank)"))?;
    let alpha = settings["lora_alpha"]
        .as_f64()
        .ok_or_else(|| bad(path, "has no numeric `lora_alpha`"))?;
    if settings["fan_in_fan_out"].as_bool() == Some(true) {
        return Err(bad(
            path,
            "sets `fan_in_fan_out` (Conv1D-style weights), which merging does not support",
        ));
    }
    for per_layer in ["rank_pattern", "alpha_pattern"] {
        if settings[per_layer]
            .as_object()
            .is_some_and(|o| !o.is_empty())
        {
            return Err(bad(
                path,
                format!("sets a per-layer `{per_layer}`, which merging does not support"),
            ));
        }
    }
    if settings["use_dora"].as_bool() == Some(true) {
        return Err(bad(
            path,
            "is a DoRA adapter (`use_dora`), which merging does not support",
        ));
    }
    Ok(if settings["use_rslora"].as_bool() == Some(true) {
        alpha / r.sqrt()
    } else {
        alpha / r
    })
}

/// Folds the LoRA adapter in `adapter` (one ivme or Python's PEFT wrote) into the model in
/// `base` and writes a plain Hugging Face model folder to `out`: each adapted weight becomes
/// `W + (lora_alpha / r) · B A` (computed in f32), the adapter's whole modules replace or add
/// theirs, everything else is copied; `base`'s other files (`config.json`, tokenizer files) are
/// copied too. The weights keep the base's dtypes unless `dtype` says otherwise.
pub fn merge_adapter(
    base: &Path,
    adapter: &Path,
    out: &Path,
    dtype: Option<DType>,
    max_shard_size: Option<ShardSize>,
) -> Result<AdapterMerge> {
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same(out, base) || same(out, adapter) {
        return Err(Error::Usage(format!(
            "the output folder {} is the base or the adapter folder: write the merged model to a \
             folder of its own",
            out.display()
        )));
    }
    let settings_path = adapter.join(ADAPTER_CONFIG);
    let settings: Value = serde_json::from_slice(
        &std::fs::read(&settings_path).map_err(io_at("reading", &settings_path))?,
    )
    .map_err(|e| bad(&settings_path, format!("is not JSON: {e}")))?;
    let scale = scale_of(&settings, &settings_path)?;
    let weights_path = adapter.join(ADAPTER_WEIGHTS);
    if !weights_path.is_file() {
        return Err(bad(
            adapter,
            format!("has no {ADAPTER_WEIGHTS} (an adapter_model.bin must be converted to safetensors first)"),
        ));
    }
    let trained = candle_core::safetensors::load(&weights_path, &Device::Cpu)?;
    let mut factors: BTreeMap<String, (Option<Tensor>, Option<Tensor>)> = BTreeMap::new();
    let mut whole: BTreeMap<String, Tensor> = BTreeMap::new();
    for (key, t) in trained {
        let name = key.strip_prefix(PEFT_PREFIX).unwrap_or(&key);
        if name.contains("lora_embedding_") || name.contains("lora_magnitude") {
            return Err(bad(
                &weights_path,
                format!("holds `{key}`, a kind of adapter merging does not support"),
            ));
        }
        match lora_factor(name) {
            Some((module, 'A')) => factors.entry(module.to_string()).or_default().0 = Some(t),
            Some((module, _)) => factors.entry(module.to_string()).or_default().1 = Some(t),
            None => {
                whole.insert(name.replace(".modules_to_save.default", ""), t);
            }
        }
    }
    let files = base_files(base)?;
    // SAFETY: mapped read-only for the length of this call; the base must not change meanwhile.
    let tensors = unsafe { MmapedSafetensors::multi(&files) }?;
    let mut names: Vec<String> = tensors.tensors().into_iter().map(|(n, _)| n).collect();
    names.sort();
    let mut report = AdapterMerge {
        merged: Vec::new(),
        replaced: Vec::new(),
        added: Vec::new(),
        scale,
        files: Vec::new(),
    };
    for (module, pair) in &factors {
        let weight = format!("{module}.weight");
        if pair.0.is_none() || pair.1.is_none() {
            let missing = if pair.0.is_none() { "lora_A" } else { "lora_B" };
            return Err(bad(
                &weights_path,
                format!("has one factor of `{module}` but not its {missing}"),
            ));
        }
        if names.binary_search(&weight).is_err() {
            return Err(bad(
                base,
                format!("has no `{weight}`, which the adapter's `{module}` adapts: is this the adapter's base?"),
            ));
        }
    }
    let mut out_tensors: Vec<(String, Tensor)> = Vec::with_capacity(names.len());
    for name in &names {
        let w = tensors.load(name, &Device::Cpu)?;
        let keep = dtype.unwrap_or(w.dtype());
        let module = name.strip_suffix(".weight");
        let t = if let Some(t) = whole.remove(name) {
            if t.dims() != w.dims() {
                return Err(bad(
                    &weights_path,
                    format!(
                        "holds `{name}` with shape {:?} but the base's is {:?}",
                        t.dims(),
                        w.dims()
                    ),
                ));
            }
            report.replaced.push(name.clone());
            t.to_dtype(keep)?
        } else if let Some((Some(a), Some(b))) = module.and_then(|m| factors.get(m)) {
            let delta = b.to_dtype(DType::F32)?.matmul(&a.to_dtype(DType::F32)?)?;
            if delta.dims() != w.dims() {
                return Err(bad(
                    &weights_path,
                    format!(
                        "adapts `{name}` (shape {:?}) with B·A of shape {:?}",
                        w.dims(),
                        delta.dims()
                    ),
                ));
            }
            report.merged.push(name.clone());
            (w.to_dtype(DType::F32)? + (delta * scale)?)?.to_dtype(keep)?
        } else {
            w.to_dtype(keep)?
        };
        out_tensors.push((name.clone(), t));
    }
    for (name, t) in whole {
        let keep = dtype.unwrap_or(t.dtype());
        report.added.push(name.clone());
        out_tensors.push((name, t.to_dtype(keep)?));
    }
    report.files = save_model(&out_tensors, out, max_shard_size)?;
    for entry in std::fs::read_dir(base).map_err(io_at("listing", base))? {
        let path = entry.map_err(io_at("listing", base))?.path();
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let weights = name.ends_with(".safetensors") || name == INDEX_FILE;
        if path.is_file() && !weights {
            let to = out.join(&name);
            std::fs::copy(&path, &to).map_err(io_at("copying to", &to))?;
            report.files.push(to);
        }
    }
    Ok(report)
}
