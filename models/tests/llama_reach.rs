//! How much of a Llama the loss reaches. candle-transformers' Llama computes its norms and
//! attention softmax with candle-nn's fused ops, which have no backward pass: `loss.backward()`
//! reaches its output head only, and ivme must say so instead of training the head silently.
//! ivme's own families (`ivme::models`; the llama example trains its Llama) reach every
//! weight, and ivme says nothing.

#[path = "../examples/support/bytes_llama.rs"]
#[allow(dead_code)]
mod bytes_llama;
#[path = "../../tests/common/mod.rs"]
mod common;
#[path = "../examples/support/models.rs"]
#[allow(dead_code)]
mod models;

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use common::{example_bin, launch, text, Scratch};

/// The variables of `family` (examples/support/models.rs) that plain candle's backward leaves
/// without a gradient (sorted), and how many variables there are.
fn unreached_in_plain_candle(family: &str) -> (Vec<String>, usize) {
    let varmap = VarMap::new();
    let mut task = models::build(
        family,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    let (x, y) = models::batches(family, 1, 3).unwrap().remove(0);
    let grads = task.loss(&x, &y).unwrap().backward().unwrap();
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
fn candle_transformers_llama_is_told_which_variables_its_loss_never_reaches() {
    let (missing, total) = unreached_in_plain_candle("llama");
    assert!(
        !missing.is_empty(),
        "candle's fused ops got a backward: update this test"
    );
    let dir = Scratch::new("llama-reach-ct");
    // 6 optimizer steps of 2 micro-batches: more than the 8 backward passes ivme watches.
    let o = launch(
        1,
        &example_bin("model_matrix"),
        &["llama", "hand", dir.0.to_str().unwrap()],
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
    assert!(
        stderr.contains("ivme::nn") && stderr.contains("ivme::models"),
        "names what to use instead: {stderr}"
    );
    assert_eq!(
        stderr.matches("got no gradient").count(),
        1,
        "once: {stderr}"
    );
}

#[test]
fn ivme_families_reach_every_variable() {
    for family in models::IVME_FAMILIES {
        let (missing, total) = unreached_in_plain_candle(family);
        assert!(total >= 15, "{family}: {total} variables");
        assert!(missing.is_empty(), "{family}: unreached {missing:?}");
    }
}

#[test]
fn the_llama_example_trains_every_variable_without_a_warning() {
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
    assert!(
        !stderr.contains("got no gradient"),
        "every variable of the example's model trains: {stderr}"
    );
    assert!(stdout.contains("stopping after 4 steps"), "{stdout}");
}
