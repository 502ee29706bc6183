//! Data parallelism on real processes: N ranks × batch B must train exactly like one plain
//! candle process × batch N·B on the same data order.

mod common;
mod reference;

use candle_nn::{ParamsAdamW, SGD};
use serde_json::Value;
use std::collections::BTreeMap;

fn run_harness(n: usize, args: &[&str], tag: &str) -> Vec<Value> {
    common::reports(n, "harness", args, &format!("dp-{tag}"))
}

pub fn params_of(v: &Value) -> BTreeMap<String, Vec<f32>> {
    common::params(v)
}

fn assert_ranks_agree(reports: &[Value]) {
    let first = params_of(&reports[0]);
    for r in &reports[1..] {
        assert_eq!(
            reference::max_diff(&first, &params_of(r)),
            0.0,
            "ranks ended with different weights"
        );
    }
}

#[test]
fn two_ranks_with_sgd_equal_one_process_with_twice_the_batch() {
    let reports = run_harness(
        2,
        &["opt=sgd", "steps=5", "batch=4", "n=64", "lr=0.1"],
        "sgd",
    );
    assert_ranks_agree(&reports);
    let order: Vec<usize> = (0..64).collect();
    let expected = reference::train::<SGD>(64, &reference::chunks(&order, 8, 5), 0.1);
    let diff = reference::max_diff(&params_of(&reports[0]), &expected);
    assert!(diff <= 1e-6, "max abs diff {diff}");
}

#[test]
fn two_ranks_with_adamw_and_shuffling_equal_one_process_with_twice_the_batch() {
    let reports = run_harness(
        2,
        &[
            "opt=adamw",
            "steps=6",
            "batch=4",
            "n=40",
            "lr=0.01",
            "shuffle=1",
        ],
        "adamw",
    );
    assert_ranks_agree(&reports);
    // 40 samples / 8 per step = 5 steps in epoch 0, then the first step of epoch 1.
    let mut batches = reference::chunks(&ivme::data::sampler::epoch_order(40, true, 11, 0), 8, 5);
    batches.extend(reference::chunks(
        &ivme::data::sampler::epoch_order(40, true, 11, 1),
        8,
        1,
    ));
    let cfg = ParamsAdamW {
        lr: 0.01,
        weight_decay: 0.01,
        ..Default::default()
    };
    let expected = reference::train::<candle_nn::AdamW>(40, &batches, cfg);
    let diff = reference::max_diff(&params_of(&reports[0]), &expected);
    assert!(diff <= 1e-6, "max abs diff {diff}");
}

#[test]
fn one_process_through_the_accelerator_equals_plain_candle_exactly() {
    let reports = run_harness(
        1,
        &["opt=adamw", "steps=4", "batch=8", "n=32", "lr=0.01"],
        "one",
    );
    let order: Vec<usize> = (0..32).collect();
    let cfg = ParamsAdamW {
        lr: 0.01,
        weight_decay: 0.01,
        ..Default::default()
    };
    let expected = reference::train::<candle_nn::AdamW>(32, &reference::chunks(&order, 8, 4), cfg);
    assert_eq!(reference::max_diff(&params_of(&reports[0]), &expected), 0.0);
}

#[test]
fn three_ranks_start_from_rank_zero_weights_and_stay_in_step() {
    let reports = run_harness(
        3,
        &["opt=sgd", "steps=2", "batch=2", "n=12", "lr=0.1"],
        "three",
    );
    assert_ranks_agree(&reports);
    let order: Vec<usize> = (0..12).collect();
    let expected = reference::train::<SGD>(12, &reference::chunks(&order, 6, 2), 0.1);
    assert!(reference::max_diff(&params_of(&reports[0]), &expected) <= 1e-6);
}
