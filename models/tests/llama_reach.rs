//! candle-transformers' Llama computes its norms and attention softmax with candle-nn's fused
//! ops, which have no backward pass: `loss.backward()` reaches the output head only. The llama
//! example trains through ivme, which must say so instead of training silently the head alone.

#[path = "../examples/support/bytes_llama.rs"]
mod bytes_llama;
#[path = "../../tests/common/mod.rs"]
mod common;

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::llama;
use common::{example_bin, launch, text, Scratch};

/// What plain candle's backward reaches of the example's model: the variables it leaves
/// without a gradient (sorted) and how many variables there are.
fn unreached_in_plain_candle() -> (Vec<String>, usize) {
    let varmap = VarMap::new();
    let cfg = bytes_llama::config();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = llama::Llama::load(vb, &cfg).unwrap();
    let mut cache = llama::Cache::new(false, DType::F32, &cfg, &Device::Cpu).unwrap();
    let (train, _) = bytes_llama::batches(&bytes_llama::text()).unwrap();
    let (x, y) = &train[0];
    let loss = bytes_llama::loss_of(&model.forward(x, 0, &mut cache).unwrap(), y).unwrap();
    let grads = loss.backward().unwrap();
    let data = varmap.data().lock().unwrap();
    let mut missing: Vec<String> = data
        .iter()
        .filter(|(_, v)| grads.get(v.as_tensor()).is_none())
        .map(|(k, _)| k.clone())
        .collect();
    missing.sort();
    (missing, data.len())
}

#[test]
fn the_llama_example_is_told_which_variables_its_loss_never_reaches() {
    let (missing, total) = unreached_in_plain_candle();
    assert!(
        !missing.is_empty(),
        "candle's fused ops got a backward: update this test"
    );
    let dir = Scratch::new("llama-reach");
    let project = format!("project={}", dir.0.join("run").display());
    // 4 optimizer steps of 2 micro-batches: the 8 backward passes ivme watches.
    let o = launch(
        2,
        &example_bin("llama_tiny"),
        &[&project, "epochs=1", "stop_after=4", "precision=no"],
        &[],
    );
    let (stdout, stderr) = text(&o);
    assert!(o.status.success(), "{stdout}\n{stderr}");
    let said = format!("{} of {total} trained variables", missing.len());
    assert!(stderr.contains(&said), "expected `{said}`:\n{stderr}");
    assert!(
        stderr.contains(&format!("first 8 backward passes: {}", missing[0])),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("got no gradient").count(),
        1,
        "once, by rank 0: {stderr}"
    );
}
