//! ivme's Gemma 2 against PyTorch: the loss, the logits and every parameter's gradient of
//! transformers' own `Gemma2ForCausalLM` on the same tiny weights and tokens
//! (tests/fixtures/models/gemma2, made by scripts/make-model-fixtures.sh; its README lists
//! what the fixture exercises), and the config fields it refuses.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use ivme::models::gemma2::{Gemma2, Gemma2Config};
use ivme::models::CausalLm;
use ivme::models::{causal_lm_loss, load_weights, IGNORE_INDEX};
use std::collections::HashMap;
use std::path::PathBuf;

fn folder() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/gemma2")
}

fn reference() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(folder().join("reference.safetensors"), &Device::Cpu).unwrap()
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

fn config_json() -> serde_json::Value {
    let text = std::fs::read_to_string(folder().join("config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn gemma2_with_softcapping_and_a_sliding_layer_matches_transformers() {
    let dir = folder();
    let cfg = Gemma2Config::from_folder(&dir).unwrap();
    assert_eq!(cfg.sliding_layers, [true, false], "layer_types is read");
    let varmap = VarMap::new();
    let model = Gemma2::new(
        &cfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    assert!(model.blocks()[0].is_sliding() && !model.blocks()[1].is_sliding());
    load_weights(&varmap, &dir).unwrap();
    let mut vars: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let count: usize = vars.iter().map(|(_, v)| v.elem_count()).sum();
    assert_eq!(count, cfg.num_parameters());
    assert_eq!(count, 17696, "the README's parameter count");

    let reference = reference();
    let r = |k: &str| {
        reference
            .get(k)
            .unwrap_or_else(|| panic!("fixture lacks {k}"))
            .clone()
    };
    let (ids, mask, labels) = (r("input_ids"), r("attention_mask"), r("labels"));
    // Attention soft-capping moves these logits by only ~1.6e-3 at most (the README): 2.8e-4
    // relative, which 1e-5 catches with a margin of ~30 (without the final capping: 2.9e-3).
    let plain = model.forward(&ids).unwrap();
    let e = relative(&plain, &r("logits_nomask"));
    assert!(e < 1e-5, "logits without a mask differ by {e:e} (relative)");
    let logits = model.forward_masked(&ids, Some(&mask)).unwrap();
    // Padded positions' logits are left out: their labels are ignored, so no loss reads them.
    let keep = mask.to_dtype(DType::F32).unwrap().unsqueeze(2).unwrap();
    let e = relative(
        &logits.broadcast_mul(&keep).unwrap(),
        &r("logits").broadcast_mul(&keep).unwrap(),
    );
    assert!(e < 1e-5, "masked logits differ by {e:e} (relative)");
    let loss = causal_lm_loss(&logits, &labels, IGNORE_INDEX).unwrap();
    let (ours, theirs) = (
        loss.to_scalar::<f32>().unwrap(),
        r("loss").flatten_all().unwrap().to_vec1::<f32>().unwrap()[0],
    );
    assert!(
        ((ours - theirs) / theirs).abs() < 1e-5,
        "loss {ours} vs transformers' {theirs}"
    );
    let grads = loss.backward().unwrap();
    for (n, v) in &vars {
        let g = grads
            .get(v)
            .unwrap_or_else(|| panic!("`{n}` got no gradient"));
        let e = relative(g, &r(&format!("grad.{n}")));
        assert!(
            e < 1e-4,
            "the gradient of `{n}` differs by {e:e} (relative)"
        );
    }
    let expected = reference.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(
        vars.len(),
        expected,
        "a variable for every parameter of transformers' model"
    );
}

#[test]
fn gemma2_with_lora_adapters_starts_from_the_base_and_trains_only_them() {
    let dir = folder();
    let cfg = Gemma2Config::from_folder(&dir).unwrap();
    let acc = ivme::Accelerator::builder().cpu(true).build().unwrap();
    let lora = acc
        .lora(ivme::finetune::LoraConfig::new(
            2,
            4.0,
            &["q_proj", "v_proj", "down_proj"],
        ))
        .unwrap();
    let varmap = VarMap::new();
    let base = acc.load_base(&dir).unwrap();
    let vb = acc.base_var_builder(&base, &varmap, DType::F32);
    let model = Gemma2::with_lora(&cfg, vb, &lora).unwrap();
    assert_eq!(lora.adapted().len(), 6, "{:?}", lora.adapted());
    let reference = reference();
    let logits = model.forward(&reference["input_ids"]).unwrap();
    let e = relative(&logits, &reference["logits_nomask"]);
    assert!(e < 1e-5, "B = 0: the base's logits, not {e:e} away");
    let loss = causal_lm_loss(&logits, &reference["labels"], IGNORE_INDEX).unwrap();
    let grads = loss.backward().unwrap();
    let data = varmap.data().lock().unwrap();
    assert_eq!(
        data.len(),
        12,
        "an A and a B per adapted linear, nothing else"
    );
    for (n, v) in data.iter() {
        assert!(n.contains("lora_"), "`{n}` is not an adapter");
        assert!(grads.get(v).is_some(), "`{n}` got no gradient");
    }
}

#[test]
fn gemma2_config_fields_it_cannot_train_are_refused_naming_the_field() {
    let refused = |v: &serde_json::Value| {
        Gemma2Config::from_json(&v.to_string())
            .unwrap_err()
            .to_string()
    };
    let mut v = config_json();
    v["model_type"] = "llama".into();
    let err = refused(&v);
    assert!(err.contains("model_type") && err.contains("llama"), "{err}");

    let mut v = config_json();
    v["rope_parameters"]["rope_type"] = "linear".into();
    v["rope_parameters"]["factor"] = 2.0.into();
    let err = refused(&v);
    assert!(
        err.contains("rope_parameters") && err.contains("linear") && err.contains("default"),
        "{err}"
    );
    // transformers 4's spelling.
    let mut v = config_json();
    v["rope_parameters"] = serde_json::Value::Null;
    v["rope_scaling"] = serde_json::json!({"type": "dynamic", "factor": 4.0});
    let err = refused(&v);
    assert!(
        err.contains("rope_scaling") && err.contains("dynamic"),
        "{err}"
    );

    let mut v = config_json();
    v["attention_dropout"] = 0.1.into();
    let err = refused(&v);
    assert!(
        err.contains("attention_dropout") && err.contains("set it to 0"),
        "{err}"
    );

    let mut v = config_json();
    v["hidden_activation"] = "gelu".into();
    let err = refused(&v);
    assert!(
        err.contains("hidden_activation") && err.contains("gelu_pytorch_tanh"),
        "{err}"
    );
    let mut v = config_json();
    v.as_object_mut().unwrap().remove("hidden_activation");
    v["hidden_act"] = "silu".into();
    let err = refused(&v);
    assert!(err.contains("hidden_act") && err.contains("silu"), "{err}");
    v["hidden_act"] = "gelu_tanh".into();
    Gemma2Config::from_json(&v.to_string()).unwrap();

    let mut v = config_json();
    v["layer_types"] = serde_json::json!(["sliding_attention", "chunked_attention"]);
    let err = refused(&v);
    assert!(
        err.contains("layer_types") && err.contains("chunked_attention"),
        "{err}"
    );
}

#[test]
fn a_transformers_4_config_reads_as_its_transformers_5_form() {
    let five = Gemma2Config::from_folder(folder()).unwrap();
    let mut v = config_json();
    let mut rope = v["rope_parameters"].take();
    v["rope_theta"] = rope["rope_theta"].take();
    // transformers 4 wrote no layer_types for Gemma 2: even layers slide.
    v.as_object_mut().unwrap().remove("layer_types");
    let four = Gemma2Config::from_json(&v.to_string()).unwrap();
    assert_eq!(four, five);
    assert_eq!(five.rope_theta, 10_000.0);
    assert_eq!(five.query_pre_attn_scalar, 8.0);
    assert_eq!(five.attn_logit_softcapping, Some(50.0));
    assert_eq!(five.final_logit_softcapping, Some(30.0));
    assert_eq!(five.sliding_window, Some(4));
    // `null` turns a soft-capping off; absence means transformers' default.
    v["final_logit_softcapping"] = serde_json::Value::Null;
    v.as_object_mut().unwrap().remove("attn_logit_softcapping");
    let c = Gemma2Config::from_json(&v.to_string()).unwrap();
    assert_eq!(c.final_logit_softcapping, None);
    assert_eq!(c.attn_logit_softcapping, Some(50.0));
}
