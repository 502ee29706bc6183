//! Sharded data parallelism (ZeRO stages 1 and 2) on real processes, against plain candle on one
//! process with each step's whole batch: the numbers, the clipping norm, mixed precision, and
//! what each rank holds.

mod common;
mod reference;

use candle_nn::{ParamsAdamW, SGD};
use serde_json::Value;
use std::collections::BTreeMap;

const STAGES: [&str; 2] = ["optimizer", "gradients"];

fn run(n: usize, args: &[&str], tag: &str) -> Vec<Value> {
    common::reports(n, "harness", args, &format!("zero-{tag}"))
}

fn params(v: &Value) -> BTreeMap<String, Vec<f32>> {
    common::params(v)
}

fn assert_ranks_agree(reports: &[Value], what: &str) {
    for r in &reports[1..] {
        assert_eq!(
            reference::max_diff(&params(&reports[0]), &params(r)),
            0.0,
            "{what}: ranks ended with different weights"
        );
    }
}

#[test]
fn both_stages_with_adamw_and_accumulation_equal_one_plain_process() {
    for stage in STAGES {
        // 2 and 3 ranks: the 49 parameters split 24/25 and 16/16/17, cutting tensors apart.
        for n in [2usize, 3] {
            // n ranks × batch 4 × 2 micro-batches per step, 3 steps.
            let per_step = 4 * n * 2;
            let samples = per_step * 3;
            let reports = run(
                n,
                &[
                    "opt=adamw",
                    "steps=6",
                    "batch=4",
                    &format!("n={samples}"),
                    "accum=2",
                    "lr=0.01",
                    &format!("sharding={stage}"),
                ],
                &format!("adamw-{stage}-{n}"),
            );
            let what = format!("{stage} on {n}");
            assert_ranks_agree(&reports, &what);
            let order: Vec<usize> = (0..samples).collect();
            let expected = reference::train::<candle_nn::AdamW>(
                samples,
                &reference::chunks(&order, per_step, 3),
                ParamsAdamW {
                    lr: 0.01,
                    ..Default::default()
                },
            );
            let diff = reference::max_diff(&params(&reports[0]), &expected);
            assert!(
                diff <= 1e-6,
                "{what}: max abs diff {diff} from plain candle"
            );
        }
    }
}

