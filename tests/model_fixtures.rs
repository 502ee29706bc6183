//! ivme's trainable model families against PyTorch: the loss, the logits and every parameter's
//! gradient of transformers' own model on the same tiny weights and tokens (fixtures made by
//! scripts/make-model-fixtures.sh, never in CI; tests/fixtures/models/README.md).

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use ivme::models::bert::{Bert, BertConfig};
use ivme::models::llama::{Llama, LlamaConfig};
use ivme::models::{causal_lm_loss, load_weights, token_loss, IGNORE_INDEX};
use std::collections::HashMap;
use std::path::PathBuf;

fn folder(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

/// `‖a − b‖ / ‖b‖` (or `‖a − b‖` when `b` is zero).
fn relative(a: &Tensor, b: &Tensor) -> f32 {
    let diff = (a - b).unwrap().sqr().unwrap().sum_all().unwrap();
    let norm = b.sqr().unwrap().sum_all().unwrap();
    let (d, n) = (
        diff.to_scalar::<f32>().unwrap().sqrt(),
        norm.to_scalar::<f32>().unwrap().sqrt(),
    );
    if n > 0.0 {
        d / n
    } else {
        d
    }
}

struct Loaded {
    model: Llama,
    vars: Vec<(String, Var)>,
    reference: HashMap<String, Tensor>,
}

fn load_llama(name: &str) -> Loaded {
    let dir = folder(name);
    let cfg = LlamaConfig::from_folder(&dir).unwrap();
    let varmap = VarMap::new();
    let model = Llama::new(
        &cfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    load_weights(&varmap, &dir).unwrap();
    let mut vars: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let reference =
        candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    Loaded {
        model,
        vars,
        reference,
    }
}

/// Loss, logits (masked and not) and every gradient equal transformers' for fixture `name`.
fn matches_transformers(name: &str) {
    let Loaded {
        model,
        vars,
        reference,
    } = load_llama(name);
    let r = |k: &str| {
        reference
            .get(k)
            .unwrap_or_else(|| panic!("{name}: fixture lacks {k}"))
            .clone()
    };
    let ids = r("input_ids");
    let mask = r("attention_mask");
    let labels = r("labels");
    let plain = model.forward(&ids).unwrap();
    let e = relative(&plain, &r("logits_nomask"));
    assert!(
        e < 1e-5,
        "{name}: logits without a mask differ by {e:e} (relative)"
    );
    let logits = model.forward_masked(&ids, Some(&mask)).unwrap();
    // Padded positions' logits are left out: their labels are ignored, so no loss reads them.
    let keep = mask.to_dtype(DType::F32).unwrap().unsqueeze(2).unwrap();
    let e = relative(
        &logits.broadcast_mul(&keep).unwrap(),
        &r("logits").broadcast_mul(&keep).unwrap(),
    );
    assert!(e < 1e-5, "{name}: masked logits differ by {e:e} (relative)");
    let loss = causal_lm_loss(&logits, &labels, IGNORE_INDEX).unwrap();
    let (ours, theirs) = (
        loss.to_scalar::<f32>().unwrap(),
        r("loss").flatten_all().unwrap().to_vec1::<f32>().unwrap()[0],
    );
    assert!(
        ((ours - theirs) / theirs).abs() < 1e-5,
        "{name}: loss {ours} vs transformers' {theirs}"
    );
    let grads = loss.backward().unwrap();
    for (n, v) in &vars {
        let g = grads
            .get(v)
            .unwrap_or_else(|| panic!("{name}: `{n}` got no gradient"));
        let e = relative(g, &r(&format!("grad.{n}")));
        assert!(
            e < 1e-4,
            "{name}: the gradient of `{n}` differs by {e:e} (relative)"
        );
    }
    let expected = reference.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(
        vars.len(),
        expected,
        "{name}: a variable for every parameter of transformers' model"
    );
}

#[test]
fn llama_with_llama3_rope_scaling_matches_transformers() {
    matches_transformers("llama");
}

#[test]
fn llama_with_tied_embeddings_matches_transformers() {
    matches_transformers("llama_tied");
}

#[test]
fn mistral_with_a_sliding_window_matches_transformers() {
    matches_transformers("mistral");
}

#[test]
fn qwen2_with_qkv_biases_matches_transformers() {
    matches_transformers("qwen2");
}

#[test]
fn phi3_with_fused_projections_matches_transformers() {
    matches_transformers("phi3");
}

#[test]
fn bert_with_its_masked_lm_head_matches_transformers() {
    let dir = folder("bert");
    let cfg = BertConfig::from_folder(&dir).unwrap();
    let varmap = VarMap::new();
    let model = Bert::new(
        &cfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    load_weights(&varmap, &dir).unwrap();
    let reference =
        candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let r = |k: &str| reference[k].clone();
    let (ids, types, mask) = (r("input_ids"), r("token_type_ids"), r("attention_mask"));
    let plain = model.forward(&ids, Some(&types), None).unwrap();
    let e = relative(&plain, &r("logits_nomask"));
    assert!(e < 1e-5, "bert: logits without a mask differ by {e:e}");
    let logits = model.forward(&ids, Some(&types), Some(&mask)).unwrap();
    let keep = mask.to_dtype(DType::F32).unwrap().unsqueeze(2).unwrap();
    let e = relative(
        &logits.broadcast_mul(&keep).unwrap(),
        &r("logits").broadcast_mul(&keep).unwrap(),
    );
    assert!(e < 1e-5, "bert: masked logits differ by {e:e}");
    let (b, t, v) = logits.dims3().unwrap();
    let loss = token_loss(
        &logits.reshape((b * t, v)).unwrap(),
        &r("labels").flatten_all().unwrap(),
        IGNORE_INDEX,
    )
    .unwrap();
    let theirs = r("loss").flatten_all().unwrap().to_vec1::<f32>().unwrap()[0];
    let ours = loss.to_scalar::<f32>().unwrap();
    assert!(
        ((ours - theirs) / theirs).abs() < 1e-5,
        "bert: loss {ours} vs {theirs}"
    );
    let grads = loss.backward().unwrap();
    let data = varmap.data().lock().unwrap();
    for (n, var) in data.iter() {
        let g = grads
            .get(var)
            .unwrap_or_else(|| panic!("bert: `{n}` got no gradient"));
        let want = r(&format!("grad.{n}"));
        // The key biases' gradients are ~1e-8 (softmax ignores a constant added to a row of
        // scores): there the absolute difference is what can be compared.
        let abs = (g - &want).unwrap().abs().unwrap().max_all().unwrap();
        let (e, abs) = (relative(g, &want), abs.to_scalar::<f32>().unwrap());
        assert!(
            e < 1e-4 || abs < 1e-6,
            "bert: the gradient of `{n}` differs by {e:e} ({abs:e})"
        );
    }
    let expected = reference.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(data.len(), expected, "bert: a variable for every parameter");
}

#[test]
fn a_folder_whose_weights_do_not_match_its_config_is_refused_naming_the_tensor() {
    let dir = folder("llama");
    let mut cfg = LlamaConfig::from_folder(&dir).unwrap();
    cfg.intermediate_size += 1;
    let varmap = VarMap::new();
    Llama::new(
        &cfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    let err = load_weights(&varmap, &dir).unwrap_err().to_string();
    assert!(err.contains("model.layers.0.mlp.up_proj.weight"), "{err}");
    assert!(
        err.contains(&format!("{}", cfg.intermediate_size)),
        "names the shapes: {err}"
    );
}

#[test]
fn config_fields_the_family_cannot_train_are_refused_with_the_fix() {
    let base = std::fs::read_to_string(folder("llama").join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&base).unwrap();
    let refused = |v: &serde_json::Value| {
        LlamaConfig::from_json(&v.to_string())
            .unwrap_err()
            .to_string()
    };
    // transformers 5 writes `rope_parameters`, 4 wrote `rope_scaling`: both are read.
    v["rope_parameters"]["rope_type"] = "yarn".into();
    let err = refused(&v);
    assert!(err.contains("yarn") && err.contains("llama3"), "{err}");
    v["rope_parameters"] = serde_json::Value::Null;
    v["rope_scaling"] = serde_json::json!({"type": "dynamic", "factor": 4.0});
    let err = refused(&v);
    assert!(err.contains("dynamic"), "{err}");
    v["rope_scaling"] = serde_json::Value::Null;
    v["hidden_act"] = "gelu".into();
    let err = refused(&v);
    assert!(err.contains("gelu") && err.contains("silu"), "{err}");
    v["hidden_act"] = "silu".into();
    v["model_type"] = "gemma2".into();
    let err = refused(&v);
    assert!(err.contains("gemma2"), "{err}");
}

#[test]
fn a_transformers_4_config_reads_as_its_transformers_5_form() {
    let five = LlamaConfig::from_folder(folder("llama")).unwrap();
    let text = std::fs::read_to_string(folder("llama").join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut rope = v["rope_parameters"].take();
    v["rope_theta"] = rope["rope_theta"].take();
    v["rope_scaling"] = rope;
    let four = LlamaConfig::from_json(&v.to_string()).unwrap();
    assert_eq!(four, five);
    assert!(
        five.rope_scaling.is_some(),
        "the fixture's llama3 scaling is read"
    );
}
