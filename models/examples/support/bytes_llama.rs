//! The byte-level Llama task of the llama examples: the text, the model's config, the batches
//! and the loss. The model is ivme's trainable Llama (`ivme::models::llama`): every position of
//! a window predicts the byte after it, and every weight gets a gradient.
//!
//! Include it with `#[path = "support/bytes_llama.rs"] mod bytes_llama;`.

use candle_core::{Device, Tensor};
use ivme::models::llama::{Flavor, LlamaConfig};
use ivme::models::{token_loss, IGNORE_INDEX};
use ivme::rng::Rng;

/// Bytes of context per sample.
pub const CONTEXT: usize = 32;
/// Samples per micro-batch.
pub const BATCH: usize = 16;

/// The training text: our own sentences, repeated, so that a tiny model can learn them.
pub fn text() -> Vec<u8> {
    let lines = [
        "ivme runs one candle loop on one process or many.",
        "Each process trains on its own share of the batches.",
        "Gradients are summed over two micro-batches, then averaged across processes.",
        "The clipped update is the same on every rank, so the weights stay identical.",
        "A checkpoint is written every few steps and the run resumes from the newest one.",
        "In bf16 the model computes in sixteen bits and the optimizer keeps f32 masters.",
    ];
    lines.join(" ").repeat(4).into_bytes()
}

/// A 0.1 M-parameter Llama over bytes: 2 blocks, 4 query heads over 2 key/value heads.
pub fn config() -> LlamaConfig {
    LlamaConfig {
        flavor: Flavor::Llama,
        vocab_size: 256,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 64,
        tie_word_embeddings: false,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        sliding_window: None,
        fused: false,
    }
}

/// A window's bytes `(batch, CONTEXT)` and, at each position, the byte after it.
pub type Batch = (Tensor, Tensor);

/// Windows of the text as (bytes, next byte) batches, shuffled with a fixed seed (the same on
/// every process); the last eighth is held out for evaluation.
pub fn batches(text: &[u8]) -> candle_core::Result<(Vec<Batch>, Vec<Batch>)> {
    let mut starts: Vec<usize> = (0..text.len() - CONTEXT).step_by(3).collect();
    let mut rng = Rng::new(5);
    for i in (1..starts.len()).rev() {
        starts.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let all = starts
        .chunks_exact(BATCH)
        .map(|chunk| {
            let x: Vec<u32> = chunk
                .iter()
                .flat_map(|&s| text[s..s + CONTEXT].iter().map(|&b| b as u32))
                .collect();
            let y: Vec<u32> = chunk
                .iter()
                .flat_map(|&s| text[s + 1..s + CONTEXT + 1].iter().map(|&b| b as u32))
                .collect();
            Ok((
                Tensor::from_vec(x, (BATCH, CONTEXT), &Device::Cpu)?,
                Tensor::from_vec(y, (BATCH, CONTEXT), &Device::Cpu)?,
            ))
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let held_out = all.len() / 8;
    let (train, eval) = all.split_at(all.len() - held_out);
    Ok((train.to_vec(), eval.to_vec()))
}

/// The mean cross-entropy of every position's logits `(b, t, 256)` against its next byte
/// `(b, t)`, in f32.
pub fn loss_of(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    token_loss(
        &logits.reshape((b * t, v))?,
        &targets.flatten_all()?,
        IGNORE_INDEX,
    )
}

/// The mean cross-entropy at the last position of each window alone: the byte after the whole
/// context (what a model that gives the last position's logits only is trained on).
#[allow(dead_code)]
pub fn last_position_loss(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let t = logits.dim(1)?;
    loss_of(&logits.narrow(1, t - 1, 1)?, &targets.narrow(1, t - 1, 1)?)
}
