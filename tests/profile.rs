//! `ivme launch --profile DIR` with real processes: every rank writes its spans and a Chrome
//! trace, the launcher's summary names the rank the others wait for, and `ivme profile DIR`
//! merges the traces and draws the ranks' phases and a logged curve.
//!
//! Needs `cargo build --workspace --bins --examples` first and Open MPI's `mpirun`.

mod common;

use common::job::{restartable, Job};
use common::{ivme_bin, Scratch};
use serde_json::Value;
use std::path::Path;

fn json(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Milliseconds each `sync` span of a rank's record took, in order.
fn syncs_ms(record: &Value) -> Vec<f64> {
    record["spans"]
        .as_array()
        .expect("a record has spans")
        .iter()
        .filter(|s| s[0] == "sync")
        .map(|s| s[2].as_f64().unwrap() / 1e6)
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
fn every_rank_is_profiled_and_the_slow_one_is_named() {
    let dir = Scratch::new("profile");
    let profile = dir.0.join("profile");
    // Rank 1's forward takes 40 ms longer every micro-batch: rank 0 waits for it at the sync.
    let job: Job = restartable(
        &["--profile", profile.to_str().unwrap()],
        &dir.0.join("project"),
        &dir.0.join("out"),
        &["step_ms=40", "slow_rank=1", "save_every=1000"],
        &[],
    );
    let end = job.wait();
    assert!(end.status.success(), "{}", end.show());

    // 48 samples in batches of 4 over 2 ranks, 3 epochs: 18 optimizer steps on each rank.
    let mut syncs = Vec::new();
    for rank in 0..2 {
        let record = json(&profile.join(format!("rank-{rank}.json")));
        assert_eq!(record["rank"], rank);
        assert_eq!(record["world_size"], 2);
        let spans = record["spans"].as_array().unwrap();
        for kind in ["data", "backward", "sync", "collective", "optimizer"] {
            assert!(
                spans.iter().any(|s| s[0] == kind),
                "rank {rank} recorded no `{kind}` span"
            );
        }
        let ms = syncs_ms(&record);
        assert_eq!(ms.len(), 18, "rank {rank}: one sync per optimizer step");
        syncs.push(median(ms));
        let trace = json(&profile.join(format!("rank-{rank}.trace.json")));
        let events = trace["traceEvents"].as_array().unwrap();
        let steps = events
            .iter()
            .filter(|e| e["tid"] == 0 && e["ph"] == "X")
            .count();
        assert_eq!(steps, 18, "rank {rank}'s trace has one row per step");
    }
    assert!(
        syncs[0] > 25.0 && syncs[1] < 15.0,
        "rank 0 should wait ~40 ms per sync for rank 1: medians {syncs:?} ms"
    );
    // The program did not call end_training: the launcher summarised the records.
    assert!(
        end.stdout
            .contains("profile: 2 rank(s), 18 optimizer steps"),
        "{}",
        end.show()
    );
    assert!(
        end.stdout
            .contains("straggler: rank 1 (the others wait for it"),
        "{}",
        end.show()
    );
    assert!(end
        .stdout
        .contains(&format!("ivme profile {}", profile.display())));

    // A logged curve, as `accelerator.log` keeps it in a profile.
    let losses = [0.9, 0.7, 0.55, 0.5, 0.48];
    let lines: Vec<String> = losses
        .iter()
        .enumerate()
        .map(|(i, l)| format!("{{\"step\":{i},\"values\":{{\"loss\":{l}}}}}"))
        .collect();
    std::fs::write(profile.join("metrics.jsonl"), lines.join("\n")).unwrap();
    let out = std::process::Command::new(ivme_bin())
        .args(["profile", profile.to_str().unwrap(), "--steps", "3"])
        .output()
        .expect("running ivme profile");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("straggler: rank 1"), "{stdout}");
    let merged = json(&profile.join("trace.json"));
    let pids: std::collections::BTreeSet<u64> = merged["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["pid"].as_u64())
        .collect();
    assert_eq!(pids, [0, 1].into_iter().collect());
    let svg = std::fs::read_to_string(profile.join("profile.svg")).unwrap();
    assert!(svg.contains("rank 0") && svg.contains("rank 1"), "no lanes");
    assert!(svg.matches("<rect").count() > 20, "no phases drawn");
    assert!(svg.contains("loss by step"), "no curve");
    // The axes are black polylines; the curve is the blue one.
    let curve = svg
        .split("<polyline")
        .find(|p| p.contains("stroke=\"#0000FF\""))
        .and_then(|p| p.split("points=\"").nth(1))
        .and_then(|p| p.split('"').next())
        .expect("the curve is a blue polyline");
    assert_eq!(curve.split_whitespace().count(), losses.len(), "{curve}");
}

#[test]
fn a_folder_without_a_profile_is_refused_by_name() {
    let dir = Scratch::new("profile-empty");
    let out = std::process::Command::new(ivme_bin())
        .args(["profile", dir.0.to_str().unwrap()])
        .output()
        .expect("running ivme profile");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("holds no profile (no rank-R.json)") && stderr.contains("--profile"),
        "{stderr}"
    );
}
