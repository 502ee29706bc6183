//! Trackers: JSONL and CSV files parsed back, TensorBoard event files read by the
//! `tensorboard` Python package, and only rank 0 writing in a two-process run.
//!
//! The TensorBoard test needs `python3` with `tensorboard` (scripts/setup.sh installs it); the
//! two-process test needs `cargo build --workspace --bins --examples` and Open MPI's `mpirun`.

mod common;

use ivme::tracking::{CsvTracker, JsonlTracker, TensorBoardTracker, Tracker, Trackers};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A scratch folder unique to this test process and `tag`.
fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ivme-tracking-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn values(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Opens `tracker` for project `p`, logs each `(step, values)` and finishes.
fn run_tracker(tracker: Box<dyn Tracker>, config: &Value, logs: &[(u64, BTreeMap<String, f64>)]) {
    let mut set = Trackers::open("p", config, vec![tracker], true).unwrap();
    for (step, vals) in logs {
        set.log(vals, *step).unwrap();
    }
    set.finish().unwrap();
}

#[test]
fn jsonl_writes_one_object_per_call_and_appends_on_resume() {
    let dir = scratch("jsonl");
    let config = json!({"lr": 0.25, "name": "demo"});
    let before = now();
    let logs = [
        (0, values(&[("loss", 2.0), ("acc", 0.5)])),
        (5, values(&[("loss", 1.25)])),
    ];
    run_tracker(Box::new(JsonlTracker::new(&dir)), &config, &logs);
    // A second run of the same project continues the file.
    run_tracker(
        Box::new(JsonlTracker::new(&dir)),
        &config,
        &[(6, values(&[("loss", 1.0)]))],
    );
    let after = now();
    let text = std::fs::read_to_string(dir.join("p/metrics.jsonl")).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "{text}");
    let expected = [
        (0, json!({"loss": 2.0, "acc": 0.5})),
        (5, json!({"loss": 1.25})),
        (6, json!({"loss": 1.0})),
    ];
    for (line, (step, vals)) in lines.iter().zip(expected) {
        assert_eq!(line["step"], json!(step));
        assert_eq!(line["values"], vals);
        let t = line["wall_time"].as_f64().unwrap();
        assert!(
            before - 1.0 <= t && t <= after + 1.0,
            "{t} not in [{before}, {after}]"
        );
    }
    let saved: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("p/config.json")).unwrap()).unwrap();
    assert_eq!(saved, config);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The CSV file as rows of cells (no quoting needed for these names).
fn csv_rows(path: &Path) -> Vec<Vec<String>> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect()
}

