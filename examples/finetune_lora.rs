//! Fine-tuning a pretrained model with LoRA under `#[accelerate]`: the tutorial's loop, the
//! base read as constants from a Hugging Face folder, rank-4 adapters on every block's linear
//! layers, a new classifier head, and the adapter saved in the layout Python's PEFT loads.
//!
//! ```text
//! cargo build --release --workspace --bins --examples
//! target/release/ivme launch --num_processes 2 target/release/examples/finetune_lora [DIR [EPOCHS]]
//! target/release/ivme merge-weights --adapter DIR/adapter DIR/merged
//! ```
//!
//! `DIR` (default `runs/finetune_lora`) gets `pretrained/` (a stand-in for a downloaded model:
//! a token embedding and three residual MLP blocks, written on the first run), `adapter/` and,
//! after `merge-weights`, `merged/`: the base with the adapters folded in. Only the adapters and
//! the head are variables: candle computes no gradient for the base, ivme syncs and clips only
//! what trains, and the run prints how much that is.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{embedding, linear, Embedding, Linear, Optimizer, VarBuilder, VarMap};
use ivme::finetune::{Lora, LoraConfig, LoraLinear};
use ivme::optim::{AdamW, ParamsAdamW};
use ivme::rng::Rng;
use std::path::{Path, PathBuf};

const VOCAB: usize = 8192;
const WIDTH: usize = 512;
const BLOCKS: usize = 3;
const CLASSES: usize = 4;
const TOKENS: usize = 16;

/// Token embedding → mean over the sequence → residual MLP blocks → a classifier head.
struct Classifier {
    embed: Embedding,
    blocks: Vec<(LoraLinear, LoraLinear)>,
    head: Linear,
}

impl Classifier {
    fn new(vb: VarBuilder, lora: &Lora) -> candle_core::Result<Self> {
        let blocks = (0..BLOCKS)
            .map(|i| {
                let vb = vb.pp(format!("blocks.{i}"));
                Ok((
                    lora.linear(WIDTH, 2 * WIDTH, vb.pp("up"))?,
                    lora.linear(2 * WIDTH, WIDTH, vb.pp("down"))?,
                ))
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Classifier {
            embed: embedding(VOCAB, WIDTH, vb.pp("embed"))?,
            blocks,
            head: linear(WIDTH, CLASSES, vb.pp("classifier"))?,
        })
    }
}

impl Module for Classifier {
    fn forward(&self, tokens: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = self.embed.forward(tokens)?.mean(1)?;
        for (up, down) in &self.blocks {
            h = (&h + down.forward(&up.forward(&h)?.gelu()?)?)?;
        }
        self.head.forward(&h)
    }
}

#[ivme::accelerate(grad_accum = 2, clip_grad_norm = 1.0)]
fn finetune(dir: &Path, batches: Vec<(Tensor, Tensor)>, epochs: usize) -> candle_core::Result<()> {
    let device = Device::Cpu;
    let base = accelerator.load_base(dir.join("pretrained"))?;
    let lora = accelerator.lora(LoraConfig::new(4, 8.0, &["up", "down"]))?;
    let varmap = VarMap::new();
    let model = Classifier::new(
        accelerator.base_var_builder(&base, &varmap, DType::F32),
        &lora,
    )?;
    // The VarMap holds what trains: the adapters and the new head.
    let mut opt = AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: 1e-3,
            ..Default::default()
        },
    )?;
    for epoch in 0..epochs {
        let mut total = 0f32;
        let mut count = 0f32;
        for (tokens, labels) in &batches {
            let tokens = tokens.to_device(&device)?;
            let labels = labels.to_device(&device)?;
            let logits = model.forward(&tokens)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &labels)?;
            let grads = loss.backward()?;
            opt.step(&grads)?;
            total += loss.to_scalar::<f32>()?;
            count += 1.0;
        }
        accelerator.print(format!(
            "epoch {epoch}: loss {:.4} (rank 0's batches)",
            total / count
        ));
    }
    let files = accelerator.save_adapter(&dir.join("adapter"), &lora)?;
    accelerator.print(format!("adapter saved: {files:?}"));
    Ok(())
}

