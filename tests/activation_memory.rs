//! What activation checkpointing saves, counted by this test's own allocator: a backward through
//! checkpointed blocks holds one block's activations at a time, not all of them. Memory that a
//! step holds is the same in every run (unlike its time), so this is an exact count, not a
//! timing; the margin is wide. One test in its own binary: the count is process-wide.

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use ivme::models::llama::{Llama, LlamaConfig};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

struct Counting;

// SAFETY: every call is forwarded unchanged to the system allocator.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let now = LIVE.fetch_add(layout.size() as u64, Relaxed) + layout.size() as u64;
        PEAK.fetch_max(now, Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as u64, Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// An 8-block Llama (hidden 256, 4 heads, MLP 688, vocabulary 512) on 4 × 256 tokens.
fn config() -> LlamaConfig {
    LlamaConfig::from_json(
        r#"{"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
            "vocab_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4,
            "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 256, "tie_word_embeddings": false}"#,
    )
    .unwrap()
}

/// The bytes held at the peak of one training step's forward and backward, above what was held
/// before the forward.
fn peak_of_a_step(checkpointing: bool) -> u64 {
    let mut acc = ivme::Accelerator::builder()
        .cpu(true)
        .activation_checkpointing(checkpointing)
        .build()
        .unwrap();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = Llama::new(&config(), vb).unwrap();
    acc.prepare(&varmap).unwrap();
    let ids: Vec<u32> = (0..1025u32).map(|i| (i * 7 + i * i) % 512).collect();
    let x = Tensor::from_vec(ids[..1024].to_vec(), (4, 256), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(ids[1..].to_vec(), (4, 256), &Device::Cpu).unwrap();
    let before = LIVE.load(Relaxed);
    PEAK.store(before, Relaxed);
    let logits = model.forward(&x).unwrap();
    let loss = ivme::models::causal_lm_loss(&logits, &y.to_dtype(DType::I64).unwrap(), -100);
    let grads = acc.backward(&loss.unwrap()).unwrap();
    drop((grads, logits));
    PEAK.load(Relaxed) - before
}

#[test]
fn a_checkpointed_llama_holds_one_blocks_activations_at_a_time() {
    let without = peak_of_a_step(false);
    let with = peak_of_a_step(true);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    // Measured: 99 MiB with, 261 without; 301 with, had each recompute's graph stayed alive.
    assert!(
        (with as f64) < 0.6 * without as f64,
        "checkpointing held {:.1} MiB at its peak, without {:.1} MiB",
        mib(with),
        mib(without)
    );
}
