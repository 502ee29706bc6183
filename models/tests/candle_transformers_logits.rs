//! ivme's trainable model families against candle-transformers 0.11.1's inference models of the
//! same families: the same weights (the tiny transformers 5 fixtures in
//! tests/fixtures/models, whose README says what each exercises) and the same tokens (each
//! fixture's `input_ids`, without a padding mask: candle-transformers' causal LMs take none)
//! give the same logits within 1e-5 (relative norm of the difference).
//!
//! candle-transformers' causal LMs return only the last position's logits, so ivme's are
//! compared at that position. For BERT, `BertModel`'s hidden states are compared with ivme's
//! encoder's, and `BertForMaskedLM`'s logits with ivme's (its decoder tied by hand: see that
//! test).
//!
//! Where candle-transformers computes something else on purpose, the comparison is not bent:
//! the tests compare what is comparable and pin what differs (mistral and gemma2's sliding
//! windows, in the tests named `..._differs_...`; BERT's untied decoder).

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models as ct;
use ivme::models::bert::{Bert, BertConfig};
use ivme::models::gemma2::{Gemma2, Gemma2Config};
use ivme::models::llama::{Llama, LlamaConfig};
use ivme::models::load_weights;
use serde_json::Value;
use std::path::PathBuf;

/// The relative tolerance every comparison is held to.
const TOLERANCE: f32 = 1e-5;

fn folder(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models")
        .join(name)
}

/// The fixture's `input_ids` `(2, 9)` as u32 (the padded positions of the second sequence are
/// id 0, then ordinary tokens: neither model gets a mask).
fn input_ids(name: &str) -> Tensor {
    reference(name, "input_ids").to_dtype(DType::U32).unwrap()
}

fn reference(name: &str, key: &str) -> Tensor {
    let path = folder(name).join("reference.safetensors");
    let mut all = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    all.remove(key)
        .unwrap_or_else(|| panic!("{name}: the fixture lacks {key}"))
}

/// The fixture's config.json in the form candle-transformers reads: transformers 5 writes the
/// RoPE settings as `rope_parameters {rope_theta, rope_type, ...}`, candle-transformers reads a
/// top-level `rope_theta` (and `partial_rotary_factor` for phi3) and, for llama3 scaling, a
/// `rope_scaling` object holding `rope_type`, `factor`, `low_freq_factor`, `high_freq_factor`
/// and `original_max_position_embeddings` (which `rope_parameters` holds as they are).
fn candle_config_json(name: &str) -> Value {
    let text = std::fs::read_to_string(folder(name).join("config.json")).unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    if v.get("rope_parameters").is_none() {
        return v; // BERT: absolute positions, no RoPE
    }
    let rope = v["rope_parameters"].take();
    let obj = v.as_object_mut().unwrap();
    obj.remove("rope_parameters");
    obj.insert("rope_theta".into(), rope["rope_theta"].clone());
    if let Some(f) = rope.get("partial_rotary_factor") {
        obj.insert("partial_rotary_factor".into(), f.clone());
    }
    match rope["rope_type"].as_str() {
        Some("default") => {}
        Some("llama3") => {
            obj.insert("rope_scaling".into(), rope.clone());
        }
        other => panic!("{name}: rope_type {other:?} has no conversion here"),
    }
    v
}

fn candle_config<T: serde::de::DeserializeOwned>(v: &Value) -> T {
    serde_json::from_value(v.clone()).unwrap()
}

/// The fixture's model.safetensors for a candle-transformers model, memory-mapped.
fn candle_weights(name: &str) -> VarBuilder<'static> {
    let path = folder(name).join("model.safetensors");
    // SAFETY: the fixture is a file of the repository that nothing writes while the test runs.
    unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu) }.unwrap()
}

