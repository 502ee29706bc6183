//! ivme's trainable Llama (`ivme::models::llama`) saved as a Hugging Face folder and fine-tuned
//! as a frozen base under a new classification head: ivme's `base_var_builder` hands every Llama
//! weight out as a constant, only the head trains (the gradient runs back through the whole
//! body, which computes no weight gradient), and the head ends where plain candle puts it (the
//! Llama read with `VarBuilder::from_mmaped_safetensors`, the window's mean gradient clipped over
//! the head's gradients, candle-nn's AdamW).

#[path = "../../tests/reference/mod.rs"]
mod reference;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use ivme::models::llama::{Llama, LlamaConfig};
use reference::clipped_window_step;
use std::path::Path;

const ACCUM: usize = 2;
const STEPS: usize = 3;
const CLIP: f64 = 0.05;
const VOCAB: usize = 64;

fn config() -> LlamaConfig {
    LlamaConfig::from_json(&format!(
        r#"{{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "vocab_size": {VOCAB}, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 64, "tie_word_embeddings": false}}"#
    ))
    .unwrap()
}

/// A "pretrained" Llama: candle's default initialisation, saved as `dir/model.safetensors`.
fn write_base(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    Llama::new(&config(), vb).unwrap();
    varmap.save(dir.join("model.safetensors")).unwrap();
}

/// The head's starting weight and bias (vocabulary logits → 4 classes), the same in both runs.
fn head_start() -> (Tensor, Tensor) {
    let w: Vec<f32> = (0..4 * VOCAB)
        .map(|i| 0.1 * (i as f32 * 0.37).sin())
        .collect();
    (
        Tensor::from_vec(w, (4, VOCAB), &Device::Cpu).unwrap(),
        Tensor::new(&[0.01f32, -0.02, 0.03, 0.0], &Device::Cpu).unwrap(),
    )
}

/// Micro-batch `j`: two sequences of 8 tokens and their classes.
fn batch(j: usize) -> (Tensor, Tensor) {
    let t: Vec<u32> = (0..16).map(|i| ((i * 7 + j * 13) % VOCAB) as u32).collect();
    let labels = vec![(j % 4) as u32, ((j + 1) % 4) as u32];
    (
        Tensor::from_vec(t, (2, 8), &Device::Cpu).unwrap(),
        Tensor::from_vec(labels, 2, &Device::Cpu).unwrap(),
    )
}

/// The classification loss of batch `j`: the head over the last position's vocabulary logits.
fn loss(model: &Llama, head: &candle_nn::Linear, j: usize) -> Tensor {
    let (tokens, labels) = batch(j);
    let logits = model.forward(&tokens).unwrap();
    let last = logits.narrow(1, 7, 1).unwrap().squeeze(1).unwrap();
    candle_nn::loss::cross_entropy(&head.forward(&last).unwrap(), &labels).unwrap()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// Plain candle: the base as constants, the head as variables.
fn reference(base: &Path) -> Vec<Vec<f32>> {
    let file = base.join("model.safetensors");
    // SAFETY: the test's own file, not changed while mapped.
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[file], DType::F32, &Device::Cpu) }.unwrap();
    let model = Llama::new(&config(), vb).unwrap();
    let (w, b) = head_start();
    let (w, b) = (Var::from_tensor(&w).unwrap(), Var::from_tensor(&b).unwrap());
    let head = candle_nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()));
    let vars = [w.clone(), b.clone()];
    let mut opt = candle_nn::AdamW::new(vars.to_vec(), Default::default()).unwrap();
    for step in 0..STEPS {
        let losses = (step * ACCUM..(step + 1) * ACCUM)
            .map(|j| (loss(&model, &head, j) / ACCUM as f64).unwrap());
        let norm = clipped_window_step(&mut opt, &vars, losses, CLIP);
        assert!(norm > CLIP, "the reference must clip ({norm})");
    }
    vars.iter().map(|v| flat(v.as_tensor())).collect()
}

#[test]
fn a_llama_read_as_a_frozen_base_trains_only_its_new_head_as_plain_candle_does() {
    let dir = std::env::temp_dir().join(format!("ivme-ft-llama-{}", std::process::id()));
    let base_dir = dir.join("base");
    write_base(&base_dir);
    let mut acc = ivme::Accelerator::builder()
        .cpu(true)
        .grad_accum(ACCUM)
        .clip_grad_norm(CLIP)
        .build()
        .unwrap();
    let base = acc.load_base(&base_dir).unwrap();
    let varmap = VarMap::new();
    let vb = acc.base_var_builder(&base, &varmap, DType::F32);
    let model = Llama::new(&config(), vb.clone()).unwrap();
    let head = candle_nn::linear(VOCAB, 4, vb.pp("cls")).unwrap();
    let (w, b) = head_start();
    {
        let data = varmap.data().lock().unwrap();
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        assert_eq!(
            names,
            ["cls.bias", "cls.weight"],
            "only the new head is a variable"
        );
        data["cls.weight"].set(&w).unwrap();
        data["cls.bias"].set(&b).unwrap();
    }
    let opt = ivme::optim::AdamW::new(varmap.all_vars(), Default::default());
    let mut opt = acc.prepare_optimizer(&varmap, opt).unwrap();
    for j in 0..STEPS * ACCUM {
        let grads = acc.backward(&loss(&model, &head, j)).unwrap();
        opt.step(&grads).unwrap();
    }
    let got = [flat(head.weight()), flat(head.bias().unwrap())];
    let want = reference(&base_dir);
    for (name, (g, w)) in ["cls.weight", "cls.bias"].iter().zip(got.iter().zip(&want)) {
        let d = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(d <= 1e-6, "`{name}` is {d} from plain candle");
    }
    assert_ne!(got[0], flat(&head_start().0), "the head trained");
    let _ = std::fs::remove_dir_all(&dir);
}
