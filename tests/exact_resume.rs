//! Exact resumption on real processes: a run stopped after a checkpoint and resumed by a fresh
//! `ivme launch` must end with the same weights, bit for bit, as a run that never stopped.

mod common;

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn tmp(tag: &str) -> PathBuf {
    common::scratch(&format!("resume-{tag}"))
}

fn harness(n: usize, args: &[&str], out: &Path) -> Vec<Value> {
    common::run_reports(n, "harness", args, out)
}

fn params(v: &Value) -> BTreeMap<String, Vec<f32>> {
    common::params(v)
}

/// Trains `total` micro-steps straight through, and again as a run that saves at `save_at`
/// and exits plus a fresh run that resumes; returns (uninterrupted, resumed) rank-0 weights.
fn straight_and_resumed(
    tag: &str,
    common_args: &[&str],
    total: usize,
    save_at: usize,
    brk: &str,
) -> (BTreeMap<String, Vec<f32>>, BTreeMap<String, Vec<f32>>) {
    let steps = format!("steps={total}");
    let a_out = tmp(&format!("{tag}-a"));
    let mut a_args = common_args.to_vec();
    a_args.push(&steps);
    let a = harness(2, &a_args, &a_out);

    let project = tmp(&format!("{tag}-proj"));
    let project_arg = format!("project={}", project.display());
    let save = format!("save_at={save_at}");
    let b_out = tmp(&format!("{tag}-b"));
    let mut b_args = a_args.clone();
    b_args.extend([project_arg.as_str(), save.as_str()]);
    let b = harness(2, &b_args, &b_out);
    assert!(
        b.is_empty(),
        "the saving run must stop before writing its final report"
    );
    assert!(
        project
            .join("checkpoints/checkpoint_0/manifest.json")
            .is_file(),
        "no checkpoint committed"
    );

    let c_out = tmp(&format!("{tag}-c"));
    let brk = format!("break={brk}");
    let mut c_args = a_args.clone();
    c_args.extend([project_arg.as_str(), "resume=1", brk.as_str()]);
    let c = harness(2, &c_args, &c_out);
    assert_eq!(params(&c[0]), params(&c[1]), "resumed ranks disagree");
    for d in [a_out, project, b_out, c_out] {
        let _ = std::fs::remove_dir_all(d);
    }
    (params(&a[0]), params(&c[0]))
}

const BASE: &[&str] = &[
    "opt=adamw",
    "batch=4",
    "n=48",
    "accum=2",
    "lr=0.01",
    "shuffle=1",
    "sched=warmup",
    "dropout=0.2",
];

#[test]
fn a_checkpointed_run_with_dropout_resumes_exactly_and_ends_where_an_unchecked_one_does() {
    let mut args = BASE.to_vec();
    args.push("ckpt=1");
    let (a, c) = straight_and_resumed("ckpt", &args, 24, 10, "none");
    assert_eq!(
        a, c,
        "the resumed checkpointed run differs from the uninterrupted one"
    );
    let out = tmp("ckpt-unchecked");
    let unchecked = harness(2, &[BASE, &["steps=24"]].concat(), &out);
    let _ = std::fs::remove_dir_all(out);
    assert_eq!(
        a,
        params(&unchecked[0]),
        "checkpointing changed the weights"
    );
}

#[test]
fn a_resumed_run_equals_an_uninterrupted_one_bit_for_bit() {
    // 24 micro-steps = 12 optimizer steps; saved after optimizer step 5, mid-epoch
    // (6 batches per rank per epoch, so micro-step 10 is batch 4 of epoch 1).
    let (a, c) = straight_and_resumed("exact", BASE, 24, 10, "none");
    assert_eq!(a, c);
}

#[test]
fn a_run_saved_mid_accumulation_window_resumes_exactly() {
    let (a, c) = straight_and_resumed("midwin", BASE, 24, 11, "none");
    assert_eq!(a, c);
}

#[test]
fn an_fp16_run_resumes_exactly() {
    let mut args = BASE.to_vec();
    args.push("precision=fp16");
    args.push("init_scale=256");
    let (a, c) = straight_and_resumed("fp16", &args, 24, 11, "none");
    assert_eq!(a, c);
}

#[test]
fn dropping_any_one_piece_of_restored_state_breaks_exactness() {
    // The negative control: if these still matched, the tests above could not fail.
    for piece in ["rng", "loader", "scheduler", "optimizer"] {
        let (a, c) = straight_and_resumed(&format!("neg-{piece}"), BASE, 24, 10, piece);
        assert_ne!(a, c, "losing the {piece} state went unnoticed");
    }
}