/// Writes the stand-in pretrained model once: seeded weights for the embedding and blocks,
/// `config.json` beside them. Every process writes the same bytes under a name of its own and
/// renames it into place, so concurrent first runs agree.
fn write_pretrained(folder: &Path) -> candle_core::Result<()> {
    let weights = folder.join("model.safetensors");
    if weights.is_file() {
        return Ok(());
    }
    std::fs::create_dir_all(folder)?;
    let mut rng = Rng::new(2024);
    let mut tensors = std::collections::HashMap::new();
    let dev = Device::Cpu;
    // Pretrained-like: each token's embedding leans towards one of four directions (its id
    // modulo 4), the structure the fine-tune's task uses.
    let directions = rng.randn(0.0, 0.1, (CLASSES, WIDTH), &dev)?;
    let ids: Vec<u32> = (0..VOCAB as u32).map(|t| t % CLASSES as u32).collect();
    let lean = directions.index_select(&Tensor::new(ids.as_slice(), &dev)?, 0)?;
    let embed = (rng.randn(0.0, 1.0, (VOCAB, WIDTH), &dev)? + lean)?;
    tensors.insert("embed.weight".to_string(), embed);
    for i in 0..BLOCKS {
        for (name, (out, inp)) in [("up", (2 * WIDTH, WIDTH)), ("down", (WIDTH, 2 * WIDTH))] {
            let std = 1.0 / (inp as f32).sqrt();
            tensors.insert(
                format!("blocks.{i}.{name}.weight"),
                rng.randn(0.0, std, (out, inp), &dev)?,
            );
            tensors.insert(
                format!("blocks.{i}.{name}.bias"),
                Tensor::zeros(out, DType::F32, &dev)?,
            );
        }
    }
    let own = folder.join(format!(".model.safetensors.{}", std::process::id()));
    candle_core::safetensors::save(&tensors, &own)?;
    std::fs::rename(&own, &weights)?;
    let config = format!(
        "{{\"model_type\": \"token_mlp\", \"vocab_size\": {VOCAB}, \"hidden_size\": {WIDTH}, \
         \"num_blocks\": {BLOCKS}}}"
    );
    std::fs::write(folder.join("config.json"), config)?;
    Ok(())
}

/// 64 batches of 16 sequences of a class 0..4: half of a sequence's tokens are of its class
/// (their id modulo 4), the rest anything; identical on every process (one seed).
fn batches() -> candle_core::Result<Vec<(Tensor, Tensor)>> {
    let mut rng = Rng::new(7);
    (0..64)
        .map(|_| {
            let labels: Vec<u32> = (0..16)
                .map(|_| (rng.next_u64() % CLASSES as u64) as u32)
                .collect();
            let tokens: Vec<u32> = labels
                .iter()
                .flat_map(|&c| (0..TOKENS).map(move |k| (c, k)))
                .map(|(c, k)| {
                    let t = (rng.next_u64() % VOCAB as u64) as u32;
                    if k % 2 == 0 {
                        t - t % CLASSES as u32 + c
                    } else {
                        t
                    }
                })
                .collect();
            Ok((
                Tensor::from_vec(tokens, (16, TOKENS), &Device::Cpu)?,
                Tensor::from_vec(labels, 16, &Device::Cpu)?,
            ))
        })
        .collect()
}

fn main() -> candle_core::Result<()> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "runs/finetune_lora".into()),
    );
    let epochs = std::env::args()
        .nth(2)
        .and_then(|e| e.parse().ok())
        .unwrap_or(3);
    write_pretrained(&dir.join("pretrained"))?;
    finetune(&dir, batches()?, epochs)
}
