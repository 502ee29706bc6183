//! Accumulation, schedulers, clipping and mixed precision on real processes, each compared
//! with plain candle doing the same maths.

mod common;
mod reference;

use candle_core::{Device, Tensor};
use candle_nn::{Optimizer, SGD};
use serde_json::Value;
use std::collections::BTreeMap;

fn run(n: usize, args: &[&str], tag: &str) -> Vec<Value> {
    common::reports(n, "harness", args, &format!("tf-{tag}"))
}

fn params(v: &Value) -> BTreeMap<String, Vec<f32>> {
    common::params(v)
}

fn micro(v: &Value) -> &Vec<Value> {
    v["micro"].as_array().unwrap()
}

#[test]
fn accumulation_on_two_ranks_equals_one_big_batch_and_skips_communication() {
    // 2 ranks × batch 4 × 2 micro-batches = 16 samples per optimizer step; 6 steps.
    let reports = run(
        2,
        &[
            "opt=sgd", "steps=12", "batch=4", "n=96", "accum=2", "lr=0.1",
        ],
        "accum",
    );
    let order: Vec<usize> = (0..96).collect();
    let expected = reference::train::<SGD>(96, &reference::chunks(&order, 16, 6), 0.1);
    for r in &reports {
        let diff = reference::max_diff(&params(r), &expected);
        assert!(diff <= 1e-6, "rank {}: max abs diff {diff}", r["rank"]);
        let mut last = None;
        for (i, m) in micro(r).iter().enumerate() {
            let sync = (i + 1) % 2 == 0;
            assert_eq!(m["sync"], sync, "micro-step {}", i + 1);
            let coll = m["collectives"].as_u64().unwrap();
            if sync {
                assert!(coll > 0, "micro-step {} synced without a collective", i + 1);
            } else {
                assert_eq!(coll, 0, "micro-step {} communicated", i + 1);
            }
            let sum = m["param_sum"].as_f64().unwrap();
            if let Some(prev) = last {
                assert_eq!(
                    sum != prev,
                    sync,
                    "weights changed on the wrong micro-step {}",
                    i + 1
                );
            }
            last = Some(sum);
        }
    }
}

#[test]
fn a_short_last_window_gets_its_true_mean_gradient_on_one_process() {
    // 4 batches, windows of 3: the windows are 3 batches and 1 batch.
    let reports = run(
        1,
        &["opt=sgd", "steps=4", "batch=4", "n=16", "accum=3", "lr=0.1"],
        "short1",
    );
    let order: Vec<usize> = (0..16).collect();
    let expected = reference::train::<SGD>(16, &[order[..12].to_vec(), order[12..].to_vec()], 0.1);
    let diff = reference::max_diff(&params(&reports[0]), &expected);
    assert!(diff <= 1e-6, "max abs diff {diff}");
    let syncs: Vec<bool> = micro(&reports[0])
        .iter()
        .map(|m| m["sync"].as_bool().unwrap())
        .collect();
    assert_eq!(syncs, [false, false, true, true]);
}

#[test]
fn a_short_last_window_gets_its_true_mean_gradient_on_two_processes() {
    let reports = run(
        2,
        &["opt=sgd", "steps=4", "batch=4", "n=32", "accum=3", "lr=0.1"],
        "short2",
    );
    let order: Vec<usize> = (0..32).collect();
    let expected = reference::train::<SGD>(32, &[order[..24].to_vec(), order[24..].to_vec()], 0.1);
    for r in &reports {
        let diff = reference::max_diff(&params(r), &expected);
        assert!(diff <= 1e-6, "max abs diff {diff}");
    }
}