#[test]
fn csv_widens_its_header_for_new_names_and_leaves_missing_cells_empty() {
    let dir = scratch("csv");
    let logs = [
        (1, values(&[("loss", 0.5), ("acc", 0.25)])),
        (2, values(&[("loss", 0.125), ("lr", 0.001)])),
        (3, values(&[("acc", 1.0)])),
    ];
    run_tracker(Box::new(CsvTracker::new(&dir)), &Value::Null, &logs);
    let rows = csv_rows(&dir.join("p/metrics.csv"));
    assert_eq!(rows[0], ["step", "wall_time", "acc", "loss", "lr"]);
    let without_time = |r: &Vec<String>| -> Vec<String> {
        assert!(r[1].parse::<f64>().unwrap() > 1.0e9, "wall time {}", r[1]);
        [&r[..1], &r[2..]].concat()
    };
    let body: Vec<Vec<String>> = rows[1..].iter().map(without_time).collect();
    assert_eq!(
        body,
        [
            ["1", "0.25", "0.5", ""],
            ["2", "", "0.125", "0.001"],
            ["3", "1", "", ""],
        ]
    );
    // A resumed run continues the same table with the same columns.
    run_tracker(
        Box::new(CsvTracker::new(&dir)),
        &Value::Null,
        &[(4, values(&[("lr", 0.5)]))],
    );
    let rows = csv_rows(&dir.join("p/metrics.csv"));
    assert_eq!(rows.len(), 5);
    assert_eq!(rows[0].len(), 5);
    assert_eq!(without_time(&rows[4]), ["4", "", "", "0.5"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn csv_refuses_to_continue_a_file_it_did_not_write() {
    let dir = scratch("csv-foreign");
    std::fs::create_dir_all(dir.join("p")).unwrap();
    std::fs::write(dir.join("p/metrics.csv"), "a,b\n1,2\n").unwrap();
    let err = Trackers::open(
        "p",
        &Value::Null,
        vec![Box::new(CsvTracker::new(&dir))],
        true,
    )
    .unwrap_err();
    assert!(err.to_string().contains("step,wall_time"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Reads every scalar in `dir` with TensorBoard's own reader, also re-checking each record's
/// framing and masked CRC-32C with TensorBoard's implementation: `{tag: [[step, value]...]}`.
fn tensorboard_scalars(dir: &Path) -> Value {
    const SCRIPT: &str = r#"
import glob, json, os, struct, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
d = sys.argv[1]
files = glob.glob(os.path.join(d, "*tfevents*"))
assert len(files) == 1, files
raw = open(files[0], "rb").read()
pos = records = 0
while pos < len(raw):
    header = raw[pos:pos + 8]
    (n,) = struct.unpack("<Q", header)
    assert struct.unpack("<I", raw[pos + 8:pos + 12])[0] == masked_crc32c(header)
    data = raw[pos + 12:pos + 12 + n]
    assert struct.unpack("<I", raw[pos + 12 + n:pos + 16 + n])[0] == masked_crc32c(data)
    pos += 16 + n
    records += 1
ea = EventAccumulator(d)
ea.Reload()
out = {t: [[e.step, e.value] for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}
out["_records"] = records
print(json.dumps(out))
"#;
    let out = Command::new("python3")
        .args(["-c", SCRIPT])
        .arg(dir)
        .output()
        .expect("python3 runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "reading the event file with tensorboard failed (run scripts/setup.sh to install \
         it):\n{stderr}"
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn tensorboard_reads_back_the_scalars_with_their_steps() {
    let dir = scratch("tensorboard");
    let logs = [
        (0, values(&[("loss", 1.5), ("acc", 0.25)])),
        (10, values(&[("loss", 0.75), ("acc", 0.5)])),
        (20, values(&[("loss", -3.0)])),
        (1 << 40, values(&[("acc", 1.0e-3)])),
    ];
    run_tracker(Box::new(TensorBoardTracker::new(&dir)), &Value::Null, &logs);
    let got = tensorboard_scalars(&dir.join("p"));
    assert_eq!(
        got["_records"],
        json!(5),
        "a version event and four scalar events"
    );
    assert_eq!(got["loss"], json!([[0, 1.5], [10, 0.75], [20, -3.0]]));
    // 1e-3 is stored as f32, as TensorBoard keeps scalars.
    let acc = got["acc"].as_array().unwrap();
    assert_eq!(acc[..2], [json!([0, 0.25]), json!([10, 0.5])]);
    assert_eq!(acc[2][0], json!(1u64 << 40));
    assert_eq!(acc[2][1].as_f64().unwrap(), 1.0e-3f32 as f64);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_accelerator_checks_the_order_of_tracking_calls() -> ivme::Result<()> {
    let dir = scratch("order");
    let acc = ivme::Accelerator::builder().cpu(true).build()?;
    let err = acc.log([("loss", 1.0)], 0).unwrap_err();
    assert!(err.to_string().contains("init_trackers"), "{err}");
    let jsonl = || -> Vec<Box<dyn Tracker>> { vec![Box::new(JsonlTracker::new(&dir))] };
    let err = acc.init_trackers("a/b", &json!({}), jsonl()).unwrap_err();
    assert!(err.to_string().contains("project"), "{err}");
    acc.init_trackers("run", &json!({"k": 1}), jsonl())?;
    let err = acc.init_trackers("run", &json!({}), jsonl()).unwrap_err();
    assert!(err.to_string().contains("end_training"), "{err}");
    acc.log([("loss", 1.0)], 7)?;
    acc.end_training()?;
    assert!(
        acc.log([("loss", 2.0)], 8).is_err(),
        "log after end_training"
    );
    let text = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    assert_eq!(text.lines().count(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn on_two_ranks_only_rank_zero_writes() {
    let dir = scratch("two-ranks");
    let demo = common::example_bin("metrics_demo");
    let out = common::launch(2, &demo, &["track", dir.to_str().unwrap()], &[]);
    let (stdout, stderr) = common::text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("rank0 tracked true") && stdout.contains("rank1 tracked true"));
    assert!(!dir.join("rank1").exists(), "rank 1 created files");
    let project = dir.join("rank0/demo");
    let jsonl = std::fs::read_to_string(project.join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = jsonl
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, [0, 1, 2, 3]);
    let rows = csv_rows(&project.join("metrics.csv"));
    assert_eq!(rows[0], ["step", "wall_time", "acc", "loss", "extra"]);
    assert_eq!(rows.len(), 5);
    // The demo logs loss 1/(s+1), accuracy s/4 and, from step 2, extra 10 s.
    let got = tensorboard_scalars(&project);
    assert_eq!(
        got["acc"],
        json!([[0, 0.0], [1, 0.25], [2, 0.5], [3, 0.75]])
    );
    assert_eq!(got["extra"], json!([[2, 20.0], [3, 30.0]]));
    let loss: Vec<f64> = got["loss"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[1].as_f64().unwrap())
        .collect();
    let expected: Vec<f64> = (0..4)
        .map(|s| (1.0 / (s as f64 + 1.0)) as f32 as f64)
        .collect();
    assert_eq!(loss, expected);
    std::fs::remove_dir_all(&dir).unwrap();
}
