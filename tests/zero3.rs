//! ZeRO stage 3 (`Sharding::Parameters`) on real processes: a Llama whose blocks' weights each
//! rank holds as a slice, gathered per checkpointed segment, trains to plain candle's weights
//! on 2, 3 and 4 ranks (f32, accumulation and clipping), as the unsharded run does in bf16 (bit
//! for bit on 2, 3 and 4 ranks) and with LoRA on a frozen base; each rank holds a slice of the
//! blocks' weights and none of them whole after a step; a model whose forward names no unit, or names one it does not
//! have, or runs a unit's segment on another thread, is refused with the fix.

mod common;
mod reference;

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

type Weights = BTreeMap<String, Vec<f32>>;

/// The zero3 subject on `n` ranks with `args`; every rank's report.
fn ranks(n: usize, args: &[&str], tag: &str) -> Vec<Value> {
    let reports = common::reports(n, "zero3", args, &format!("zero3-{tag}"));
    for r in &reports[1..] {
        let same = common::params(r) == common::params(&reports[0]);
        assert!(same, "{args:?}: ranks ended with different weights");
    }
    reports
}

/// The subject's plain-candle run on one process with `args` (its weights), and whether it
/// clipped.
fn candle(args: &[&str], dir: &Path) -> (Weights, bool) {
    let mut cmd = std::process::Command::new(common::example_bin("zero3"));
    cmd.arg("mode=candle")
        .args(args)
        .arg(format!("out={}", dir.display()));
    let stdout = common::ok(&cmd.output().expect("running the zero3 subject"));
    let report: Value =
        serde_json::from_slice(&std::fs::read(dir.join("rank0.json")).unwrap()).unwrap();
    (common::params(&report), stdout.contains("clipped: true"))
}

#[test]
fn a_llama_under_zero3_trains_to_plain_candles_weights_on_two_three_and_four_ranks() {
    let scratch = common::Scratch::new("zero3-candle");
    for tied in ["tied=0", "tied=1"] {
        let args = ["opt=sgd", "accum=2", "steps=3", "clip=0.1", tied];
        let (expected, clipped) = candle(&args, &scratch.0.join(tied));
        assert!(clipped, "the reference clips");
        let worlds: &[usize] = if tied == "tied=0" { &[2, 3, 4] } else { &[3] };
        for &n in worlds {
            let mut all = args.to_vec();
            all.push("sharding=parameters");
            let reports = ranks(n, &all, &format!("{n}-{tied}"));
            let diff = reference::max_diff(&common::params(&reports[0]), &expected);
            assert!(diff <= 1e-6, "{n} ranks, {tied}: {diff} from plain candle");
        }
    }
}

#[test]
fn bf16_under_zero3_trains_bit_for_bit_as_without_sharding() {
    for n in [2, 3, 4] {
        let run = |stage: &str| {
            let sharding = format!("sharding={stage}");
            let args = ["precision=bf16", "accum=2", "steps=3", &sharding];
            common::params(&ranks(n, &args, &format!("bf16-{n}-{stage}"))[0])
        };
        let (zero3, plain) = (run("parameters"), run("no"));
        let diff = reference::max_diff(&zero3, &plain);
        assert!(
            zero3 == plain,
            "{n} ranks: bf16 under ZeRO-3 differs by up to {diff}"
        );
    }
}

#[test]
fn each_rank_holds_its_slice_of_the_blocks_and_none_of_their_weights_after_a_step() {
    let args = ["opt=sgd", "accum=2", "steps=2"];
    let mut zero3 = args.to_vec();
    zero3.push("sharding=parameters");
    let mut zero2 = args.to_vec();
    zero2.push("sharding=gradients");
    let (a, b) = (ranks(4, &zero3, "held-3"), ranks(4, &zero2, "held-2"));
    let diff = reference::max_diff(&common::params(&a[0]), &common::params(&b[0]));
    assert!(diff <= 1e-6, "{diff} from stage 2");
    let held = |r: &Value, k: &str| r["held"][k].as_u64().unwrap();
    // The blocks' weights (3 blocks of 8 variables) are freed; the embedding, the final
    // norm and the head (64 × 32 + 32 + 32 × 64 floats) stay whole.
    let outer = (64 * 32 + 32 + 32 * 64) * 4;
    for r in &a {
        assert_eq!(held(r, "weights"), outer, "{}", r["held"]);
    }
    // Stage 2 holds every weight on every rank (its f32 masters are those weights); stage 3's
    // masters are a quarter of them on each rank.
    let all: u64 = common::params(&b[0])
        .values()
        .map(|v| v.len() as u64 * 4)
        .sum();
    assert_eq!(held(&b[0], "weights"), all);
    let masters: u64 = a.iter().map(|r| held(r, "masters")).sum();
    assert_eq!(masters, all, "the slices cover the model once");
    for r in &a {
        assert!(held(r, "masters") <= all / 4 + 4, "{}", r["held"]);
    }
}