/// ivme's llama-family model (llama, mistral, qwen2, phi3) for fixture `name`.
fn ivme_llama(name: &str) -> Llama {
    let dir = folder(name);
    let cfg = LlamaConfig::from_folder(&dir).unwrap();
    let varmap = VarMap::new();
    let model = Llama::new(
        &cfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    load_weights(&varmap, &dir).unwrap();
    model
}

fn ivme_gemma2() -> Gemma2 {
    let dir = folder("gemma2");
    let cfg = Gemma2Config::from_folder(&dir).unwrap();
    let varmap = VarMap::new();
    let model = Gemma2::new(
        &cfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    load_weights(&varmap, &dir).unwrap();
    model
}

/// ivme's logits `(b, t, vocab)` at the last position: `(b, vocab)`.
fn last_position(logits: &Tensor) -> Tensor {
    let t = logits.dim(1).unwrap();
    logits.narrow(1, t - 1, 1).unwrap().squeeze(1).unwrap()
}

/// candle-transformers' `(b, 1, vocab)` last-position logits as `(b, vocab)`.
fn squeeze_last(logits: Tensor, b: usize) -> Tensor {
    let (lb, one, _) = logits.dims3().unwrap();
    assert_eq!(
        (lb, one),
        (b, 1),
        "candle-transformers' last-position logits"
    );
    logits.squeeze(1).unwrap()
}

/// `(‖a − b‖ / ‖b‖, max |a − b|)`.
fn difference(a: &Tensor, b: &Tensor) -> (f32, f32) {
    assert_eq!(a.dims(), b.dims(), "shapes");
    let d = (a - b).unwrap();
    let norm = |x: &Tensor| {
        x.sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            .sqrt()
    };
    let max = d
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    (norm(&d) / norm(b), max)
}

/// ivme's `ours` equals candle-transformers' `theirs` within [`TOLERANCE`].
fn assert_same(what: &str, ours: &Tensor, theirs: &Tensor) {
    let (rel, max) = difference(ours, theirs);
    eprintln!("{what}: relative difference {rel:e}, max abs {max:e}");
    assert!(
        rel < TOLERANCE,
        "{what}: ivme's and candle-transformers' outputs differ by {rel:e} (relative; \
         max abs difference {max:e}, tolerance {TOLERANCE:e})"
    );
}

/// candle-transformers' llama (`llama::Llama`, whose `forward` returns `(b, vocab)`).
fn candle_llama_last_logits(name: &str, ids: &Tensor) -> Tensor {
    let cfg: ct::llama::LlamaConfig = candle_config(&candle_config_json(name));
    let cfg = cfg.into_config(false);
    let model = ct::llama::Llama::load(candle_weights(name), &cfg).unwrap();
    let mut cache = ct::llama::Cache::new(false, DType::F32, &cfg, &Device::Cpu).unwrap();
    model.forward(ids, 0, &mut cache).unwrap()
}

#[test]
fn llama_with_llama3_rope_scaling_matches_candle_transformers() {
    let cfg: ct::llama::LlamaConfig = candle_config(&candle_config_json("llama"));
    assert!(
        matches!(
            cfg.rope_scaling,
            Some(ct::llama::Llama3RopeConfig {
                rope_type: ct::llama::Llama3RopeType::Llama3,
                ..
            })
        ),
        "the llama3 scaling reaches candle-transformers"
    );
    let ids = input_ids("llama");
    let theirs = candle_llama_last_logits("llama", &ids);
    let ours = last_position(&ivme_llama("llama").forward(&ids).unwrap());
    assert_same("llama", &ours, &theirs);
}

#[test]
fn llama_with_tied_embeddings_matches_candle_transformers() {
    let ids = input_ids("llama_tied");
    let theirs = candle_llama_last_logits("llama_tied", &ids);
    let ours = last_position(&ivme_llama("llama_tied").forward(&ids).unwrap());
    assert_same("llama_tied", &ours, &theirs);
}

/// candle-transformers' mistral on the first `t` tokens, its `sliding_window` set to `window`.
fn candle_mistral_last_logits(ids: &Tensor, window: Option<usize>) -> Tensor {
    let mut v = candle_config_json("mistral");
    v["sliding_window"] = window.into();
    let cfg: ct::mistral::Config = candle_config(&v);
    let mut model = ct::mistral::Model::new(&cfg, candle_weights("mistral")).unwrap();
    squeeze_last(model.forward(ids, 0).unwrap(), ids.dim(0).unwrap())
}

/// The fixture's window (4, as transformers counts it: query position q sees key k when
/// `q - 4 < k <= q`) and candle-transformers' count one key apart (see
/// `mistral_differs_from_candle_transformers_by_one_key_of_the_window`), so the sequences
/// compared here are the first 4 tokens, which neither window shortens.
#[test]
fn mistral_within_its_window_matches_candle_transformers() {
    let window = 4;
    let ids = input_ids("mistral").narrow(1, 0, window).unwrap();
    let theirs = candle_mistral_last_logits(&ids, Some(window));
    let ours = last_position(&ivme_llama("mistral").forward(&ids).unwrap());
    assert_same("mistral, 4 tokens", &ours, &theirs);
}

/// candle-transformers' mistral masks key j for query i when `j + sliding_window < i`
/// (candle-transformers-0.11.1/src/models/mistral.rs:406, `prepare_decoder_attention_mask`):
/// a query sees `sliding_window + 1` keys, itself included. transformers (and ivme) count the
/// query in the window: `q - window < k <= q`, `window` keys. On the fixture's 9 tokens the two
/// differ with the fixture's window 4; candle-transformers given 3 gives ivme's logits, which
/// pins the difference to exactly that one key.
#[test]
fn mistral_differs_from_candle_transformers_by_one_key_of_the_window() {
    let ids = input_ids("mistral");
    let ours = last_position(&ivme_llama("mistral").forward(&ids).unwrap());
    let (rel, max) = difference(&ours, &candle_mistral_last_logits(&ids, Some(4)));
    eprintln!("mistral, 9 tokens, candle window 4: relative difference {rel:e}, max abs {max:e}");
    assert!(
        rel > 1e-2,
        "candle-transformers' window 4 was expected to see one key more than ivme's \
         (relative difference only {rel:e}, max abs {max:e}): has mistral.rs's mask changed?"
    );
    assert_same(
        "mistral, 9 tokens, candle window 3",
        &ours,
        &candle_mistral_last_logits(&ids, Some(3)),
    );
}

#[test]
fn qwen2_with_qkv_biases_matches_candle_transformers() {
    let name = "qwen2";
    let mut v = candle_config_json(name);
    // candle-transformers' qwen2 reads `sliding_window` as a number and applies it in every
    // layer whatever `use_sliding_window` says (qwen2.rs:307); the fixture has no window
    // (`null`, `use_sliding_window` false), so a window as long as the positions keeps it off.
    assert!(v["sliding_window"].is_null() && v["use_sliding_window"] == false);
    v["sliding_window"] = v["max_position_embeddings"].clone();
    let cfg: ct::qwen2::Config = candle_config(&v);
    assert!(cfg.tie_word_embeddings);
    let mut model = ct::qwen2::ModelForCausalLM::new(&cfg, candle_weights(name)).unwrap();
    let ids = input_ids(name);
    let theirs = squeeze_last(model.forward(&ids, 0).unwrap(), ids.dim(0).unwrap());
    let ours = last_position(&ivme_llama(name).forward(&ids).unwrap());
    assert_same(name, &ours, &theirs);
}

#[test]
fn phi3_with_fused_projections_matches_candle_transformers() {
    let name = "phi3";
    let cfg: ct::phi3::Config = candle_config(&candle_config_json(name));
    assert!(cfg.rope_scaling.is_none() && !cfg.tie_word_embeddings);
    let mut model = ct::phi3::Model::new(&cfg, candle_weights(name)).unwrap();
    let ids = input_ids(name);
    let theirs = squeeze_last(model.forward(&ids, 0).unwrap(), ids.dim(0).unwrap());
    let ours = last_position(&ivme_llama(name).forward(&ids).unwrap());
    assert_same(name, &ours, &theirs);
}

/// candle-transformers' gemma2 on `ids`, its `sliding_window` set to `window`.
fn candle_gemma2_last_logits(ids: &Tensor, window: Option<usize>) -> Tensor {
    let mut v = candle_config_json("gemma2");
    v["sliding_window"] = window.into();
    let cfg: ct::gemma2::Config = candle_config(&v);
    let mut model = ct::gemma2::Model::new(false, &cfg, candle_weights("gemma2")).unwrap();
    squeeze_last(model.forward(ids, 0).unwrap(), ids.dim(0).unwrap())
}

/// The fixture's window (4, on layer 0 only) cannot be given to candle-transformers' gemma2
/// (see `gemma2_differs_from_candle_transformers_by_windowing_every_layer`), so the sequences
/// compared here are the first 4 tokens, which no window of 4 shortens in either. The
/// soft-cappings, the `1 + weight` norms, the four norms per layer and the embedding scale are
/// all in play (the attention scale too: candle-transformers scales by `1/sqrt(head_dim)`
/// (gemma2.rs:240), not by `query_pre_attn_scalar`, which the fixture sets equal to head_dim).
#[test]
fn gemma2_within_its_window_matches_candle_transformers() {
    let window = 4;
    let v = candle_config_json("gemma2");
    assert_eq!(v["sliding_window"], window);
    assert_eq!(v["query_pre_attn_scalar"], v["head_dim"]);
    let ids = input_ids("gemma2").narrow(1, 0, window).unwrap();
    let theirs = candle_gemma2_last_logits(&ids, Some(window));
    let ours = last_position(&ivme_gemma2().forward(&ids).unwrap());
    assert_same("gemma2, 4 tokens", &ours, &theirs);
}

/// candle-transformers' gemma2 builds one mask for every layer (gemma2.rs:398-413, from
/// `Config::sliding_window`, gemma2.rs:33; the config has no `layer_types`), so it windows the
/// global layers too, where transformers (and ivme) window only the `sliding_attention` layers
/// (layer 0 of the fixture's 2); and that mask, like mistral's, lets a query see
/// `sliding_window + 1` keys (`j + sliding_window < i`, gemma2.rs:405). On the fixture's 9
/// tokens no window makes the two agree: not the fixture's 4, not 3 (the one-key shift
/// alone, which mistral's test shows suffices there), and not none.
#[test]
fn gemma2_differs_from_candle_transformers_by_windowing_every_layer() {
    let ids = input_ids("gemma2");
    let ours = last_position(&ivme_gemma2().forward(&ids).unwrap());
    for window in [Some(4), Some(3), None] {
        let (rel, max) = difference(&ours, &candle_gemma2_last_logits(&ids, window));
        eprintln!(
            "gemma2, 9 tokens, candle window {window:?}: relative difference {rel:e}, \
             max abs {max:e}"
        );
        assert!(
            rel > 1e-2,
            "candle-transformers' gemma2 with window {window:?} was expected to differ \
             (relative difference only {rel:e}, max abs {max:e}): has gemma2.rs's mask changed?"
        );
    }
}

#[test]
fn bert_encoder_matches_candle_transformers() {
    let name = "bert";
    let cfg: ct::bert::Config = candle_config(&candle_config_json(name));
    assert_eq!(
        cfg.hidden_act,
        ct::bert::HiddenAct::Gelu,
        "erf GELU, as ivme's"
    );
    // The fixture's tensors are named `bert.embeddings...`, `bert.encoder...` (BertForMaskedLM).
    let model = ct::bert::BertModel::load(candle_weights(name).pp("bert"), &cfg).unwrap();
    let ids = input_ids(name);
    let types = reference(name, "token_type_ids")
        .to_dtype(DType::U32)
        .unwrap();
    let theirs = model.forward(&ids, &types, None).unwrap();

    let dir = folder(name);
    let icfg = BertConfig::from_folder(&dir).unwrap();
    let varmap = VarMap::new();
    let ours = Bert::new(
        &icfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    load_weights(&varmap, &dir).unwrap();
    let ours = ours.encode(&ids, Some(&types), None).unwrap();
    assert_eq!(ours.dims(), theirs.dims());
    assert_same("bert hidden states", &ours, &theirs);
}

/// candle-transformers' `BertForMaskedLM` reads its decoder as `cls.predictions.decoder.weight`
/// and `.bias` (bert.rs:577, `linear(.., vb.pp("decoder"))`) and never ties it to the word
/// embeddings, while transformers saves a tied decoder once, under the embedding's name, and
/// its bias as `cls.predictions.bias` (the fixture's names): so it cannot load the fixture.
/// With those two tensors added by hand (the tie transformers makes), its logits are ivme's.
#[test]
fn bert_masked_lm_needs_its_decoder_tied_by_hand_then_matches_candle_transformers() {
    let name = "bert";
    let cfg: ct::bert::Config = candle_config(&candle_config_json(name));
    let err = match ct::bert::BertForMaskedLM::load(candle_weights(name), &cfg) {
        Ok(_) => panic!("candle-transformers' BertForMaskedLM loaded the tied fixture"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("cls.predictions.decoder"), "{err}");

    let dir = folder(name);
    let mut tensors =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let tied = tensors["bert.embeddings.word_embeddings.weight"].clone();
    let bias = tensors["cls.predictions.bias"].clone();
    tensors.insert("cls.predictions.decoder.weight".into(), tied);
    tensors.insert("cls.predictions.decoder.bias".into(), bias);
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let model = ct::bert::BertForMaskedLM::load(vb, &cfg).unwrap();
    let ids = input_ids(name);
    let types = reference(name, "token_type_ids")
        .to_dtype(DType::U32)
        .unwrap();
    let theirs = model.forward(&ids, &types, None).unwrap();

    let icfg = BertConfig::from_folder(&dir).unwrap();
    let varmap = VarMap::new();
    let ours = Bert::new(
        &icfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    load_weights(&varmap, &dir).unwrap();
    let ours = ours.forward(&ids, Some(&types), None).unwrap();
    assert_same("bert masked-LM logits", &ours, &theirs);
}
