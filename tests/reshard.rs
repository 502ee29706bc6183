//! Checkpoints that resume on another number of processes and another sharding stage, on real
//! processes: the state after the load equals the saved one element for element, and training
//! continues over the samples of the epoch not yet used, as plain candle on one process with
//! the same global batches does.

mod common;
mod reference;

use candle_core::Device;
use ivme::data::sampler::epoch_order;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const N: usize = 24;

/// Runs the harness on `n` processes and returns rank 0's report.
fn harness(n: usize, args: &[&str], out: &Path) -> Value {
    let r = common::run_reports(n, "harness", args, out);
    assert_eq!(r.len(), n, "{args:?}: not every rank reported");
    for other in &r[1..] {
        assert_eq!(
            reference::max_diff(&common::params(&r[0]), &common::params(other)),
            0.0,
            "{args:?}: ranks ended with different weights"
        );
    }
    r[0].clone()
}

/// The arguments every run shares: AdamW on the MLP, a shuffled dataset of `N` samples.
fn base(n_batch: usize, sharding: &str, project: &Path) -> Vec<String> {
    vec![
        "opt=adamw".into(),
        "lr=0.01".into(),
        format!("n={N}"),
        "shuffle=1".into(),
        format!("batch={n_batch}"),
        format!("sharding={sharding}"),
        format!("project={}", project.display()),
    ]
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// The harness's shuffled order of epoch `e` (seed 11), cut into global batches of `sizes`.
fn batches(e: u64, from: usize, sizes: &[usize]) -> Vec<Vec<usize>> {
    let order = epoch_order(N, true, 11, e);
    let mut at = from;
    sizes
        .iter()
        .map(|s| {
            let b = order[at..(at + s).min(N)].to_vec();
            at += s;
            b
        })
        .collect()
}

/// Saves on 2 processes × batch 3 after 2 steps (12 of the epoch's 24 samples used), into a
/// fresh project folder; returns the folder.
fn save_on_two(sharding: &str, root: &Path, extra: &[&str]) -> PathBuf {
    let project = root.join(format!("saved-{sharding}"));
    let mut args = base(3, sharding, &project);
    args.extend(["save_at=2".to_string(), "steps=99".to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let o = common::launch(2, &common::example_bin("harness"), &strs(&args), &[]);
    common::ok(&o);
    project
}

#[test]
fn training_resumed_on_one_or_three_processes_continues_over_the_unused_samples() {
    let root = common::Scratch::new("reshard-train");
    // Plain candle, one process: the global batches of 6 that 2 × 3 saw first, then the rest.
    let first = batches(0, 0, &[6, 6]);
    let same = |tail: &[Vec<usize>]| -> BTreeMap<String, Vec<f32>> {
        let all: Vec<Vec<usize>> = first.iter().chain(tail).cloned().collect();
        let params = candle_nn::ParamsAdamW {
            lr: 0.01,
            ..Default::default()
        };
        reference::train::<candle_nn::AdamW>(N, &all, params)
    };
    // Global batch 6 again (1 × 6, 3 × 2): the rest of epoch 0, then two of epoch 1.
    let sixes: Vec<Vec<usize>> = batches(0, 12, &[6, 6])
        .into_iter()
        .chain(batches(1, 0, &[6, 6]))
        .collect();
    let expect_sixes = same(&sixes);
    // Global batch 9 (3 × 3): 9 of the 12 left, the last 3 split one each, then epoch 1.
    let nines: Vec<Vec<usize>> = batches(0, 12, &[9, 3])
        .into_iter()
        .chain(batches(1, 0, &[9]))
        .collect();
    let expect_nines = same(&nines);
    // (processes, batch per process, stage) of each resume.
    type Resume = (usize, usize, &'static str);
    let cases: [(&str, &[Resume]); 3] = [
        ("no", &[(1, 6, "no"), (3, 2, "gradients"), (3, 3, "no")]),
        ("optimizer", &[(1, 6, "optimizer"), (3, 2, "no")]),
        (
            "gradients",
            &[(3, 2, "gradients"), (1, 6, "no"), (3, 3, "optimizer")],
        ),
    ];
    for (saved_as, resumes) in cases {
        // The stage-2 save is asynchronous: each rank's slice is written in the background.
        let extra: &[&str] = if saved_as == "gradients" {
            &["async=1"]
        } else {
            &[]
        };
        let saved = save_on_two(saved_as, &root.0, extra);
        for &(n, b, stage) in resumes {
            let what = format!("saved on 2 × 3 ({saved_as}), resumed on {n} × {b} ({stage})");
            let project = root.0.join(format!("r-{saved_as}-{n}-{b}-{stage}"));
            common::copy_tree(&saved, &project);
            let steps = if b == 3 { 5 } else { 6 };
            let mut args = base(b, stage, &project);
            args.extend(["resume=1".to_string(), format!("steps={steps}")]);
            let out = root.0.join(format!("out-{saved_as}-{n}-{b}-{stage}"));
            let report = harness(n, &strs(&args), &out);
            let expected = if b == 3 { &expect_nines } else { &expect_sixes };
            let diff = reference::max_diff(&common::params(&report), expected);
            assert!(
                diff <= 1e-6,
                "{what}: max abs diff {diff} from plain candle"
            );
        }
    }
}

/// Every model and optimizer tensor of a checkpoint, whatever its layout, as whole flat values:
/// `name` and `name::state`, put together here from `name[from..to]` runs of every rank folder.
fn logical_state(dir: &Path) -> BTreeMap<String, Vec<f32>> {
    let mut runs: BTreeMap<String, Vec<(usize, Vec<f32>)>> = BTreeMap::new();
    for rank in std::fs::read_dir(dir).unwrap() {
        let rank = rank.unwrap().path();
        if !rank.is_dir() {
            continue;
        }
        for file in ["model_0.safetensors", "optimizer_0.safetensors"] {
            let path = rank.join(file);
            if !path.exists() {
                continue;
            }
            for (saved, t) in candle_core::safetensors::load(&path, &Device::Cpu).unwrap() {
                let values = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let (var, state) = match saved.split_once("::") {
                    Some((v, s)) => (v.to_string(), format!("::{s}")),
                    None => (saved.clone(), String::new()),
                };
                let (name, from) = match var.strip_suffix(']').and_then(|v| v.rsplit_once('[')) {
                    Some((name, range)) => {
                        let (from, to) = range.split_once("..").unwrap();
                        let (from, to): (usize, usize) =
                            (from.parse().unwrap(), to.parse().unwrap());
                        // A run is saved flat, whether or not it is a whole variable.
                        assert_eq!(t.dims(), [to - from], "{}: `{saved}`", path.display());
                        (name.to_string(), from)
                    }
                    None => (var.clone(), 0),
                };
                runs.entry(format!("{name}{state}"))
                    .or_default()
                    .push((from, values));
            }
        }
    }
    runs.into_iter()
        .map(|(k, mut parts)| {
            parts.sort_by_key(|p| p.0);
            let mut whole = Vec::new();
            for (from, v) in parts {
                assert_eq!(from, whole.len(), "{k}: runs leave a gap or overlap");
                whole.extend(v);
            }
            (k, whole)
        })
        .collect()
}

fn only_checkpoint(project: &Path) -> PathBuf {
    let dirs: Vec<PathBuf> = std::fs::read_dir(project.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("manifest.json").exists())
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs[0].clone()
}

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn the_state_loaded_on_another_layout_is_the_saved_state_exactly() {
    let root = common::Scratch::new("reshard-exact");
    for saved_as in ["no", "gradients"] {
        let project = save_on_two(saved_as, &root.0, &[]);
        let saved = only_checkpoint(&project);
        let want = logical_state(&saved);
        // 49 weights, each with AdamW's two moments.
        assert_eq!(want.len(), 4 * 3, "{saved_as}: {:?}", want.keys());
        let manifest = ivme::checkpoint::verify(&saved).unwrap();
        let layout = &manifest.extra["layout"];
        assert_eq!(layout["world_size"], 2);
        if saved_as == "gradients" {
            // Each rank wrote its own slice: 24 and 25 of the 49 weights, nothing gathered.
            assert_eq!(layout["counts"], serde_json::json!([[24, 25]]));
            let rank1 = candle_core::safetensors::load(
                saved.join("rank1/model_0.safetensors"),
                &Device::Cpu,
            )
            .unwrap();
            let held: usize = rank1.values().map(|t| t.elem_count()).sum();
            assert_eq!(held, 25);
        }
        for (n, stage) in [(1usize, "no"), (3, "optimizer"), (3, "gradients")] {
            let what = format!("saved on 2 ({saved_as}), loaded on {n} ({stage})");
            let project = root.0.join(format!("x-{saved_as}-{n}-{stage}"));
            common::copy_tree(&project_of(&saved), &project);
            let again = root.0.join(format!("again-{saved_as}-{n}-{stage}"));
            let mut args = base(6 / n, stage, &project);
            args.extend([
                "resume=1".to_string(),
                "steps=2".to_string(),
                format!("resave={}", again.display()),
            ]);
            let out = root.0.join(format!("out-x-{saved_as}-{n}-{stage}"));
            let report = harness(n, &strs(&args), &out);
            assert_eq!(
                logical_state(&again),
                want,
                "{what}: the loaded state differs"
            );
            // The weights in the model are the saved masters.
            for (name, values) in common::params(&report) {
                assert_eq!(values, want[&name], "{what}: `{name}` in the model");
            }
            // Every new rank continues after the 12 samples all the old ranks had used.
            for r in 0..n {
                let pos = json(&again.join(format!("rank{r}/loader_0.json")));
                assert_eq!(
                    (pos["skip"].as_u64(), pos["consumed"].as_u64()),
                    (Some(12), Some(0)),
                    "{what}: rank {r}"
                );
            }
            let opt = json(&again.join("rank0/optimizer_0.json"));
            assert_eq!(opt["step"], 2, "{what}");
        }
    }
}

/// The project folder holding checkpoint `dir` (`PROJECT/checkpoints/checkpoint_K`).
fn project_of(dir: &Path) -> PathBuf {
    dir.parent().unwrap().parent().unwrap().to_path_buf()
}

/// Saves on 2 × 3 with accumulation 2 after 3 micro-steps (the second window half summed).
fn save_mid_window(sharding: &str, project: &Path) {
    let mut args = base(3, sharding, project);
    args.extend(["accum=2", "save_at=3", "steps=99"].map(String::from));
    common::ok(&common::launch(
        2,
        &common::example_bin("harness"),
        &strs(&args),
        &[],
    ));
}

#[test]
fn a_window_saved_mid_way_resumes_only_on_the_processes_that_saved_it() {
    let root = common::Scratch::new("reshard-window");
    // accum=2, saved after 3 micro-steps: the second window is half summed.
    let project = root.0.join("p");
    save_mid_window("no", &project);
    let mut resume = base(6, "no", &project);
    resume.extend(["accum=2", "resume=1", "steps=4"].map(String::from));
    let o = common::launch(1, &common::example_bin("harness"), &strs(&resume), &[]);
    let e = common::refused(&o);
    assert!(
        e.contains("accumulation window saved mid-way") && e.contains("--num_processes 2"),
        "{e}"
    );
    // On the 2 processes that saved it, it resumes.
    let mut same = base(3, "no", &project);
    same.extend(["accum=2", "resume=1", "steps=4"].map(String::from));
    harness(2, &strs(&same), &root.0.join("out"));
}

fn merge(args: &[&str]) -> String {
    let o = std::process::Command::new(common::ivme_bin())
        .arg("merge-weights")
        .args(args)
        .output()
        .unwrap();
    common::ok(&o)
}

#[test]
fn merge_weights_turns_any_layout_into_a_model_folder_that_candle_and_python_read() {
    let root = common::Scratch::new("reshard-merge");
    let params = candle_nn::ParamsAdamW {
        lr: 0.01,
        ..Default::default()
    };
    // Plain candle after the two global batches the saving run trained on.
    let expected = reference::train::<candle_nn::AdamW>(N, &batches(0, 0, &[6, 6]), params);
    let (want_model, _) = reference::model();
    let shapes: BTreeMap<String, Vec<usize>> = want_model
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.dims().to_vec()))
        .collect();
    for saved_as in ["no", "gradients", "parameters"] {
        let project = save_on_two(saved_as, &root.0, &[]);
        let ckpt = only_checkpoint(&project);
        let out = root.0.join(format!("hf-{saved_as}"));
        let printed = merge(&[ckpt.to_str().unwrap(), out.to_str().unwrap()]);
        assert!(
            printed.contains("wrote 4 tensors (49 parameters)"),
            "{printed}"
        );
        // A project folder stands for its newest complete checkpoint.
        let from_project = root.0.join(format!("hf-{saved_as}-project"));
        let printed = merge(&[project.to_str().unwrap(), from_project.to_str().unwrap()]);
        assert!(
            printed.contains(&format!("newest complete checkpoint: {}", ckpt.display())),
            "{printed}"
        );
        assert_eq!(
            std::fs::read(from_project.join("model.safetensors")).unwrap(),
            std::fs::read(out.join("model.safetensors")).unwrap()
        );
        let got =
            candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
        assert_eq!(got.len(), 4, "{saved_as}");
        for (name, t) in &got {
            assert_eq!(t.dims(), shapes[name].as_slice(), "{saved_as}: `{name}`");
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let diff = v
                .iter()
                .zip(&expected[name])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                diff <= 1e-6,
                "{saved_as}: `{name}` is {diff} from plain candle"
            );
        }
        // Shards with an index, in bf16: candle's mmaped VarBuilder and Python read them.
        let sharded = root.0.join(format!("hf-{saved_as}-sharded"));
        merge(&[
            ckpt.to_str().unwrap(),
            sharded.to_str().unwrap(),
            "--max-shard-size",
            "50B",
            "--dtype=bf16",
        ]);
        let index = json(&sharded.join("model.safetensors.index.json"));
        let mut files: Vec<PathBuf> = index["weight_map"]
            .as_object()
            .unwrap()
            .values()
            .map(|f| sharded.join(f.as_str().unwrap()))
            .collect();
        files.sort();
        files.dedup();
        assert!(files.len() > 1, "{saved_as}: one shard only");
        let vb = unsafe {
            candle_nn::VarBuilder::from_mmaped_safetensors(
                &files,
                candle_core::DType::BF16,
                &Device::Cpu,
            )
        }
        .unwrap();
        for (name, dims) in &shapes {
            let t = vb.get(dims.as_slice(), name).unwrap();
            let v = t
                .to_dtype(candle_core::DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            for (a, b) in v.iter().zip(&expected[name]) {
                assert!(
                    (a - b).abs() <= 1e-2 * b.abs().max(1e-2),
                    "{saved_as}: bf16 `{name}`: {a} vs {b}"
                );
            }
        }
        let py = std::process::Command::new("python3")
            .arg("-c")
            .arg(
                "import json, sys, os\nfrom safetensors import safe_open\nd = sys.argv[1]\n\
                 m = json.load(open(os.path.join(d, 'model.safetensors.index.json')))['weight_map']\n\
                 out = {}\nfor name, f in sorted(m.items()):\n    with safe_open(os.path.join(d, f), 'numpy') as h:\n        \
                 out[name] = [list(h.get_slice(name).get_shape()), str(h.get_slice(name).get_dtype())]\nprint(json.dumps(out))",
            )
            .arg(&sharded)
            .output()
            .expect("python3 (scripts/setup.sh)");
        assert!(
            py.status.success(),
            "{}",
            String::from_utf8_lossy(&py.stderr)
        );
        let seen: BTreeMap<String, (Vec<usize>, String)> =
            serde_json::from_slice(&py.stdout).unwrap();
        for (name, dims) in &shapes {
            assert_eq!(
                seen[name],
                (dims.clone(), "BF16".to_string()),
                "{saved_as}: python reads `{name}`"
            );
        }
    }
    // Bad input is a clear error, not a panic.
    let o = std::process::Command::new(common::ivme_bin())
        .args(["merge-weights", root.0.to_str().unwrap(), "x"])
        .output()
        .unwrap();
    let e = common::refused(&o);
    assert!(e.contains("has no manifest.json"), "{e}");
}

#[test]
fn an_fp16_run_moves_with_its_loss_scale() {
    let root = common::Scratch::new("reshard-fp16");
    let project = save_on_two("gradients", &root.0, &["precision=fp16", "init_scale=1024"]);
    let saved = only_checkpoint(&project);
    let scaler = json(&saved.join("rank0/training.json"))["scaler"].clone();
    assert!(scaler["scale"].as_f64().is_some(), "{scaler}");
    let moved = root.0.join("moved");
    common::copy_tree(&project, &moved);
    let again = root.0.join("again");
    let mut args = base(2, "optimizer", &moved);
    args.extend(
        ["precision=fp16", "resume=1", "steps=2"]
            .map(String::from)
            .into_iter()
            .chain([format!("resave={}", again.display())]),
    );
    harness(3, &strs(&args), &root.0.join("out"));
    assert_eq!(logical_state(&again), logical_state(&saved));
    for r in 0..3 {
        let got = json(&again.join(format!("rank{r}/training.json")))["scaler"].clone();
        assert_eq!(got, scaler, "rank {r}'s loss scaler");
    }
}

#[test]
fn a_zero3_run_on_four_processes_resumes_on_one_three_or_four_at_any_stage() {
    let root = common::Scratch::new("reshard-zero3");
    // Global batches of 12: 4 × 3 saved after the first, then the rest of two epochs.
    let all: Vec<Vec<usize>> = batches(0, 0, &[12, 12])
        .into_iter()
        .chain(batches(1, 0, &[12, 12]))
        .collect();
    let params = candle_nn::ParamsAdamW {
        lr: 0.01,
        ..Default::default()
    };
    let expected = reference::train::<candle_nn::AdamW>(N, &all, params);
    let saved = root.0.join("saved");
    let mut args = base(3, "parameters", &saved);
    args.extend(["save_at=1".to_string(), "steps=99".to_string()]);
    common::ok(&common::launch(
        4,
        &common::example_bin("harness"),
        &strs(&args),
        &[],
    ));
    // The uninterrupted run, to compare the resume on the same layout with bit for bit.
    let whole = root.0.join("whole");
    let mut args = base(3, "parameters", &whole);
    args.push("steps=4".to_string());
    let uninterrupted = harness(4, &strs(&args), &root.0.join("out-whole"));
    let diff = reference::max_diff(&common::params(&uninterrupted), &expected);
    assert!(diff <= 1e-6, "uninterrupted: {diff} from plain candle");
    for (n, b, stage) in [(1, 12, "no"), (3, 4, "gradients"), (4, 3, "parameters")] {
        let what = format!("saved on 4 × 3 (parameters), resumed on {n} × {b} ({stage})");
        let project = root.0.join(format!("r-{n}-{stage}"));
        common::copy_tree(&saved, &project);
        let mut args = base(b, stage, &project);
        args.extend(["resume=1".to_string(), "steps=4".to_string()]);
        let report = harness(n, &strs(&args), &root.0.join(format!("out-{n}-{stage}")));
        let got = common::params(&report);
        let diff = reference::max_diff(&got, &expected);
        assert!(diff <= 1e-6, "{what}: {diff} from plain candle");
        if n == 4 {
            assert!(
                got == common::params(&uninterrupted),
                "{what}: not the uninterrupted run bit for bit"
            );
        }
    }
}

#[test]
fn a_zero3_window_saved_mid_way_resumes_bit_for_bit_with_its_slices_sums() {
    let root = common::Scratch::new("reshard-zero3-window");
    // accum=2, saved after 3 micro-steps: the units' reduce-scattered sums are half a window.
    let project = root.0.join("p");
    save_mid_window("parameters", &project);
    let mut resume = base(3, "parameters", &project);
    resume.extend(["accum=2", "resume=1", "steps=6"].map(String::from));
    let resumed = harness(2, &strs(&resume), &root.0.join("out"));
    let mut whole = base(3, "parameters", &root.0.join("whole"));
    whole.extend(["accum=2", "steps=6"].map(String::from));
    let whole = harness(2, &strs(&whole), &root.0.join("out-whole"));
    let diff = reference::max_diff(&common::params(&resumed), &common::params(&whole));
    assert!(
        common::params(&resumed) == common::params(&whole),
        "the resumed window differs from the uninterrupted one by up to {diff}"
    );
}