#[test]
fn step_lr_follows_real_optimizer_steps_only() {
    let reports = run(
        2,
        &[
            "opt=sgd",
            "steps=4",
            "batch=4",
            "n=64",
            "accum=2",
            "lr=1.0",
            "sched=step",
        ],
        "sched",
    );
    for r in &reports {
        let lrs: Vec<f64> = micro(r).iter().map(|m| m["lr"].as_f64().unwrap()).collect();
        assert_eq!(lrs, [1.0, 0.5, 0.5, 0.25], "rank {}", r["rank"]);
    }
    let one = run(
        2,
        &[
            "opt=sgd",
            "steps=1",
            "batch=4",
            "n=64",
            "lr=1.0",
            "sched=step",
        ],
        "sched1",
    );
    assert_eq!(micro(&one[0])[0]["lr"].as_f64(), Some(0.5));
}

#[test]
fn clipping_by_norm_uses_the_global_norm_of_the_averaged_gradient() {
    let order: Vec<usize> = (0..48).collect();
    let (expected, norms) = reference::clipped(48, &reference::chunks(&order, 8, 3), 0.1, 0.05);
    assert!(
        norms.iter().all(|n| *n > 0.05),
        "the reference must actually clip: {norms:?}"
    );
    for procs in [1usize, 2] {
        let batch = (8 / procs).to_string();
        let args = [
            "opt=sgd",
            "steps=3",
            &format!("batch={batch}"),
            "n=48",
            "lr=0.1",
            "clip_norm=0.05",
        ];
        let reports = run(procs, &args, &format!("clip{procs}"));
        for r in &reports {
            let diff = reference::max_diff(&params(r), &expected);
            assert!(diff <= 1e-6, "{procs} procs: max abs diff {diff}");
            for (m, n) in micro(r).iter().zip(&norms) {
                let got = m["norm"].as_f64().unwrap();
                assert!(
                    (got - n).abs() <= 1e-5 * n.max(1.0),
                    "{procs} procs: norm {got} vs {n}"
                );
            }
        }
    }
}

#[test]
fn clipping_by_value_clamps_the_synced_gradient() {
    let (varmap, m) = reference::model();
    let (x, y) = reference::data(16);
    let vars = varmap.all_vars();
    let mut grads = reference::loss_on(&m, &x, &y, &(0..8).collect::<Vec<_>>())
        .backward()
        .unwrap();
    for v in &vars {
        let g = grads.remove(v).unwrap();
        grads.insert(v, g.clamp(-0.01, 0.01).unwrap());
    }
    SGD::new(vars, 0.1).unwrap().step(&grads).unwrap();
    let expected = reference::params(&varmap);
    let reports = run(
        2,
        &[
            "opt=sgd",
            "steps=1",
            "batch=4",
            "n=16",
            "lr=0.1",
            "clip_value=0.01",
        ],
        "clipv",
    );
    assert!(reference::max_diff(&params(&reports[0]), &expected) <= 1e-6);
}

#[test]
fn low_precision_first_update_is_close_to_f32_and_computes_in_the_low_dtype() {
    let order: Vec<usize> = (0..16).collect();
    let f32_update = reference::update(&reference::train::<SGD>(
        16,
        std::slice::from_ref(&order),
        0.1,
    ));
    for (p, dtype, tol) in [("fp16", "F16", 0.02), ("bf16", "BF16", 0.05)] {
        let reports = run(
            2,
            &[
                "opt=sgd",
                "steps=1",
                "batch=8",
                "n=16",
                "lr=0.1",
                "init_scale=1024",
                &format!("precision={p}"),
            ],
            p,
        );
        let r = &reports[0];
        assert_eq!(
            r["compute_dtype"], dtype,
            "the model's weights must be {dtype}"
        );
        // The forward's output comes back to f32 at the autocast scope's edge.
        assert_eq!(micro(r)[0]["out_dtype"], "F32");
        let e = reference::rel_err(&reference::update(&params(r)), &f32_update);
        assert!(e < tol, "{p}: first update is {e:.4} away from f32");
    }
}

