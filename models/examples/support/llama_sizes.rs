//! The llama benchmarks' model sizes, their configs, seeded data and the step's loss, shared by
//! `bench_llama` (one process) and `bench_llama_ddp` (two). The model is ivme's trainable Llama
//! (`ivme::models::llama`): logits at every position, each against its own target, and every
//! weight gets a gradient, the full training step PyTorch's `LlamaForCausalLM` takes.

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use ivme::models::llama::{Flavor, Llama, LlamaConfig};
use ivme::models::{CausalLm, IGNORE_INDEX};
use ivme::rng::Rng;

pub const LR: f64 = 3e-4;

/// A model size: its config, its micro-batch (samples × tokens), and how many steps to time.
pub struct Size {
    pub name: &'static str,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub mlp: usize,
    pub vocab: usize,
    pub batch: usize,
    pub tokens: usize,
    pub steps: usize,
}

pub const SIZES: [Size; 6] = [
    Size {
        name: "T",
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        mlp: 128,
        vocab: 256,
        batch: 16,
        tokens: 32,
        steps: 30,
    },
    Size {
        name: "S",
        hidden: 256,
        layers: 4,
        heads: 8,
        kv_heads: 4,
        mlp: 688,
        vocab: 4096,
        batch: 8,
        tokens: 64,
        steps: 8,
    },
    Size {
        name: "M",
        hidden: 512,
        layers: 6,
        heads: 8,
        kv_heads: 4,
        mlp: 1376,
        vocab: 8192,
        batch: 4,
        tokens: 128,
        steps: 4,
    },
    Size {
        name: "L",
        hidden: 768,
        layers: 12,
        heads: 12,
        kv_heads: 4,
        mlp: 2048,
        vocab: 16384,
        batch: 2,
        tokens: 128,
        steps: 2,
    },
    // M's model on 4 × 512 tokens: activations outweigh the weights and their optimizer state.
    Size {
        name: "MA",
        hidden: 512,
        layers: 6,
        heads: 8,
        kv_heads: 4,
        mlp: 1376,
        vocab: 8192,
        batch: 4,
        tokens: 512,
        steps: 2,
    },
    // 168 M parameters.
    Size {
        name: "XL",
        hidden: 1024,
        layers: 12,
        heads: 16,
        kv_heads: 4,
        mlp: 2816,
        vocab: 16384,
        batch: 2,
        tokens: 256,
        steps: 1,
    },
];

pub fn config(s: &Size) -> LlamaConfig {
    LlamaConfig {
        flavor: Flavor::Llama,
        vocab_size: s.vocab,
        hidden_size: s.hidden,
        intermediate_size: s.mlp,
        num_hidden_layers: s.layers,
        num_attention_heads: s.heads,
        num_key_value_heads: s.kv_heads,
        head_dim: s.hidden / s.heads,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: s.tokens,
        tie_word_embeddings: false,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        sliding_window: None,
        fused: false,
    }
}

pub type Batch = (Tensor, Tensor);

/// Two micro-batches of seeded random tokens and a seeded random target at every position.
pub fn data(s: &Size) -> candle_core::Result<Vec<Batch>> {
    let mut rng = Rng::new(7);
    let mut token = || (rng.next_u64() % s.vocab as u64) as u32;
    (0..2)
        .map(|_| {
            let x: Vec<u32> = (0..s.batch * s.tokens).map(|_| token()).collect();
            let y: Vec<u32> = (0..s.batch * s.tokens).map(|_| token()).collect();
            Ok((
                Tensor::from_vec(x, (s.batch, s.tokens), &Device::Cpu)?,
                Tensor::from_vec(y, (s.batch, s.tokens), &Device::Cpu)?,
            ))
        })
        .collect()
}

pub fn model(s: &Size, varmap: &VarMap, dtype: DType) -> candle_core::Result<Llama> {
    let vb = VarBuilder::from_varmap(varmap, dtype, &Device::Cpu);
    let model = Llama::new(&config(s), vb)?;
    super::init::reinit(varmap, 17, 0.02)?;
    Ok(model)
}

/// The mean cross-entropy of every position's logits against its target `(b, t)`, in f32:
/// the model's own head and loss (`CausalLm::head_loss`: the head and the loss together in
/// chunks of positions, never the whole logits).
pub fn loss_of(model: &Llama, x: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    model.head_loss(&model.hidden(x, None)?, targets, IGNORE_INDEX)
}

/// The precision a bench's `f32` or `bf16` argument names.
#[allow(dead_code)]
pub fn precision_of(word: &str) -> ivme::Result<ivme::Precision> {
    match word {
        "f32" => Ok(ivme::Precision::No),
        "bf16" => Ok(ivme::Precision::Bf16),
        other => Err(ivme::Error::Usage(format!(
            "unknown precision `{other}`: use f32 or bf16"
        ))),
    }
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn size(name: &str) -> ivme::Result<&'static Size> {
    SIZES.iter().find(|s| s.name == name).ok_or_else(|| {
        ivme::Error::Usage(format!("unknown size `{name}`: use T, S, M, L, MA or XL"))
    })
}

/// ivme's training step at size `s`: the model (in `acc`'s parameter dtype), its two
/// micro-batches and AdamW, prepared on `acc`; each call of the result is one optimizer step.
#[allow(dead_code)]
pub fn ivme_step(
    s: &Size,
    acc: &mut ivme::Accelerator,
) -> ivme::Result<impl FnMut(&mut ivme::Accelerator) -> ivme::Result<()>> {
    use candle_nn::Optimizer;
    let varmap = VarMap::new();
    let model = model(s, &varmap, acc.param_dtype(DType::F32))?;
    let batches = data(s)?;
    let opt = ivme::optim::AdamW::new(
        varmap.all_vars(),
        ivme::optim::ParamsAdamW {
            lr: LR,
            ..Default::default()
        },
    )?;
    let (varmap, mut opt) = acc.prepare((varmap, opt))?;
    Ok(move |acc: &mut ivme::Accelerator| -> ivme::Result<()> {
        let _prepared = &varmap;
        for (x, y) in &batches {
            let loss = loss_of(&model, x, y)?;
            let grads = acc.backward(&loss)?;
            opt.step(&grads)?;
        }
        Ok(())
    })
}
