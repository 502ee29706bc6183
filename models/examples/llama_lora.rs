//! A LoRA fine-tune of a Llama read from a Hugging Face folder, under `#[accelerate]`: the base's
//! weights are constants (no gradient, no optimizer state, nothing synced), rank-4 adapters on
//! every block's `q_proj` and `v_proj` (transformers' module names) train through the whole
//! model, and the adapter is saved in the layout Python's PEFT loads.
//!
//! ```text
//! cargo build --release --workspace --bins --examples
//! target/release/ivme launch --num_processes 2 target/release/examples/llama_lora BASE OUT [EPOCHS]
//! target/release/ivme merge-weights --adapter OUT/adapter OUT/merged
//! ```
//!
//! `BASE` is a llama-family folder (`config.json` and `model.safetensors` or shards, as
//! transformers saves them: Llama, Mistral or Qwen2). The task is synthetic: sequences whose
//! every token follows from the one before, so the loss falls fast. `OUT` gets `adapter/` and
//! `probe.safetensors`: the fine-tuned model's logits on a fixed batch, which the merged folder
//! must reproduce.

use candle_core::{DType, Device, Tensor};
use candle_nn::{Optimizer, VarMap};
use ivme::finetune::LoraConfig;
use ivme::models::llama::{Llama, LlamaConfig};
use ivme::models::{causal_lm_loss, IGNORE_INDEX};
use ivme::optim::{AdamW, ParamsAdamW};
use std::path::{Path, PathBuf};

const TOKENS: usize = 12;
const BATCH: usize = 4;

#[ivme::accelerate(grad_accum = 2, clip_grad_norm = 1.0)]
fn finetune(
    base_dir: &Path,
    out: &Path,
    batches: Vec<(Tensor, Tensor)>,
    probe: &Tensor,
    epochs: usize,
) -> ivme::Result<()> {
    let device = Device::Cpu;
    let cfg = LlamaConfig::from_folder(base_dir)?;
    let base = accelerator.load_base(base_dir)?;
    let lora = accelerator.lora(LoraConfig::new(4, 8.0, &["q_proj", "v_proj"]))?;
    let varmap = VarMap::new();
    let model = Llama::with_lora(
        &cfg,
        accelerator.base_var_builder(&base, &varmap, DType::F32),
        &lora,
    )?;
    // The VarMap holds what trains: the adapters.
    let mut opt = AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: 2e-2,
            ..Default::default()
        },
    )?;
    for epoch in 0..epochs {
        let (mut total, mut count) = (0f32, 0f32);
        for (ids, labels) in &batches {
            let ids = ids.to_device(&device)?;
            let labels = labels.to_device(&device)?;
            let loss = causal_lm_loss(&model.forward(&ids)?, &labels, IGNORE_INDEX)?;
            let grads = loss.backward()?;
            opt.step(&grads)?;
            total += loss.to_scalar::<f32>()?;
            count += 1.0;
        }
        accelerator.print(format!("epoch {epoch}: loss {:.4}", total / count));
    }
    let files = accelerator.save_adapter(&out.join("adapter"), &lora)?;
    accelerator.print(format!("adapter saved: {files:?}"));
    if accelerator.is_main_process() {
        let logits = model.forward(&probe.to_device(&device)?)?;
        candle_core::safetensors::save(
            &std::collections::HashMap::from([("logits".to_string(), logits)]),
            out.join("probe.safetensors"),
        )?;
    }
    Ok(())
}

/// `count` batches of `BATCH` sequences over `vocab` tokens: each starts anywhere and steps by
/// 3 (modulo the vocabulary), so every next token follows from the one before.
fn sequences(
    count: usize,
    vocab: usize,
    seed: usize,
) -> candle_core::Result<Vec<(Tensor, Tensor)>> {
    (0..count)
        .map(|b| {
            let ids: Vec<u32> = (0..BATCH * TOKENS)
                .map(|i| {
                    let (row, pos) = (i / TOKENS, i % TOKENS);
                    let start = (b * 7 + row * 11 + seed) % vocab;
                    ((start + 3 * pos) % vocab) as u32
                })
                .collect();
            let ids = Tensor::from_vec(ids, (BATCH, TOKENS), &Device::Cpu)?;
            let labels = ids.to_dtype(DType::I64)?;
            Ok((ids, labels))
        })
        .collect()
}

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(base), Some(out)) = (args.first(), args.get(1)) else {
        return Err(ivme::Error::Usage(
            "usage: llama_lora BASE_FOLDER OUT_DIR [EPOCHS]".into(),
        ));
    };
    let epochs = args.get(2).and_then(|e| e.parse().ok()).unwrap_or(8);
    let (base, out) = (PathBuf::from(base), PathBuf::from(out));
    let vocab = LlamaConfig::from_folder(&base)?.vocab_size;
    let batches = sequences(8, vocab, 0)?;
    let probe = sequences(1, vocab, 5)?.remove(0).0;
    finetune(&base, &out, batches, &probe, epochs)
}
