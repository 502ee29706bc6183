//! Activation checkpointing (`ivme::activations`) against plain candle and against the same run
//! without it: a checkpointed Llama and MLP train to plain candle's weights with accumulation
//! and clipping, on one process and on two real ones, at every sharding stage; in bf16 with
//! dropout the run is the unchecked run bit for bit (the recompute replays the masks); BatchNorm
//! counts each batch once; a segment that cannot be replayed, or a run with no segment, is
//! refused with the fix.

mod common;
mod reference;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use ivme::models::llama::{Llama, LlamaConfig};
use ivme::{Accelerator, Precision};
use serde_json::Value;
use std::collections::BTreeMap;

type Weights = BTreeMap<String, Vec<f32>>;

fn run(n: usize, args: &[&str], tag: &str) -> Vec<Value> {
    common::reports(n, "harness", args, &format!("ckpt-{tag}"))
}

#[test]
fn two_checkpointed_ranks_with_accumulation_and_clipping_equal_plain_candle_at_every_stage() {
    // 12 samples per optimizer step: 2 ranks × 2 micro-batches of 3; 3 steps.
    let order: Vec<usize> = (0..36).collect();
    let (expected, norms) = reference::clipped(36, &reference::chunks(&order, 12, 3), 0.1, 0.05);
    assert!(norms.iter().all(|n| *n > 0.05), "the reference clips");
    for stage in ["no", "optimizer", "gradients", "parameters"] {
        let args = [
            "opt=sgd",
            "steps=6",
            "batch=3",
            "accum=2",
            "n=36",
            "lr=0.1",
            "clip_norm=0.05",
            "ckpt=1",
        ];
        let sharding = format!("sharding={stage}");
        let mut all = args.to_vec();
        all.push(&sharding);
        let reports = run(2, &all, &format!("clip-{stage}"));
        assert_eq!(reports.len(), 2, "sharding={stage}: every rank reports");
        for r in &reports {
            let diff = reference::max_diff(&common::params(r), &expected);
            assert!(diff <= 1e-6, "sharding={stage}: {diff} from plain candle");
        }
    }
}

