//! Metrics across real processes, once-only output and progress bars, through the
//! `metrics_demo` example started by `ivme launch`.
//!
//! Needs `cargo build --workspace --bins --examples` first and Open MPI's `mpirun`.

mod common;

use common::{example_bin, launch, text};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::process::Output;
use std::sync::mpsc;
use std::time::Duration;

/// Runs `metrics_demo` on `n` processes, failing the test (instead of hanging it) if the run
/// does not end within two minutes.
fn run(n: usize, args: &[&str], envs: &[(&str, &str)]) -> Output {
    let program = example_bin("metrics_demo");
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let envs: Vec<(String, String)> = envs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let _ = tx.send(launch(n, &program, &args, &envs));
    });
    rx.recv_timeout(Duration::from_secs(120))
        .expect("the run did not finish within 2 minutes: a collective is probably stuck")
}

/// Runs and requires success; returns each rank's results, `name → json`.
fn results(n: usize, args: &[&str], envs: &[(&str, &str)]) -> Vec<BTreeMap<String, Value>> {
    let out = run(n, args, envs);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let mut ranks = vec![BTreeMap::new(); n];
    for line in stdout.lines().filter(|l| l.starts_with("rank")) {
        let mut parts = line.splitn(3, ' ');
        let rank: usize = parts.next().unwrap()[4..].parse().unwrap();
        let name = parts.next().unwrap().to_string();
        let value: Value = serde_json::from_str(parts.next().unwrap()).unwrap();
        ranks[rank].insert(name, value);
    }
    ranks
}

/// Compares numbers that went through f32 with values computed here in f64.
fn assert_close(got: &Value, expected: &[f64]) {
    let got: Vec<f64> = serde_json::from_value(got.clone()).unwrap();
    assert_eq!(got.len(), expected.len(), "{got:?} vs {expected:?}");
    for (g, e) in got.iter().zip(expected) {
        assert!(
            (g - e).abs() <= 1e-6 * e.abs().max(1.0),
            "{got:?} vs {expected:?}"
        );
    }
}

fn ids(v: &Value) -> Vec<u64> {
    serde_json::from_value(v.clone()).unwrap()
}

#[test]
fn gather_for_metrics_yields_every_sample_once_in_dataset_order() {
    // (samples, batch): 10/4 is the case; 11/4 pads rank 1's last batch; 5/4 is all tail.
    for (n, batch) in [(10usize, 4usize), (11, 4), (5, 4)] {
        let ranks = results(
            2,
            &["gather_for_metrics", &n.to_string(), &batch.to_string()],
            &[],
        );
        let expected: Vec<u64> = (0..n as u64).collect();
        for (r, res) in ranks.iter().enumerate() {
            assert_eq!(ids(&res["kept"]), expected, "n={n} rank {r}");
        }
        // Plain gather keeps the padding, which is what gather_for_metrics must remove.
        let raw = ids(&ranks[0]["raw"]);
        let padded = if n == 10 { 0 } else { 1 };
        assert_eq!(raw.len(), n + padded, "n={n}: {raw:?}");
    }
}

#[test]
fn collectives_match_values_computed_here() {
    for w in [2usize, 3] {
        let ranks = results(w, &["collectives"], &[]);
        // Rank r holds r + 1 rows of [r*100 + 2i, r*100 + 2i + 1].
        let rows =
            |r: usize| -> Vec<f64> { (0..2 * (r + 1)).map(|i| (r * 100 + i) as f64).collect() };
        let gathered: Vec<f64> = (0..w).flat_map(rows).collect();
        // Rank r's vector is [r + 1, 10 - r, r^2].
        let vecs: Vec<[f64; 3]> = (0..w)
            .map(|r| [r as f64 + 1., 10. - r as f64, (r * r) as f64])
            .collect();
        let col = |j: usize| vecs.iter().map(move |v| v[j]);
        let sum: Vec<f64> = (0..3).map(|j| col(j).sum()).collect();
        let mean: Vec<f64> = sum.iter().map(|s| s / w as f64).collect();
        let max: Vec<f64> = (0..3).map(|j| col(j).fold(f64::MIN, f64::max)).collect();
        let min: Vec<f64> = (0..3).map(|j| col(j).fold(f64::MAX, f64::min)).collect();
        let items: Vec<u64> = (0..7).collect();
        let per = 7usize.div_ceil(w);
        let mut start = 0;
        for (r, res) in ranks.iter().enumerate() {
            assert_eq!(res["gather"], json!(gathered), "w={w} rank {r}");
            let scalars: Vec<f64> = (0..w).map(|i| i as f64).collect();
            assert_eq!(res["gather_scalar"], json!(scalars));
            assert_eq!(res["sum"], json!(sum));
            assert_close(&res["mean"], &mean);
            assert_eq!(res["max"], json!(max));
            assert_eq!(res["min"], json!(min));
            // Padded to w rows (the largest rank's) with -1.
            let mut end = rows(r);
            let fill = vec![-1.0; 2 * (w - r - 1)];
            end.extend(&fill);
            let first: Vec<f64> = fill.iter().chain(rows(r).iter()).copied().collect();
            assert_eq!(res["pad_end"], json!([[w, 2], end]), "w={w} rank {r}");
            assert_eq!(res["pad_first"], json!([[w, 2], first]), "w={w} rank {r}");
            assert_eq!(res["broadcast"], json!([[1, 3], [7.0, 8.0, 9.0]]));
            // Contiguous; 7 over 2 is 4 + 3, over 3 is 3 + 2 + 2.
            let size = 7 / w + usize::from(r < 7 % w);
            let share = items[start..start + size].to_vec();
            start += size;
            assert_eq!(ids(&res["split"]), share, "w={w} rank {r}");
            let mut padded = share.clone();
            padded.resize(per, *share.last().unwrap());
            assert_eq!(ids(&res["split_padded"]), padded, "w={w} rank {r}");
            let objects: Vec<Value> = (0..w).map(|i| json!([i, format!("r{i}")])).collect();
            assert_eq!(res["objects"], json!(objects));
            assert_eq!(
                res["broadcast_object"],
                json!(format!("hello from {}", w - 1))
            );
        }
        assert_eq!(start, 7);
    }
}