#[test]
fn both_stages_clip_by_the_global_norm_summed_over_every_slice() {
    // 12 samples per step: 2 ranks × 6 or 3 ranks × 4.
    let order: Vec<usize> = (0..36).collect();
    let (expected, norms) = reference::clipped(36, &reference::chunks(&order, 12, 3), 0.1, 0.05);
    assert!(
        norms.iter().all(|n| *n > 0.05),
        "the reference must clip: {norms:?}"
    );
    for stage in STAGES {
        for n in [2usize, 3] {
            let reports = run(
                n,
                &[
                    "opt=sgd",
                    "steps=3",
                    &format!("batch={}", 12 / n),
                    "n=36",
                    "lr=0.1",
                    "clip_norm=0.05",
                    &format!("sharding={stage}"),
                ],
                &format!("clip-{stage}-{n}"),
            );
            let what = format!("{stage} on {n}");
            assert_ranks_agree(&reports, &what);
            let diff = reference::max_diff(&params(&reports[0]), &expected);
            assert!(diff <= 1e-6, "{what}: max abs diff {diff}");
            for r in &reports {
                let micro = r["micro"].as_array().unwrap();
                for (m, want) in micro.iter().zip(&norms) {
                    let got = m["norm"].as_f64().expect("the norm is reported");
                    assert!(
                        (got - want).abs() <= 1e-5 * want.max(1.0),
                        "{what}: norm {got} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn both_stages_train_in_bf16_and_fp16_with_the_first_update_close_to_f32() {
    let order: Vec<usize> = (0..16).collect();
    let f32_update = reference::update(&reference::train::<SGD>(
        16,
        std::slice::from_ref(&order),
        0.1,
    ));
    for stage in STAGES {
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
                    &format!("sharding={stage}"),
                ],
                &format!("{p}-{stage}"),
            );
            assert_ranks_agree(&reports, &format!("{stage} {p}"));
            assert_eq!(reports[0]["compute_dtype"], dtype);
            let e = reference::rel_err(&reference::update(&params(&reports[0])), &f32_update);
            assert!(e < tol, "{stage} {p}: first update is {e:.4} away from f32");
        }
    }
}

#[test]
fn save_model_writes_the_f32_masters_not_the_rounded_weights() {
    let root = common::Scratch::new("zero-save-model");
    for stage in STAGES {
        let dir = root.0.join(stage);
        let model_out = format!("model_out={}", dir.display());
        let reports = run(
            2,
            &[
                "opt=adamw",
                "steps=2",
                "batch=4",
                "n=16",
                "lr=0.001",
                "precision=bf16",
                &format!("sharding={stage}"),
                &model_out,
            ],
            &format!("save-model-{stage}"),
        );
        let saved = candle_core::safetensors::load(
            dir.join("model.safetensors"),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let weights = params(&reports[0]);
        let mut finer = 0;
        for (name, t) in saved {
            assert_eq!(t.dtype(), candle_core::DType::F32, "`{name}`");
            let master = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let rounded = t.to_dtype(candle_core::DType::BF16).unwrap();
            let rounded = rounded.to_dtype(candle_core::DType::F32).unwrap();
            // The model's bf16 weights are the saved masters rounded.
            assert_eq!(
                rounded.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                weights[&name],
                "{stage}: `{name}`"
            );
            finer += master
                .iter()
                .zip(&weights[&name])
                .filter(|(a, b)| a != b)
                .count();
        }
        assert!(
            finer > 0,
            "{stage}: every saved value is a bf16 one (the rounded weights)"
        );
    }
}

#[test]
fn load_model_gives_the_masters_the_files_f32_values_under_bf16() {
    let root = common::Scratch::new("zero-load-model");
    // f32 values that bf16 cannot hold, in the harness model's variables.
    let (varmap, _) = reference::model();
    let mut tensors = std::collections::HashMap::new();
    for (i, (name, var)) in varmap.data().lock().unwrap().iter().enumerate() {
        let n = var.elem_count();
        let values: Vec<f32> = (0..n)
            .map(|k| 0.1 + (i * 100 + k) as f32 * 1.0e-4)
            .collect();
        let t = candle_core::Tensor::from_vec(values, var.dims(), &candle_core::Device::Cpu);
        tensors.insert(name.clone(), t.unwrap());
    }
    let file = root.0.join("in.safetensors");
    candle_core::safetensors::save(&tensors, &file).unwrap();
    for stage in ["no", "gradients"] {
        let dir = root.0.join(stage);
        let model_in = format!("model_in={}", file.display());
        let model_out = format!("model_out={}", dir.display());
        run(
            2,
            &[
                "steps=0",
                "precision=bf16",
                &format!("sharding={stage}"),
                &model_in,
                &model_out,
            ],
            &format!("load-model-{stage}"),
        );
        let saved = candle_core::safetensors::load(
            dir.join("model.safetensors"),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        for (name, want) in &tensors {
            let got = saved[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(got, want, "{stage}: `{name}` lost the file's f32 values");
        }
    }
}

#[test]
fn each_rank_holds_only_its_slice_of_the_masters_and_optimizer_state() {
    let held = |stage: &str, n: usize| -> Vec<Value> {
        run(
            n,
            &[
                "opt=adamw",
                "steps=2",
                "batch=4",
                "n=24",
                "precision=bf16",
                &format!("sharding={stage}"),
            ],
            &format!("held-{stage}-{n}"),
        )
        .into_iter()
        .map(|r| r["held"].clone())
        .collect()
    };
    let field = |h: &Value, k: &str| h[k].as_u64().unwrap();
    // The model: 49 parameters, bf16 weights (98 bytes), f32 masters and two f32 moments.
    let whole = held("no", 1);
    assert_eq!(field(&whole[0], "masters"), 49 * 4);
    assert_eq!(field(&whole[0], "optimizer"), 2 * 49 * 4);
    for stage in STAGES {
        let ranks = held(stage, 3);
        let elems = [16u64, 16, 17];
        for (h, e) in ranks.iter().zip(elems) {
            assert_eq!(
                field(h, "weights"),
                49 * 2,
                "{stage}: every rank keeps whole weights"
            );
            assert_eq!(
                field(h, "masters"),
                e * 4,
                "{stage}: masters of its slice only"
            );
            assert_eq!(
                field(h, "optimizer"),
                2 * e * 4,
                "{stage}: moments of its slice only"
            );
        }
        if stage == "gradients" {
            // Stage 2 keeps no whole-gradient buffers between steps.
            assert!(
                ranks.iter().all(|h| field(h, "gradients") == 0),
                "{ranks:?}"
            );
        }
    }
}

#[test]
fn the_launchers_environment_sets_the_stage_for_a_program_that_does_not() {
    // `ivme launch --sharding 2` passes IVME_SHARDING=gradients to every rank; so does the
    // variable set by hand. The harness leaves the stage to it.
    let out = common::Scratch::new("zero-env");
    let o = common::launch(
        2,
        &common::example_bin("harness"),
        &[
            "opt=adamw",
            "steps=2",
            "n=16",
            &format!("out={}", out.0.display()),
        ],
        &[("IVME_SHARDING", "gradients")],
    );
    common::ok(&o);
    // AdamW's two f32 moments of the 49 parameters, split across the ranks. (The f32 masters
    // of whole variables are the weights themselves and weigh nothing more.)
    let moments: u64 = (0..2)
        .map(|r| {
            let report: Value = serde_json::from_slice(
                &std::fs::read(out.0.join(format!("rank{r}.json"))).unwrap(),
            )
            .unwrap();
            let m = report["held"]["optimizer"].as_u64().unwrap();
            assert!(
                m < 2 * 49 * 4,
                "rank {r} holds {m} bytes of optimizer state: not sharded"
            );
            m
        })
        .sum();
    assert_eq!(moments, 2 * 49 * 4);
}