#[test]
fn low_precision_training_converges() {
    for p in ["fp16", "bf16"] {
        let reports = run(
            1,
            &[
                "opt=adamw",
                "steps=60",
                "batch=16",
                "n=128",
                "lr=0.02",
                &format!("precision={p}"),
            ],
            &format!("conv{p}"),
        );
        let losses: Vec<f64> = micro(&reports[0])
            .iter()
            .map(|m| m["loss"].as_f64().unwrap())
            .collect();
        let head: f64 = losses[..8].iter().sum::<f64>() / 8.0;
        let tail: f64 = losses[losses.len() - 8..].iter().sum::<f64>() / 8.0;
        assert!(tail < head * 0.5, "{p}: loss went from {head} to {tail}");
    }
}

#[test]
fn fp16_loss_scaling_keeps_tiny_gradients_alive() {
    // A loss multiplied by 1e-7 has gradients far below f16's smallest subnormal (6e-8):
    // without scaling they would all flush to zero and nothing would train.
    let order: Vec<usize> = (0..16).collect();
    let (varmap, m) = reference::model();
    let (x, y) = reference::data(16);
    let mut opt = SGD::new(varmap.all_vars(), 1e5).unwrap();
    let loss = (reference::loss_on(&m, &x, &y, &order) * 1e-7).unwrap();
    opt.backward_step(&loss).unwrap();
    let expected = reference::update(&reference::params(&varmap));
    let reports = run(
        1,
        &[
            "opt=sgd",
            "steps=1",
            "batch=16",
            "n=16",
            "lr=1e5",
            "precision=fp16",
            "loss_scale=1e-7",
        ],
        "tiny",
    );
    let got = reference::update(&params(&reports[0]));
    assert!(got.iter().any(|v| *v != 0.0), "nothing trained");
    let e = reference::rel_err(&got, &expected);
    assert!(e < 0.05, "update {e:.4} away from the f32 reference");
}

#[test]
fn an_injected_inf_skips_exactly_one_step_and_lowers_the_scale() {
    let reports = run(
        2,
        &[
            "opt=sgd",
            "steps=4",
            "batch=4",
            "n=32",
            "lr=0.1",
            "precision=fp16",
            "init_scale=1024",
            "inject_inf_at=1",
            "sched=step",
        ],
        "inf",
    );
    for r in &reports {
        let m = micro(r);
        let skipped: Vec<bool> = m.iter().map(|x| x["skipped"].as_bool().unwrap()).collect();
        assert_eq!(skipped, [false, true, false, false], "rank {}", r["rank"]);
        // The scheduler did not step on the skipped step: three real steps → 0.1 · 0.5^3.
        assert_eq!(m[3]["lr"].as_f64(), Some(0.0125));
        assert_eq!(
            m[1]["param_sum"], m[0]["param_sum"],
            "a skipped step changed the weights"
        );
        assert_eq!(r["scale"].as_f64(), Some(512.0));
    }
}

#[test]
fn the_default_fp16_scale_backs_off_until_gradients_fit() {
    // 65536 overflows this model's f16 gradients: steps are skipped, never applied as inf.
    let reports = run(
        1,
        &[
            "opt=sgd",
            "steps=6",
            "batch=8",
            "n=48",
            "lr=0.1",
            "precision=fp16",
        ],
        "backoff",
    );
    let m = micro(&reports[0]);
    let skipped = m.iter().filter(|x| x["skipped"].as_bool().unwrap()).count();
    assert!((1..6).contains(&skipped), "skipped {skipped} of 6");
    assert!(m.iter().all(|x| x["skipped"] == x["overflow"]));
    assert_eq!(
        reports[0]["scale"].as_f64(),
        Some(65536.0 / 2f64.powi(skipped as i32))
    );
    let p = params(&reports[0]);
    assert!(p.values().flatten().all(|v| v.is_finite()));
}

#[test]
fn bf16_matmul_works_on_this_cpu_build() {
    // candle's development branch dropped CPU BF16 matmul without MKL; the pin must keep it.
    let a = Tensor::ones((4, 4), candle_core::DType::BF16, &Device::Cpu).unwrap();
    let s = a
        .matmul(&a)
        .unwrap()
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .sum_all()
        .unwrap();
    assert_eq!(s.to_scalar::<f32>().unwrap(), 64.0);
}
