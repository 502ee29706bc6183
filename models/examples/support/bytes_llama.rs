//! The byte-level Llama task of the llama examples: the text, the model's config, the batches
//! and the loss.
//!
//! Include it with `#[path = "support/bytes_llama.rs"] mod bytes_llama;`.

use candle_core::{DType, Device, Tensor};
use candle_transformers::models::llama;
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

pub fn config() -> llama::Config {
    let cfg = llama::LlamaConfig {
        hidden_size: 64,
        intermediate_size: 128,
        vocab_size: 256,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: 64,
        tie_word_embeddings: Some(false),
    };
    cfg.into_config(false)
}

/// Input bytes and the byte after them.
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
            let y: Vec<u32> = chunk.iter().map(|&s| text[s + CONTEXT] as u32).collect();
            Ok((
                Tensor::from_vec(x, (BATCH, CONTEXT), &Device::Cpu)?,
                Tensor::from_vec(y, BATCH, &Device::Cpu)?,
            ))
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let held_out = all.len() / 8;
    let (train, eval) = all.split_at(all.len() - held_out);
    Ok((train.to_vec(), eval.to_vec()))
}

pub fn loss_of(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::loss::cross_entropy(&logits.to_dtype(DType::F32)?, targets)
}
