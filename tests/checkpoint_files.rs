//! Model files and checkpoint folders on real disks: shard layouts for every `max_shard_size`
//! edge case, loading into variables, key checks, corruption of any file,
//! crash leftovers, numbering after a resume and rotation.

mod common;

use common::Scratch;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};
use ivme::checkpoint::project::checkpoint_number;
use ivme::checkpoint::{
    begin, clean_stale, commit, latest_valid, load_checkpoint_in_model, read_rank,
    read_safetensors_metadata, rotate, save_model, verify, Component, ManifestMeta,
    ProjectConfiguration, RankState, ShardSize,
};
use serde_json::json;

fn ramp(n: usize, seed: f32) -> Vec<f32> {
    (0..n)
        .map(|i| (i as f32 * 0.37 + seed).sin() * 3.0)
        .collect()
}

/// Four tensors of different dtypes; data bytes: a=128 (f32 4x8), b=20 (f16 10), c=512
/// (bf16 16x16), d=12 (f32 3).
fn mixed() -> Vec<(String, Tensor)> {
    let dev = Device::Cpu;
    let t = |n: usize, seed: f32, shape: &[usize], dt: DType| {
        Tensor::from_vec(ramp(n, seed), shape, &dev)
            .unwrap()
            .to_dtype(dt)
            .unwrap()
    };
    vec![
        ("d".into(), t(3, 4.0, &[3], DType::F32)),
        ("b.bias".into(), t(10, 2.0, &[10], DType::F16)),
        ("a.weight".into(), t(32, 1.0, &[4, 8], DType::F32)),
        ("c.emb".into(), t(256, 3.0, &[16, 16], DType::BF16)),
    ]
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn zero_vars(tensors: &[(String, Tensor)]) -> Vec<(String, Var)> {
    tensors
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                Var::zeros(t.shape(), t.dtype(), &Device::Cpu).unwrap(),
            )
        })
        .collect()
}

