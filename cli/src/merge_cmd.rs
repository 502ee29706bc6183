//! `ivme merge-weights CHECKPOINT OUT`: a training checkpoint of any layout into a Hugging Face
//! model folder ([`ivme::checkpoint::merge_weights`]).

use crate::cli::{self, Checked};
use candle_core::DType;
use clap::Parser;
use ivme::checkpoint::{find_resumable, merge_weights, MergeOptions, ShardSize};
use ivme::{Error, Result};
use std::path::{Path, PathBuf};

/// The subcommand's name.
pub const COMMAND: &str = "merge-weights";

/// Write a training checkpoint's model weights as a Hugging Face model folder.
#[derive(Parser, Debug)]
#[command(rename_all = "snake_case", after_help = NOTES)]
struct Flags {
    /// the largest file to write ("2GB", "500MiB", bytes); default: one file
    #[arg(long, value_name = "size", value_parser = Checked(shard_size))]
    max_shard_size: Option<ShardSize>,
    /// the dtype to write the weights in (default: the f32 masters)
    #[arg(long, value_name = "f32|bf16|f16", value_parser = Checked(dtype))]
    dtype: Option<DType>,
    /// the checkpoint, or a project folder for its newest complete one
    #[arg(value_name = "CHECKPOINT")]
    checkpoint: Option<String>,
    /// the folder to write the model to
    #[arg(value_name = "OUT")]
    out: Option<String>,
}

const NOTES: &str = "CHECKPOINT is a folder save_state wrote, on any number of processes, sharded
or not; or a project folder or its checkpoints folder, for the newest complete checkpoint there.
OUT gets model.safetensors, or shards of at most SIZE (\"2GB\", \"500MiB\", bytes) with
model.safetensors.index.json: the Hugging Face layout that candle's VarBuilder and Python's
safetensors read. Every file read is checked against the checkpoint's checksums. The weights are
the f32 masters unless --dtype says otherwise.";

fn shard_size(_: &str, raw: &str, _: &str) -> std::result::Result<ShardSize, String> {
    ShardSize::parse(raw).map_err(|e| e.to_string())
}

fn dtype(flag: &str, raw: &str, _: &str) -> std::result::Result<DType, String> {
    match raw {
        "f32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "fp16" | "float16" => Ok(DType::F16),
        other => Err(format!("`{flag} {other}` is not one of f32, bf16, f16")),
    }
}

/// Runs `ivme merge-weights` with the words after the command name.
pub fn main(words: &[String]) -> Result<i32> {
    let Some(flags) = cli::read::<Flags>(COMMAND, words)? else {
        return Ok(0);
    };
    let (Some(checkpoint), Some(out)) = (&flags.checkpoint, &flags.out) else {
        return Err(Error::Usage(format!(
            "expected a checkpoint folder and an output folder, e.g. `ivme {COMMAND} \
             runs/demo hf-model`; run `ivme {COMMAND} --help`"
        )));
    };
    let options = MergeOptions {
        max_shard_size: flags.max_shard_size,
        dtype: flags.dtype,
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