#[test]
fn mismatched_shapes_fail_on_every_rank_instead_of_hanging() {
    let ranks = results(2, &["mismatch"], &[]);
    for (r, res) in ranks.iter().enumerate() {
        let msg = |k: &str| res[k].as_str().unwrap().to_string();
        let gather = msg("gather");
        assert!(
            gather.contains("[2, 2]") && gather.contains("[2, 3]"),
            "rank {r}: {gather}"
        );
        let reduce = msg("reduce");
        assert!(
            reduce.contains("[3]") && reduce.contains("[4]"),
            "rank {r}: {reduce}"
        );
        let pad = msg("pad");
        assert!(
            pad.contains("[2]") && pad.contains("[2, 2]"),
            "rank {r}: {pad}"
        );
        assert_eq!(res["done"], json!(true), "rank {r} got past the errors");
    }
}

/// The log lines (those naming a rank's greeting or detail) of a run.
fn log_lines(out: &Output) -> Vec<String> {
    let (stdout, stderr) = text(out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    stderr
        .lines()
        .filter(|l| l.contains("from rank"))
        .map(str::to_string)
        .collect()
}

#[test]
fn logs_appear_on_the_main_process_only_by_default() {
    let out = run(
        2,
        &["log", "main"],
        &[("RUST_LOG", ""), ("IVME_LOG_LEVEL", "")],
    );
    let lines = log_lines(&out);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("INFO") && lines[0].contains("hello from rank 0"),
        "{lines:?}"
    );
    assert!(!lines[0].contains("[rank"), "{lines:?}");
    // The second init call is a no-op on every rank.
    let ranks = results(2, &["log", "main"], &[]);
    assert!(ranks.iter().all(|r| r["installed"] == json!([true, false])));
}

#[test]
fn all_ranks_logging_prefixes_each_line_and_honours_the_level() {
    let out = run(
        2,
        &["log", "all"],
        &[("RUST_LOG", ""), ("IVME_LOG_LEVEL", "debug")],
    );
    let mut lines = log_lines(&out);
    lines.sort();
    assert_eq!(lines.len(), 4, "{lines:?}");
    for r in 0..2 {
        let mine: Vec<&String> = lines
            .iter()
            .filter(|l| l.starts_with(&format!("[rank {r}] ")))
            .collect();
        assert_eq!(mine.len(), 2, "{lines:?}");
        assert!(mine
            .iter()
            .any(|l| l.contains(&format!("hello from rank {r}"))));
        assert!(mine
            .iter()
            .any(|l| l.contains(&format!("debug detail from rank {r}"))));
    }
    // RUST_LOG wins over IVME_LOG_LEVEL: warn hides both lines.
    let out = run(
        2,
        &["log", "all"],
        &[("RUST_LOG", "warn"), ("IVME_LOG_LEVEL", "debug")],
    );
    assert!(log_lines(&out).is_empty());
}

#[test]
fn a_bad_log_level_is_an_error_naming_the_valid_values() {
    let out = run(
        2,
        &["log", "main"],
        &[("RUST_LOG", ""), ("IVME_LOG_LEVEL", "loud")],
    );
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "stdout:\n{stdout}");
    assert!(
        stderr.contains("IVME_LOG_LEVEL") && stderr.contains("trace, debug, info"),
        "{stderr}"
    );
}

#[test]
fn main_process_first_and_the_on_process_helpers() {
    let dir = std::env::temp_dir().join(format!("ivme-metrics-first-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let ranks = results(2, &["first", dir.to_str().unwrap()], &[]);
    // Rank 0 writes the file slowly inside its turn; rank 1 only looks after it.
    assert_eq!(ranks[0]["saw_flag"], json!(true));
    assert_eq!(ranks[1]["saw_flag"], json!(true));
    assert_eq!(ranks[0]["on_main"], json!("main"));
    assert_eq!(ranks[1]["on_main"], Value::Null);
    assert_eq!(ranks[0]["on_local_main"], json!("local main"));
    assert_eq!(ranks[1]["on_local_main"], Value::Null);
    assert_eq!(ranks[0]["on_1"], Value::Null);
    assert_eq!(ranks[1]["on_1"], json!("one"));
    assert_eq!(ranks[0]["on_last"], Value::Null);
    assert_eq!(ranks[1]["on_last"], json!("last"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn progress_bars_stay_out_of_piped_output() {
    let out = run(2, &["progress", "9"], &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        !stdout.contains('\x1b') && !stderr.contains('\x1b'),
        "{stdout:?}\n{stderr:?}"
    );
    let ranks = results(2, &["progress", "9"], &[]);
    // 9 samples, batch 2, 2 ranks: 4 per step, so 3 batches each (the last one padded).
    for res in &ranks {
        assert_eq!(res["progress"], json!([3, false]));
    }
}
