//! `ivme merge-weights CHECKPOINT OUT`: a training checkpoint of any layout into a Hugging Face
//! model folder ([`ivme::checkpoint::merge_weights`]).

use ivme::checkpoint::{find_resumable, merge_weights, MergeOptions, ShardSize};
use ivme::{Error, Result};
use std::path::{Path, PathBuf};

/// The subcommand's name.
pub const COMMAND: &str = "merge-weights";

const USAGE: &str =
    "Usage: ivme merge-weights CHECKPOINT OUT [--max-shard-size SIZE] [--dtype f32|bf16|f16]

Writes the model weights of the training checkpoint CHECKPOINT (a folder save_state wrote, on
any number of processes, sharded or not; or a project folder or its checkpoints folder, for the
newest complete checkpoint there) to the folder OUT as model.safetensors, or as shards of
at most SIZE (\"2GB\", \"500MiB\", bytes) with model.safetensors.index.json: the Hugging Face
layout that candle's VarBuilder and Python's safetensors read. Every file read is checked
against the checkpoint's checksums. The weights are the f32 masters unless --dtype says
otherwise.";

/// Runs `ivme merge-weights` with the words after the command name.
pub fn main(words: &[String]) -> Result<i32> {
    if words.iter().any(|w| w == "-h" || w == "--help") {
        println!("{USAGE}");
        return Ok(0);
    }
    let mut options = MergeOptions::default();
    let mut paths = Vec::new();
    let mut it = words.iter();
    while let Some(w) = it.next() {
        let (flag, inline) = match w.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (w.as_str(), None),
        };
        let mut value = |name: &str| -> Result<String> {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .ok_or_else(|| Error::Usage(format!("{name} needs a value\n\n{USAGE}")))
        };
        match flag {
            "--max-shard-size" | "--max_shard_size" => {
                options.max_shard_size = Some(ShardSize::parse(&value(flag)?)?);
            }
            "--dtype" => {
                let v = value(flag)?;
                options.dtype = Some(match v.as_str() {
                    "f32" | "float32" => candle_core::DType::F32,
                    "bf16" | "bfloat16" => candle_core::DType::BF16,
                    "f16" | "fp16" | "float16" => candle_core::DType::F16,
                    other => {
                        return Err(Error::Usage(format!(
                            "--dtype {other} is not one of f32, bf16, f16"
                        )))
                    }
                });
            }
            f if f.starts_with('-') => {
                return Err(Error::Usage(format!("unknown flag `{f}`\n\n{USAGE}")));
            }
            _ => paths.push(w.clone()),
        }
    }
    let [checkpoint, out] = paths.as_slice() else {
        return Err(Error::Usage(format!(
            "expected a checkpoint folder and an output folder\n\n{USAGE}"
        )));
    };
    let checkpoint = resolve(Path::new(checkpoint))?;
    let merged = merge_weights(&checkpoint, Path::new(out), &options)?;
    println!(
        "wrote {} tensors ({} parameters) of a checkpoint saved by {} process(es) (sharding {}) \
         to {}:",
        merged.tensors, merged.parameters, merged.world_size, merged.sharding, out
    );
    for f in &merged.files {
        println!("  {}", f.display());
    }
    Ok(0)
}

/// The checkpoint `path` names: itself when it holds a manifest, else the newest complete
/// checkpoint of the project folder (`path/checkpoints`) or checkpoints folder it is.
fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join("manifest.json").exists() {
        return Ok(path.to_path_buf());
    }
    let folder = match path.join("checkpoints") {
        p if p.is_dir() => p,
        _ => path.to_path_buf(),
    };
    let newest = if folder.is_dir() {
        find_resumable(&folder)?
    } else {
        None
    };
    match newest {
        Some(dir) => {
            println!("using the newest complete checkpoint: {}", dir.display());
            Ok(dir)
        }
        // No checkpoint here: the load names the folder and what is missing.
        None => Ok(path.to_path_buf()),
    }
}
