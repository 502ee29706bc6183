//! A Llama whose activations outweigh its weights, trained for a few steps, for the test that
//! runs it under a memory limit (tests/memory_limit.rs): by plain candle, or by ivme with or
//! without activation checkpointing. Writes the trained weights to `out` (safetensors) and
//! prints the process's peak virtual and resident memory to stderr.
//!
//! Arguments are `key=value`: `mode=ivme|candle ckpt=0|1 steps=K out=FILE`.

use candle_core::{DType, Device, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use ivme::models::llama::{Llama, LlamaConfig};
use std::collections::HashMap;

/// 8 blocks of hidden 256 on 4 × 512 tokens: about 6 M parameters (100 MB with AdamW's state)
/// against some 700 MB of activations.
fn config() -> LlamaConfig {
    LlamaConfig::from_json(
        r#"{"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
            "vocab_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4,
            "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 512, "tie_word_embeddings": false}"#,
    )
    .expect("the config parses")
}

/// The model with seeded weights, the same in every mode.
fn model(varmap: &VarMap) -> candle_core::Result<Llama> {
    let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
    let model = Llama::new(&config(), vb)?;
    let mut rng = ivme::rng::Rng::new(3);
    let data = varmap.data().lock().expect("the varmap's lock");
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names {
        let v = &data[name];
        v.set(
            &rng.randn(0.0, 0.05, v.shape(), &Device::Cpu)
                .expect("draws"),
        )?;
    }
    Ok(model)
}

/// Step `k`'s tokens and their next-token targets.
fn batch(k: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let ids: Vec<u32> = (0..4 * 512 + 1)
        .map(|i| ((i * 31 + k * 17 + i * i / 7) % 512) as u32)
        .collect();
    let x = Tensor::from_vec(ids[..4 * 512].to_vec(), (4, 512), &Device::Cpu)?;
    let y = Tensor::from_vec(ids[1..].to_vec(), (4, 512), &Device::Cpu)?;
    Ok((x, y.to_dtype(DType::I64)?))
}

fn loss(model: &Llama, k: usize) -> candle_core::Result<Tensor> {
    let (x, y) = batch(k)?;
    ivme::models::causal_lm_loss(&model.forward(&x)?, &y, ivme::models::IGNORE_INDEX)
}

fn memory() -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .filter(|l| l.starts_with("VmPeak") || l.starts_with("VmHWM"))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join(", ")
}

fn main() -> ivme::Result<()> {
    let args: HashMap<String, String> = std::env::args()
        .skip(1)
        .filter_map(|a| a.split_once('=').map(|(k, v)| (k.into(), v.into())))
        .collect();
    let get = |k: &str, d: &str| args.get(k).cloned().unwrap_or_else(|| d.into());
    let steps: usize = get("steps", "2").parse().unwrap_or(2);
    let varmap = VarMap::new();
    let params = |lr| ivme::optim::ParamsAdamW {
        lr,
        ..Default::default()
    };
    if get("mode", "ivme") == "candle" {
        let model = model(&varmap)?;
        let p = params(1e-3);
        let candle_params = candle_nn::ParamsAdamW {
            lr: p.lr,
            beta1: p.beta1,
            beta2: p.beta2,
            eps: p.eps,
            weight_decay: p.weight_decay,
        };
        let mut opt = candle_nn::AdamW::new(varmap.all_vars(), candle_params)?;
        for k in 0..steps {
            opt.backward_step(&loss(&model, k)?)?;
        }
    } else {
        let mut acc = ivme::Accelerator::builder()
            .cpu(true)
            .activation_checkpointing(get("ckpt", "0") == "1")
            .build()?;
        let model = model(&varmap)?;
        let opt = ivme::optim::AdamW::new(varmap.all_vars(), params(1e-3));
        let mut opt = acc.prepare_optimizer(&varmap, opt)?;
        for k in 0..steps {
            let grads = acc.backward(&loss(&model, k)?)?;
            opt.step(&grads)?;
        }
    }
    eprintln!("memory: {}", memory());
    varmap.save(get("out", "memory_limit.safetensors"))?;
    Ok(())
}
