//! A LoRA fine-tune of a Llama read from a Hugging Face folder (transformers' own tiny llama,
//! tests/fixtures/models/llama) on 2 real processes: only the adapters train, the adapter is
//! saved in PEFT's layout, and `ivme merge-weights --adapter` folds it into a folder whose model
//! computes what the fine-tuned one did.

#[path = "../../tests/common/mod.rs"]
mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use common::{example_bin, ivme_bin, launch, text, Scratch};
use ivme::models::llama::{Llama, LlamaConfig};
use ivme::models::load_weights;
use std::path::PathBuf;

/// transformers' tiny llama as a Hugging Face folder holds it: `config.json` and
/// `model.safetensors`, copied out of the fixture (which keeps its reference tensors beside them).
fn base_folder(dir: &std::path::Path) -> PathBuf {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/llama");
    let base = dir.join("base");
    std::fs::create_dir_all(&base).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), base.join(f)).unwrap();
    }
    base
}

fn losses(stdout: &str) -> Vec<f32> {
    stdout
        .lines()
        .filter_map(|l| {
            l.split_once(": loss ")
                .map(|(_, v)| v.trim().parse().unwrap())
        })
        .collect()
}

#[test]
fn a_lora_fine_tune_of_a_hugging_face_llama_runs_on_2_processes_and_merges_back() {
    let dir = Scratch::new("llama-lora");
    let out = dir.0.join("out");
    let base_dir = base_folder(&dir.0);
    let o = launch(
        2,
        &example_bin("llama_lora"),
        &[base_dir.to_str().unwrap(), out.to_str().unwrap(), "8"],
        &[],
    );
    let (stdout, stderr) = text(&o);
    assert!(o.status.success(), "{stdout}\n{stderr}");
    let l = losses(&stdout);
    assert_eq!(l.len(), 8, "{stdout}");
    assert!(l[7] < 0.8 * l[0], "the adapters learn the task: {l:?}");
    assert!(!stderr.contains("got no gradient"), "{stderr}");

    // PEFT's layout: A and B of every block's q_proj and v_proj, nothing of the base.
    let adapter = out.join("adapter");
    let saved =
        candle_core::safetensors::load(adapter.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    let mut keys: Vec<&String> = saved.keys().collect();
    keys.sort();
    let mut want = Vec::new();
    for layer in 0..2 {
        for proj in ["q_proj", "v_proj"] {
            for ab in ["lora_A", "lora_B"] {
                want.push(format!(
                    "base_model.model.model.layers.{layer}.self_attn.{proj}.{ab}.weight"
                ));
            }
        }
    }
    want.sort();
    assert_eq!(keys, want.iter().collect::<Vec<_>>());

    let merged = dir.0.join("merged");
    let o = std::process::Command::new(ivme_bin())
        .args(["merge-weights", "--adapter"])
        .arg(&adapter)
        .arg(&merged)
        .output()
        .unwrap();
    assert!(o.status.success(), "{:?}", text(&o));

    // The merged folder is an ordinary llama folder: ivme's model reads it and computes the
    // fine-tuned model's logits on the probe batch.
    let cfg = LlamaConfig::from_folder(&merged).unwrap();
    let varmap = VarMap::new();
    let model = Llama::new(
        &cfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    load_weights(&varmap, &merged).unwrap();
    let probe: Vec<u32> = (0..4 * 12)
        .map(|i| {
            let (row, pos) = (i / 12, i % 12);
            ((row * 11 + 5 + 3 * pos) % cfg.vocab_size) as u32
        })
        .collect();
    let probe = Tensor::from_vec(probe, (4, 12), &Device::Cpu).unwrap();
    let ours = model.forward(&probe).unwrap();
    let tuned =
        candle_core::safetensors::load(out.join("probe.safetensors"), &Device::Cpu).unwrap();
    let d = (ours - &tuned["logits"])
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(
        d < 1e-4,
        "the merged model is {d} away from the fine-tuned one"
    );

    // Only the adapted projections changed.
    let base =
        candle_core::safetensors::load(base_dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let m = candle_core::safetensors::load(merged.join("model.safetensors"), &Device::Cpu).unwrap();
    for (name, t) in &base {
        let diff = (t - &m[name])
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let adapted = name.contains("q_proj") || name.contains("v_proj");
        assert_eq!(diff > 0.0, adapted, "{name}: changed by {diff}");
    }
}