fn files_in(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// Saves, checks the layout against hand-worked shard groups, reloads and compares.
fn round_trip(tag: &str, tensors: &[(String, Tensor)], max: Option<ShardSize>, groups: &[&[&str]]) {
    let tmp = Scratch::new(tag);
    let written = save_model(tensors, &tmp.0, max).unwrap();
    let n = groups.len();
    if n == 1 {
        assert_eq!(
            files_in(&tmp.0),
            BTreeSet::from(["model.safetensors".to_string()]),
            "{tag}"
        );
    } else {
        assert_eq!(written.len(), n + 1, "{tag}: shards plus index");
        let index: serde_json::Value = serde_json::from_slice(
            &std::fs::read(tmp.0.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        let total: u64 = tensors
            .iter()
            .map(|(_, t)| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
            .sum();
        assert_eq!(index["metadata"]["total_size"], json!(total), "{tag}");
        for (k, group) in groups.iter().enumerate() {
            let file = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
            for name in *group {
                assert_eq!(index["weight_map"][*name], json!(file), "{tag}: {name}");
            }
            // Each shard holds exactly its group, as candle's own reader sees it.
            let got = candle_core::safetensors::load(tmp.0.join(&file), &Device::Cpu).unwrap();
            let names: BTreeSet<&str> = got.keys().map(String::as_str).collect();
            assert_eq!(names, group.iter().copied().collect(), "{tag}: {file}");
        }
    }
    for path in &written {
        if path.extension().is_some_and(|e| e == "safetensors") {
            let meta = read_safetensors_metadata(path).unwrap();
            assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
        }
    }
    let vars = zero_vars(tensors);
    let report = load_checkpoint_in_model(&vars, &tmp.0, &Device::Cpu).unwrap();
    assert!(report.unexpected.is_empty());
    assert_eq!(report.loaded.len(), tensors.len());
    for ((name, t), (_, v)) in tensors.iter().zip(&vars) {
        assert_eq!(v.dtype(), t.dtype(), "{tag}: {name}");
        assert_eq!(values(v.as_tensor()), values(t), "{tag}: {name}");
    }
}

#[test]
fn every_max_shard_size_edge_case_round_trips() {
    let t = mixed();
    let all: &[&str] = &["a.weight", "b.bias", "c.emb", "d"];
    round_trip("nolimit", &t, None, &[all]);
    round_trip("bigger", &t, Some(ShardSize::parse("1GB").unwrap()), &[all]);
    // 512 is exactly c's size: c fits a shard alone, the small ones pack before it.
    let exact = Some(ShardSize::from_bytes(512).unwrap());
    round_trip(
        "exact",
        &t,
        exact,
        &[&["a.weight", "b.bias"], &["c.emb"], &["d"]],
    );
    // 150 < c's 512 bytes: c gets its own oversize shard.
    let small = Some(ShardSize::from_bytes(150).unwrap());
    round_trip(
        "smaller",
        &t,
        small,
        &[&["a.weight", "b.bias"], &["c.emb"], &["d"]],
    );
    let tiny = Some(ShardSize::from_bytes(1).unwrap());
    round_trip(
        "tiny",
        &t,
        tiny,
        &[&["a.weight"], &["b.bias"], &["c.emb"], &["d"]],
    );
    // 50 four-byte tensors under a 40-byte limit: ten per shard.
    let many: Vec<(String, Tensor)> = (0..50)
        .map(|i| {
            (
                format!("t{i:02}"),
                Tensor::new(&[i as f32 * 0.5], &Device::Cpu).unwrap(),
            )
        })
        .collect();
    let names: Vec<String> = many.iter().map(|(n, _)| n.clone()).collect();
    let groups: Vec<Vec<&str>> = names
        .chunks(10)
        .map(|c| c.iter().map(String::as_str).collect())
        .collect();
    let groups: Vec<&[&str]> = groups.iter().map(Vec::as_slice).collect();
    round_trip(
        "many",
        &many,
        Some(ShardSize::from_bytes(40).unwrap()),
        &groups,
    );
}

#[test]
fn loading_converts_to_each_variables_dtype() {
    let tmp = Scratch::new("ckpt-dtype");
    let src = mixed();
    save_model(&src, &tmp.0, Some(ShardSize::from_bytes(100).unwrap())).unwrap();
    let targets = [DType::F16, DType::F32, DType::F32, DType::BF16];
    let vars: Vec<(String, Var)> = src
        .iter()
        .zip(targets)
        .map(|((n, t), dt)| (n.clone(), Var::zeros(t.shape(), dt, &Device::Cpu).unwrap()))
        .collect();
    load_checkpoint_in_model(&vars, &tmp.0, &Device::Cpu).unwrap();
    for ((name, t), ((_, v), dt)) in src.iter().zip(vars.iter().zip(targets)) {
        assert_eq!(v.dtype(), dt, "{name}");
        assert_eq!(
            values(v.as_tensor()),
            values(&t.to_dtype(dt).unwrap()),
            "{name}"
        );
    }
}

#[test]
fn missing_misshaped_and_unexpected_keys_are_named() {
    let tmp = Scratch::new("ckpt-keys");
    let src = mixed();
    save_model(&src, &tmp.0, None).unwrap();
    let dev = Device::Cpu;
    let vars = vec![
        (
            "a.weight".to_string(),
            Var::zeros((4, 8), DType::F32, &dev).unwrap(),
        ),
        (
            "b.bias".to_string(),
            Var::zeros(11, DType::F16, &dev).unwrap(),
        ),
        (
            "ghost".to_string(),
            Var::zeros(2, DType::F32, &dev).unwrap(),
        ),
        (
            "phantom".to_string(),
            Var::zeros(2, DType::F32, &dev).unwrap(),
        ),
    ];
    let err = load_checkpoint_in_model(&vars, &tmp.0, &dev)
        .unwrap_err()
        .to_string();
    for needle in ["ghost", "phantom", "b.bias", "[10]", "[11]"] {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
    // Nothing was loaded, not even the variable that matched.
    assert_eq!(values(vars[0].1.as_tensor()), vec![0.0; 32]);

    let file = tmp.0.join("model.safetensors");
    let only_a = vec![vars[0].clone()];
    let report = load_checkpoint_in_model(&only_a, &file, &dev).unwrap();
    assert_eq!(report.loaded, vec!["a.weight".to_string()]);
    assert_eq!(report.unexpected, vec!["b.bias", "c.emb", "d"]);
    assert_eq!(values(only_a[0].1.as_tensor()), values(&src[2].1));
}

#[test]
fn a_new_layout_removes_the_files_of_the_old_one() {
    let tmp = Scratch::new("ckpt-stale");
    let src = mixed();
    save_model(&src, &tmp.0, Some(ShardSize::from_bytes(1).unwrap())).unwrap();
    assert_eq!(files_in(&tmp.0).len(), 5);
    std::fs::write(tmp.0.join("README.md"), "kept").unwrap();
    save_model(&src, &tmp.0, Some(ShardSize::from_bytes(600).unwrap())).unwrap();
    let want: BTreeSet<String> = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    .into_iter()
    .chain(["model.safetensors.index.json", "README.md"])
    .map(String::from)
    .collect();
    assert_eq!(files_in(&tmp.0), want);
    save_model(&src, &tmp.0, None).unwrap();
    assert_eq!(
        files_in(&tmp.0),
        BTreeSet::from(["model.safetensors".into(), "README.md".into()])
    );
}

/// Two ranks' state: tensors of three dtypes, an empty component and JSON, in an order that
/// is not alphabetical (registration order must survive).
fn two_rank_state(n: u64) -> Vec<RankState> {
    let dev = Device::Cpu;
    (0..2)
        .map(|r| {
            let w = Tensor::from_vec(ramp(40, n as f32 + r as f32), (5, 8), &dev).unwrap();
            let m = w.to_dtype(DType::F16).unwrap();
            let step = Tensor::new(&[n as i64], &dev).unwrap();
            RankState {
                components: vec![
                    Component {
                        name: "model_0".into(),
                        tensors: vec![("w".into(), w)],
                        json: json!(null),
                    },
                    Component {
                        name: "optimizer_0".into(),
                        tensors: vec![("m.w".into(), m), ("step".into(), step)],
                        json: json!({"lr": 0.001, "betas": [0.9, 0.999]}),
                    },
                    Component {
                        name: "rng".into(),
                        tensors: vec![],
                        json: json!({"rank": r, "word": n * 17}),
                    },
                    Component {
                        name: "custom_10".into(),
                        tensors: vec![],
                        json: json!("ten"),
                    },
                    Component {
                        name: "custom_2".into(),
                        tensors: vec![],
                        json: json!([2]),
                    },
                ],
            }
        })
        .collect()
}

fn save_all(final_dir: &Path, n: u64) -> ivme::checkpoint::Manifest {
    let tmp = begin(final_dir).unwrap();
    for (r, state) in two_rank_state(n).iter().enumerate() {
        ivme::checkpoint::store::write_rank(&tmp, r, state).unwrap();
    }
    let meta = ManifestMeta {
        world_size: 2,
        step: n,
        extra: json!({"iteration": n + 1}),
    };
    commit(&tmp, final_dir, meta).unwrap()
}

fn assert_state_eq(got: &RankState, want: &RankState) {
    let names = |s: &RankState| {
        s.components
            .iter()
            .map(|c| c.name.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(names(got), names(want));
    for (g, w) in got.components.iter().zip(&want.components) {
        assert_eq!(g.json, w.json, "{}", g.name);
        assert_eq!(g.tensors.len(), w.tensors.len(), "{}", g.name);
        for ((gn, gt), (wn, wt)) in g.tensors.iter().zip(&w.tensors) {
            assert_eq!(gn, wn);
            assert_eq!((gt.dtype(), gt.dims()), (wt.dtype(), wt.dims()), "{gn}");
            assert_eq!(values(gt), values(wt), "{gn}");
        }
    }
}

#[test]
fn rank_state_round_trips_in_saving_order_with_a_full_manifest() {
    let tmp = Scratch::new("ckpt-state");
    let dir = tmp.0.join("ckpt");
    let m = save_all(&dir, 7);
    assert_eq!((m.world_size, m.step, m.format_version), (2, 7, 1));
    assert_eq!(m.extra, json!({"iteration": 8}));
    assert_eq!(m.ivme_version, env!("CARGO_PKG_VERSION"));
    assert_eq!(m.candle_version, "0.11.1");
    assert_eq!(verify(&dir).unwrap(), m);
    assert!(
        !tmp.0.join(".ckpt.tmp").exists(),
        "the temp folder was renamed into place"
    );
    for (r, want) in two_rank_state(7).iter().enumerate() {
        assert_state_eq(&read_rank(&dir, r).unwrap(), want);
    }
    let err = read_rank(&dir, 2).unwrap_err().to_string();
    assert!(
        err.contains("2 processes") && err.contains("rank 2"),
        "{err}"
    );
}

#[test]
fn truncating_or_flipping_any_byte_of_any_file_is_detected() {
    let tmp = Scratch::new("ckpt-corrupt");
    let dir = tmp.0.join("ckpt");
    save_all(&dir, 3);
    let mut files = vec![PathBuf::from("manifest.json")];
    for r in 0..2 {
        for e in std::fs::read_dir(dir.join(format!("rank{r}"))).unwrap() {
            files.push(Path::new(&format!("rank{r}")).join(e.unwrap().file_name()));
        }
    }
    assert_eq!(
        files.len(),
        1 + 2 * 11,
        "manifest + per rank 5 components x 2 files + index"
    );
    for rel in &files {
        let path = dir.join(rel);
        let good = std::fs::read(&path).unwrap();
        let shown = rel.display().to_string();
        let mut damaged = vec![good[..good.len() - 1].to_vec()];
        for at in [0, good.len() / 2, good.len() - 1] {
            let mut flipped = good.clone();
            flipped[at] ^= 0x01;
            damaged.push(flipped);
        }
        for bytes in damaged {
            std::fs::write(&path, &bytes).unwrap();
            let err = verify(&dir).unwrap_err().to_string();
            assert!(err.contains(&shown), "{shown}: {err}");
            let rank = shown
                .strip_prefix("rank")
                .map(|s| s[..1].parse::<usize>().unwrap());
            let read_err = read_rank(&dir, rank.unwrap_or(0)).unwrap_err().to_string();
            assert!(read_err.contains(&shown), "{shown}: {read_err}");
            let latest = latest_valid(&tmp.0).unwrap();
            assert!(latest.is_none(), "a damaged checkpoint is never chosen");
        }
        std::fs::write(&path, &good).unwrap();
        verify(&dir).unwrap();
    }
    std::fs::write(dir.join("rank1/extra.json"), "{}").unwrap();
    let err = verify(&dir).unwrap_err().to_string();
    assert!(
        err.contains("extra.json") && err.contains("not listed"),
        "{err}"
    );
    assert!(read_rank(&dir, 1).is_err());
    std::fs::remove_file(dir.join("rank1/extra.json")).unwrap();
    std::fs::remove_file(dir.join("rank0/rng.json")).unwrap();
    let err = verify(&dir).unwrap_err().to_string();
    assert!(err.contains("rng.json") && err.contains("missing"), "{err}");
}

#[test]
fn commit_keeps_verified_checkpoints_and_replaces_broken_ones() {
    let tmp = Scratch::new("ckpt-commit");
    let dir = tmp.0.join("ckpt");
    save_all(&dir, 1);
    let again = begin(&dir).unwrap();
    ivme::checkpoint::store::write_rank(&again, 0, &two_rank_state(2)[0]).unwrap();
    let meta = || ManifestMeta {
        world_size: 2,
        step: 2,
        extra: json!(null),
    };
    let err = commit(&again, &dir, meta()).unwrap_err().to_string();
    assert!(err.contains("rank 1 has not written"), "{err}");
    ivme::checkpoint::store::write_rank(&again, 1, &two_rank_state(2)[1]).unwrap();
    let err = commit(&again, &dir, meta()).unwrap_err().to_string();
    assert!(err.contains("already holds a verified checkpoint"), "{err}");
    assert_eq!(
        verify(&dir).unwrap().step,
        1,
        "the old checkpoint is untouched"
    );
    // A folder with that name that is not a checkpoint (no manifest) is replaced.
    std::fs::remove_file(dir.join("manifest.json")).unwrap();
    save_all(&dir, 2);
    assert_eq!(verify(&dir).unwrap().step, 2);
}

#[test]
fn crash_leftovers_are_cleaned_and_finished_saves_recovered() {
    let tmp = Scratch::new("ckpt-stale-tmp");
    // A save whose process died mid-way: its claim file is there but nobody locks it.
    let half = tmp.0.join(".checkpoint_4.save-deadhost-1-0-0.tmp");
    std::fs::write(tmp.0.join(".checkpoint_4.save-deadhost-1-0-0.claim"), "{}").unwrap();
    std::fs::create_dir_all(&half).unwrap();
    ivme::checkpoint::store::write_rank(&half, 0, &two_rank_state(4)[0]).unwrap();
    std::fs::create_dir_all(tmp.0.join(".checkpoint_1.del/rank0")).unwrap();
    // A save still in progress in this process: claimed, so never touched.
    let live = begin(&tmp.0.join("checkpoint_6")).unwrap();
    // A save that crashed after its manifest but before the rename (an older ivme's name).
    let done = tmp.0.join("checkpoint_5");
    save_all(&done, 5);
    std::fs::rename(&done, tmp.0.join(".checkpoint_5.tmp")).unwrap();
    let cleaned = clean_stale(&tmp.0).unwrap();
    assert_eq!(cleaned.recovered, vec![done.clone()]);
    assert_eq!(cleaned.removed.len(), 2, "{cleaned:?}");
    assert!(live.is_dir(), "a live save is left alone");
    ivme::checkpoint::abandon(&live).unwrap();
    assert_eq!(
        files_in(&tmp.0),
        BTreeSet::from(["checkpoint_5".to_string()])
    );
    assert_eq!(latest_valid(&tmp.0).unwrap().unwrap().1.step, 5);
}

#[test]
fn numbering_continues_after_a_resume_and_rotation_keeps_the_newest() {
    let tmp = Scratch::new("ckpt-project");
    let cfg = ProjectConfiguration::new(&tmp.0)
        .automatic_checkpoint_naming(true)
        .total_limit(2);
    assert_eq!(
        cfg.next_checkpoint_dir().unwrap(),
        tmp.0.join("checkpoints/checkpoint_0")
    );
    for _ in 0..3 {
        let next = cfg.next_checkpoint_dir().unwrap();
        save_all(&next, checkpoint_number(&next).unwrap());
    }
    // A "resumed" run with a fresh configuration continues the numbering.
    let resumed = ProjectConfiguration::new(&tmp.0).total_limit(2);
    let next = resumed.next_checkpoint_dir().unwrap();
    assert_eq!(next, tmp.0.join("checkpoints/checkpoint_3"));
    save_all(&next, 3);
    let removed = rotate(&resumed.checkpoints_dir(), 2).unwrap();
    assert_eq!(removed.len(), 2);
    let left = files_in(&resumed.checkpoints_dir());
    assert_eq!(
        left,
        BTreeSet::from(["checkpoint_2".to_string(), "checkpoint_3".to_string()])
    );
    assert_eq!(
        resumed
            .clone()
            .iteration(9)
            .next_checkpoint_number()
            .unwrap(),
        9
    );

    // The newest one damaged: the previous one is chosen (with a warning on stderr).
    let (path, m) = latest_valid(&resumed.checkpoints_dir()).unwrap().unwrap();
    assert_eq!((checkpoint_number(&path), m.step), (Some(3), 3));
    std::fs::write(next.join("rank1/model_0.safetensors"), b"garbage").unwrap();
    let (path, m) = latest_valid(&resumed.checkpoints_dir()).unwrap().unwrap();
    assert_eq!((checkpoint_number(&path), m.step), (Some(2), 2));
    assert_eq!(
        resumed.next_checkpoint_number().unwrap(),
        4,
        "never reuses a damaged number"
    );
    assert!(rotate(&resumed.checkpoints_dir(), 0).is_err());
}
