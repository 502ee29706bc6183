//! `ivme merge-weights CHECKPOINT OUT`: a training checkpoint of any layout into a Hugging Face
//! model folder ([`ivme::checkpoint::merge_weights`]); `ivme merge-weights --adapter ADAPTER
//! OUT`: a LoRA adapter folded into its base ([`ivme::finetune::merge_adapter`]).

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
    #[arg(long, value_name = "size", value_parser = Checked::new(shard_size))]
    max_shard_size: Option<ShardSize>,
    /// the dtype to write the weights in (default: the f32 masters; with --adapter the base's)
    #[arg(long, value_name = "f32|bf16|f16", value_parser = Checked::new(dtype))]
    dtype: Option<DType>,
    /// a LoRA adapter folder (adapter_model.safetensors, adapter_config.json) to fold into
    /// its base instead of merging a checkpoint
    #[arg(long, value_name = "folder")]
    adapter: Option<String>,
    /// the adapter's base model folder (default: the adapter config's
    /// base_model_name_or_path)
    #[arg(long, value_name = "folder")]
    base: Option<String>,
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
the f32 masters unless --dtype says otherwise.

With --adapter ADAPTER OUT: folds a LoRA adapter that ivme's save_adapter or Python's PEFT wrote
into its base (--base, else the folder adapter_config.json names): each adapted weight becomes
W + (lora_alpha / r) * B A, the adapter's whole modules (modules_to_save) replace the base's, and
the base's other files (config.json, tokenizer files) are copied: a plain model folder.";

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
    if let Some(adapter) = &flags.adapter {
        return merge_adapter(&flags, adapter);
    }
    if flags.base.is_some() {
        return Err(Error::Usage(format!(
            "--base names an adapter's base: use it with --adapter (`ivme {COMMAND} --adapter \
             ADAPTER --base BASE OUT`)"
        )));
    }
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

/// `--adapter ADAPTER [--base BASE] OUT`.
fn merge_adapter(flags: &Flags, adapter: &str) -> Result<i32> {
    let out = match (&flags.checkpoint, &flags.out) {
        (Some(out), None) => out,
        (Some(_), Some(_)) => {
            return Err(Error::Usage(format!(
                "with --adapter give only the output folder (`ivme {COMMAND} --adapter ADAPTER \
                 [--base BASE] OUT`); name the base with --base"
            )))
        }
        _ => {
            return Err(Error::Usage(format!(
                "expected an output folder, e.g. `ivme {COMMAND} --adapter {adapter} merged`"
            )))
        }
    };
    let adapter = Path::new(adapter);
    let base = match &flags.base {
        Some(b) => PathBuf::from(b),
        None => named_base(adapter)?,
    };
    let merged = ivme::finetune::merge_adapter(
        &base,
        adapter,
        Path::new(out),
        flags.dtype,
        flags.max_shard_size,
    )?;
    println!(
        "folded {} adapted weight(s) (scale {}), {} replaced and {} added module tensor(s) of \
         {} into {} and wrote {}:",
        merged.merged.len(),
        merged.scale,
        merged.replaced.len(),
        merged.added.len(),
        adapter.display(),
        base.display(),
        out
    );
    for f in &merged.files {
        println!("  {}", f.display());
    }
    Ok(0)
}

/// The base folder an adapter's config names, when it is a folder here.
fn named_base(adapter: &Path) -> Result<PathBuf> {
    let path = adapter.join(ivme::finetune::ADAPTER_CONFIG);
    let text =
        std::fs::read(&path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let config: serde_json::Value = serde_json::from_slice(&text)?;
    match config["base_model_name_or_path"].as_str() {
        Some(b) if Path::new(b).is_dir() => Ok(PathBuf::from(b)),
        Some(b) => Err(Error::Usage(format!(
            "{} names the base `{b}`, which is not a folder here (a hub name needs downloading \
             first): give the base model folder with --base",
            path.display()
        ))),
        None => Err(Error::Usage(format!(
            "{} names no base (base_model_name_or_path): give the base model folder with --base",
            path.display()
        ))),
    }
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