#[test]
fn ivme_launchs_flag_turns_checkpointing_on_in_every_rank() {
    let out = common::scratch("ckpt-flag");
    let out_arg = format!("out={}", out.display());
    let args = ["opt=sgd", "steps=2", "batch=4", "n=16", &out_arg];
    let harness = common::example_bin("harness");
    let launched = |flags: &[&str]| {
        let mut all: Vec<&str> = flags.to_vec();
        all.push(harness.to_str().unwrap());
        all.extend(args);
        let o = std::process::Command::new(common::ivme_bin())
            .args(["launch", "--num_processes", "2", "--cpu"])
            .args(&all)
            .output()
            .unwrap();
        assert!(o.status.success(), "{:?}", common::text(&o));
        (0..2)
            .map(|r| {
                let b = std::fs::read(out.join(format!("rank{r}.json"))).unwrap();
                serde_json::from_slice::<Value>(&b).unwrap()
            })
            .collect::<Vec<_>>()
    };
    for r in launched(&["--activation_checkpointing"]) {
        assert_eq!(r["checkpointing"], true, "{r}");
        assert!(r["recompute_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    for r in launched(&[]) {
        assert_eq!(r["checkpointing"], false, "{r}");
        assert_eq!(r["recompute_s"].as_f64().unwrap(), 0.0, "{r}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn two_ranks_in_bf16_with_dropout_train_bit_for_bit_as_without_checkpointing() {
    let args = [
        "opt=adamw",
        "steps=8",
        "batch=4",
        "accum=2",
        "n=64",
        "lr=0.01",
        "precision=bf16",
        "dropout=0.3",
    ];
    let plain = run(2, &args, "bf16-plain");
    let mut on = args.to_vec();
    on.push("ckpt=1");
    let checkpointed = run(2, &on, "bf16-on");
    same_on_every_rank(&plain, &checkpointed, "bf16");
    let first = common::params(&plain[0]);
    let start = reference::model().0;
    let moved = start.data().lock().unwrap()["a.weight"]
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_ne!(first["a.weight"], moved, "the runs trained");
}

/// Asserts both runs' 2 ranks reported and each ended with the same weights bit for bit.
fn same_on_every_rank(plain: &[Value], checkpointed: &[Value], tag: &str) {
    assert_eq!(
        (plain.len(), checkpointed.len()),
        (2, 2),
        "{tag}: every rank reports"
    );
    for (r, (a, b)) in plain.iter().zip(checkpointed).enumerate() {
        let (a, b) = (common::params(a), common::params(b));
        assert!(a == b, "{tag}, rank {r}: weights differ with checkpointing");
    }
}

#[test]
fn fp16_with_loss_scaling_and_the_overlapped_sync_train_bit_for_bit_as_without_checkpointing() {
    let base = [
        "opt=adamw",
        "steps=8",
        "batch=4",
        "accum=2",
        "n=64",
        "lr=0.01",
    ];
    for (extra, tag) in [
        (&["precision=fp16", "init_scale=1024"][..], "fp16"),
        (&["overlap=1"][..], "overlap"),
    ] {
        let args = [&base[..], extra].concat();
        let plain = run(2, &args, &format!("{tag}-plain"));
        let checkpointed = run(2, &[&args[..], &["ckpt=1"]].concat(), &format!("{tag}-on"));
        same_on_every_rank(&plain, &checkpointed, tag);
    }
}

const ACCUM: usize = 2;
const STEPS: usize = 3;
const CLIP: f64 = 0.3;
const VOCAB: usize = 48;

/// A 3-block Llama, its head tied to its embedding or not.
fn config_of(tied: bool) -> LlamaConfig {
    LlamaConfig::from_json(&format!(
        r#"{{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "vocab_size": {VOCAB}, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 64, "tie_word_embeddings": {tied}}}"#
    ))
    .unwrap()
}

/// Sets every variable of `varmap` from one seeded generator, in name order.
fn init(varmap: &VarMap) {
    let mut rng = ivme::rng::Rng::new(7);
    let data = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names.into_iter().filter(|n| !n.contains("running_")) {
        let v = &data[name];
        let value = rng.randn(0.0, 0.2, v.shape(), &Device::Cpu).unwrap();
        v.set(&value.to_dtype(v.dtype()).unwrap()).unwrap();
    }
}

/// Micro-batch `j`: two sequences of 12 tokens, and each position's next token.
fn batch(j: usize) -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..26)
        .map(|i| ((i * i * 5 + j * 11 + i) % VOCAB) as u32)
        .collect();
    let rows =
        |from: usize| -> Vec<u32> { [&ids[from..from + 12], &ids[13 + from..25 + from]].concat() };
    (
        Tensor::from_vec(rows(0), (2, 12), &Device::Cpu).unwrap(),
        Tensor::from_vec(rows(1), (2, 12), &Device::Cpu).unwrap(),
    )
}

fn loss(model: &Llama, j: usize) -> Tensor {
    let (x, y) = batch(j);
    let logits = model.forward(&x).unwrap().to_dtype(DType::F32).unwrap();
    ivme::models::causal_lm_loss(&logits, &y.to_dtype(DType::I64).unwrap(), -100).unwrap()
}

fn weights(varmap: &VarMap) -> Weights {
    let data = varmap.data().lock().unwrap();
    data.iter()
        .map(|(k, v)| {
            let f = v.as_tensor().to_dtype(DType::F32).unwrap();
            (k.clone(), f.flatten_all().unwrap().to_vec1().unwrap())
        })
        .collect()
}

/// The Llama trained under the Accelerator: its weights and its step times.
fn llama_under_ivme(
    tied: bool,
    precision: Precision,
    checkpointing: bool,
) -> (Weights, ivme::step_times::StepTimes) {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .grad_accum(ACCUM)
        .clip_grad_norm(CLIP)
        .precision(precision)
        .activation_checkpointing(checkpointing)
        .build()
        .unwrap();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, acc.param_dtype(DType::F32), &Device::Cpu);
    let model = Llama::new(&config_of(tied), vb).unwrap();
    init(&varmap);
    let params = ivme::optim::ParamsAdamW {
        lr: 0.01,
        ..Default::default()
    };
    let opt = ivme::optim::AdamW::new(varmap.all_vars(), params);
    let mut opt = acc.prepare_optimizer(&varmap, opt).unwrap();
    for j in 0..STEPS * ACCUM {
        let grads = acc.backward(&loss(&model, j)).unwrap();
        opt.step(&grads).unwrap();
    }
    (weights(&varmap), acc.step_times())
}

/// The same Llama trained by plain candle: the window's mean gradient, clipped, candle-nn's
/// AdamW.
fn llama_under_candle(tied: bool) -> Weights {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = Llama::new(&config_of(tied), vb).unwrap();
    init(&varmap);
    let mut vars = {
        let data = varmap.data().lock().unwrap();
        data.iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<Vec<_>>()
    };
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let vars: Vec<candle_core::Var> = vars.into_iter().map(|(_, v)| v).collect();
    let params = candle_nn::ParamsAdamW {
        lr: 0.01,
        ..Default::default()
    };
    let mut opt = candle_nn::AdamW::new(vars.clone(), params).unwrap();
    for step in 0..STEPS {
        let losses =
            (step * ACCUM..(step + 1) * ACCUM).map(|j| (loss(&model, j) / ACCUM as f64).unwrap());
        let norm = reference::clipped_window_step(&mut opt, &vars, losses, CLIP);
        assert!(norm > CLIP, "the reference clips ({norm})");
    }
    weights(&varmap)
}

#[test]
fn a_checkpointed_llama_with_accumulation_and_clipping_trains_to_plain_candles_weights() {
    // Tied: the embedding's gradient is summed from the head's and the first block's parts in
    // another order than one backward sums them, so the runs agree to rounding, not bit for bit.
    let (checkpointed, times) = llama_under_ivme(true, Precision::No, true);
    let diff = reference::max_diff(&checkpointed, &llama_under_candle(true));
    assert!(diff <= 1e-6, "{diff} from plain candle");
    let (unchecked, plain_times) = llama_under_ivme(true, Precision::No, false);
    let diff = reference::max_diff(&checkpointed, &unchecked);
    assert!(diff <= 1e-6, "{diff} from the run without checkpointing");
    // The recompute is a phase of its own.
    assert!(times.recompute > 0.0, "{times:?}");
    assert_eq!(plain_times.recompute, 0.0, "{plain_times:?}");
}

#[test]
fn an_untied_checkpointed_llama_trains_bit_for_bit_as_without_checkpointing_in_f32_and_bf16() {
    for precision in [Precision::No, Precision::Bf16] {
        let (checkpointed, _) = llama_under_ivme(false, precision, true);
        let (unchecked, _) = llama_under_ivme(false, precision, false);
        let differ: usize = checkpointed
            .iter()
            .map(|(k, v)| v.iter().zip(&unchecked[k]).filter(|(a, b)| a != b).count())
            .sum();
        assert_eq!(differ, 0, "{precision:?}: {differ} weights differ");
    }
    let diff = reference::max_diff(
        &llama_under_ivme(false, Precision::No, true).0,
        &llama_under_candle(false),
    );
    assert!(diff <= 1e-6, "{diff} from plain candle");
}

/// A linear layer, BatchNorm in training mode, tanh: one segment.
#[derive(Clone)]
struct NormedBlock {
    linear: candle_nn::Linear,
    norm: candle_nn::BatchNorm,
}

impl NormedBlock {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.linear.forward(x)?;
        candle_nn::ModuleT::forward_t(&self.norm, &h, true)?.tanh()
    }
}