#[test]
fn lora_on_a_frozen_base_under_zero3_trains_as_without_sharding() {
    let scratch = common::Scratch::new("zero3-lora");
    let base = scratch.0.join("base");
    let save = format!("save_base={}", base.display());
    candle(&["steps=0", &save], &scratch.0.join("init"));
    let lora = format!("lora={}", base.display());
    let run = |stage: &str| {
        let sharding = format!("sharding={stage}");
        let args = ["accum=2", "steps=3", &lora, &sharding];
        common::params(&ranks(3, &args, &format!("lora-{stage}"))[0])
    };
    let (zero3, plain) = (run("parameters"), run("no"));
    assert!(
        zero3.keys().all(|k| k.contains("lora")),
        "only the adapters train: {:?}",
        zero3.keys()
    );
    let diff = reference::max_diff(&zero3, &plain);
    assert!(diff <= 1e-6, "{diff} from the unsharded run");
}

#[test]
fn a_forward_that_gathers_no_unit_is_refused_with_the_fix() {
    use candle_core::{DType, Device, Module, Tensor};
    use candle_nn::Optimizer;
    let mut acc = ivme::Accelerator::builder()
        .cpu(true)
        .sharding(ivme::Sharding::Parameters)
        .build()
        .unwrap();
    assert!(acc.activation_checkpointing(), "stage 3 checkpoints");
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let layer = candle_nn::linear(4, 4, vb.pp("layer")).unwrap();
    let before = common::flat_weights(&varmap);
    let p = ivme::optim::ParamsSgd {
        lr: 0.1,
        ..Default::default()
    };
    let sgd = ivme::optim::Sgd::new(varmap.all_vars(), p);
    let mut opt = acc.prepare_optimizer(&varmap, sgd).unwrap();
    let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu).unwrap();
    // A segment without a unit: its weights stay whole, and nothing is sharded.
    let l = layer.clone();
    let y = ivme::activations::checkpoint(&x, move |x| l.forward(x)).unwrap();
    let err = acc.backward(&y.sum_all().unwrap()).unwrap_err().to_string();
    assert!(
        err.contains("ran none") && err.contains("ivme::activations::segment"),
        "{err}"
    );
    // A unit the model does not have.
    let l = layer.clone();
    let err = ivme::activations::segment(&x, "layers.0", move |x| l.forward(x))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no prepared model has variables named `layers.0.…`"),
        "{err}"
    );
    // Named right, it trains: every weight and bias has gradient 2 (two rows of ones).
    let l = layer.clone();
    let y = ivme::activations::segment(&x, "layer", move |x| l.forward(x)).unwrap();
    let grads = acc.backward(&y.sum_all().unwrap()).unwrap();
    opt.step(&grads).unwrap();
    let after: Vec<f32> = acc
        .whole_masters()
        .unwrap()
        .into_iter()
        .flat_map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect();
    for (a, b) in after.iter().zip(&before) {
        assert!((a - (b - 0.2)).abs() < 1e-6, "{a} after {b}");
    }
    // Its weights are freed now: on another thread than the one that built the Accelerator
    // (which gathers them) the segment is refused.
    let (l, x2) = (layer.clone(), x.clone());
    let err = std::thread::spawn(move || {
        ivme::activations::segment(&x2, "layer", move |x| l.forward(x))
            .map(|_| ())
            .unwrap_err()
            .to_string()
    })
    .join()
    .unwrap();
    assert!(err.contains("runs on a thread that did not build"), "{err}");
}