/// Trains a BatchNorm MLP whose normed layer is a segment; its weights and statistics.
fn batch_norm_run(checkpointing: bool) -> Weights {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .activation_checkpointing(checkpointing)
        .build()
        .unwrap();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let block = NormedBlock {
        linear: candle_nn::linear(4, 8, vb.pp("a")).unwrap(),
        norm: candle_nn::batch_norm(8, candle_nn::BatchNormConfig::default(), vb.pp("bn")).unwrap(),
    };
    let head = candle_nn::linear(8, 1, vb.pp("b")).unwrap();
    init(&varmap);
    let sgd = ivme::optim::ParamsSgd {
        lr: 0.1,
        ..Default::default()
    };
    let opt = <ivme::optim::Sgd as Optimizer>::new(varmap.all_vars(), sgd);
    let mut opt = acc.prepare_optimizer(&varmap, opt).unwrap();
    let (x, y) = reference::data(32);
    for step in 0..4 {
        let x = x.narrow(0, 8 * step, 8).unwrap();
        let y = y.narrow(0, 8 * step, 8).unwrap();
        let seg = block.clone();
        let h = ivme::activations::checkpoint(&x, move |x| seg.forward(x)).unwrap();
        let loss = candle_nn::loss::mse(&head.forward(&h).unwrap(), &y).unwrap();
        let grads = acc.backward(&loss).unwrap();
        opt.step(&grads).unwrap();
    }
    weights(&varmap)
}

#[test]
fn batch_norm_in_a_segment_counts_each_batch_once() {
    let checkpointed = batch_norm_run(true);
    let unchecked = batch_norm_run(false);
    assert_ne!(
        unchecked["bn.running_mean"],
        vec![0.0; 8],
        "the statistics moved"
    );
    assert_eq!(checkpointed, unchecked);
}

/// A checkpointing Accelerator with one prepared linear layer `inputs → outputs`.
fn one_layer(inputs: usize, outputs: usize) -> (Accelerator, candle_nn::Linear) {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .activation_checkpointing(true)
        .build()
        .unwrap();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let layer = candle_nn::linear(inputs, outputs, vb.pp("a")).unwrap();
    acc.prepare(&varmap).unwrap();
    (acc, layer)
}

#[test]
fn a_segment_with_candles_unseeded_dropout_is_refused_at_the_first_backward() {
    let (mut acc, layer) = one_layer(16, 16);
    let x = Tensor::ones((4, 16), DType::F32, &Device::Cpu).unwrap();
    let h = ivme::activations::checkpoint(&x, move |x| {
        candle_nn::ops::dropout(&layer.forward(x)?, 0.5)
    })
    .unwrap();
    let err = acc
        .backward(&h.sqr().unwrap().mean_all().unwrap())
        .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("segment 1 of 1"), "{msg}");
    assert!(msg.contains("ivme::rng::Rng"), "{msg}");
}

#[test]
fn checkpointing_with_no_segment_in_the_forward_is_refused_with_the_fix() {
    let (mut acc, layer) = one_layer(4, 1);
    let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu).unwrap();
    let loss = layer.forward(&x).unwrap().sum_all().unwrap();
    let msg = acc.backward(&loss).unwrap_err().to_string();
    assert!(msg.contains("ivme::activations::checkpoint"), "{msg}");
}

/// LoRA adapters (dropout 0.2) on a frozen Llama base read from `base`, trained for 4 windows;
/// the adapters' weights.
fn lora_run(base: &std::path::Path, checkpointing: bool) -> Weights {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .grad_accum(ACCUM)
        .activation_checkpointing(checkpointing)
        .build()
        .unwrap();
    let base = acc.load_base(base).unwrap();
    let config = ivme::finetune::LoraConfig::new(4, 8.0, &["q_proj", "v_proj"]).with_dropout(0.2);
    let lora = acc.lora(config).unwrap();
    let varmap = VarMap::new();
    let vb = acc.base_var_builder(&base, &varmap, DType::F32);
    let model = Llama::with_lora(&config_of(false), vb, &lora).unwrap();
    let params = ivme::optim::ParamsAdamW {
        lr: 0.02,
        ..Default::default()
    };
    let opt = ivme::optim::AdamW::new(varmap.all_vars(), params);
    let mut opt = acc.prepare_optimizer(&varmap, opt).unwrap();
    for j in 0..4 * ACCUM {
        let grads = acc.backward(&loss(&model, j)).unwrap();
        opt.step(&grads).unwrap();
    }
    weights(&varmap)
}

#[test]
fn lora_with_dropout_on_a_frozen_base_trains_bit_for_bit_as_without_checkpointing() {
    let dir = common::scratch("ckpt-lora-base");
    std::fs::create_dir_all(&dir).unwrap();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    Llama::new(&config_of(false), vb).unwrap();
    init(&varmap);
    varmap.save(dir.join("model.safetensors")).unwrap();
    let checkpointed = lora_run(&dir, true);
    let unchecked = lora_run(&dir, false);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        checkpointed.keys().all(|k| k.contains("lora")),
        "only adapters train"
    );
    assert_eq!(
        checkpointed, unchecked,
        "checkpointing changed the adapters"
    );
}
