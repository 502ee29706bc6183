//! A saver process (`examples/subjects/ckpt_crash.rs`) is SIGKILLed at many moments of a save: before,
//! while the ranks write, inside the commit, during rotation and at plain time offsets. After
//! every kill the newest valid checkpoint must be complete and hold exactly its own number's
//! content, every committed folder must verify, cleanup must remove the leftovers, and the
//! next save must succeed.
//!
//! Needs `cargo build --workspace --bins --examples` first (cargo test builds the examples).

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use candle_core::Tensor;
use ivme::checkpoint::project::checkpoint_number;
use ivme::checkpoint::{clean_stale, latest_valid, read_rank, verify};

/// The content checkpoint `n` must hold on `rank` (the formula in the example's docs).
fn check_content(dir: &Path, n: u64) {
    for rank in 0..2usize {
        let s = read_rank(dir, rank).unwrap();
        let base = (n * 1000) as f32;
        let vec = |t: &Tensor| t.to_vec1::<f32>().unwrap();
        let w = vec(&s.get("model_0").unwrap().tensors[0].1);
        assert_eq!(w.len(), 600_000);
        assert!(
            w.iter()
                .enumerate()
                .all(|(i, &x)| x == base + (rank * 100) as f32 + (i % 97) as f32),
            "w of {n}"
        );
        let opt = s.get("optimizer_0").unwrap();
        let m = vec(&opt.tensors[0].1);
        assert_eq!(m.len(), 200_000);
        assert!(
            m.iter()
                .enumerate()
                .all(|(i, &x)| x == -(base + rank as f32) - (i % 13) as f32),
            "m of {n}"
        );
        assert_eq!(opt.json, serde_json::json!({"n": n, "rank": rank}));
    }
}

/// Checks the folder after a kill and returns the newest valid checkpoint number.
fn check_after_kill(ckpts: &Path, what: &str) -> Option<u64> {
    let latest = latest_valid(ckpts).unwrap().map(|(dir, m)| {
        let n = checkpoint_number(&dir).unwrap();
        assert_eq!(m.step, n, "{what}: manifest of {}", dir.display());
        check_content(&dir, n);
        n
    });
    // No folder under a checkpoint name is ever half-written.
    for e in std::fs::read_dir(ckpts).into_iter().flatten() {
        let p = e.unwrap().path();
        if checkpoint_number(&p).is_some() {
            verify(&p).unwrap_or_else(|err| {
                panic!("{what}: {} is visible but invalid: {err}", p.display())
            });
        }
    }
    clean_stale(ckpts).unwrap();
    let leftovers: Vec<PathBuf> = std::fs::read_dir(ckpts)
        .into_iter()
        .flatten()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with('.'))
        .collect();
    assert!(
        leftovers.is_empty(),
        "{what}: clean_stale left {leftovers:?}"
    );
    latest
}

/// Starts the saver and kills it `delay` after the `nth` line equal to `marker` (with the
/// checkpoint number ignored), or after `delay` alone when `marker` is empty.
fn kill_during(exe: &Path, project: &Path, marker: &str, nth: usize, delay: Duration) {
    let mut child = Command::new(exe)
        .arg(project)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    if !marker.is_empty() {
        let mut seen = 0;
        for line in BufReader::new(stdout).lines() {
            let line = line.unwrap();
            if line.split(' ').next() == Some(marker) {
                seen += 1;
                if seen == nth {
                    break;
                }
            }
        }
    }
    std::thread::sleep(delay);
    child.kill().unwrap(); // SIGKILL on Unix
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "the saver should have been killed, not finished ({marker} {nth})"
    );
}

/// How long each phase of one save takes, measured from when its marker lines arrive:
/// `(marker that starts the phase, seconds until the next marker)`.
fn phase_times(exe: &Path, project: &Path) -> Vec<(String, f64)> {
    let mut child = Command::new(exe)
        .arg(project)
        .arg("--once")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut seen: Vec<(String, std::time::Instant)> = Vec::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let word = line
            .unwrap()
            .split(' ')
            .next()
            .unwrap_or_default()
            .to_string();
        seen.push((word, std::time::Instant::now()));
    }
    assert!(child.wait().unwrap().success());
    seen.windows(2)
        .map(|w| (w[0].0.clone(), (w[1].1 - w[0].1).as_secs_f64()))
        .collect()
}

#[test]
fn sigkill_at_any_moment_leaves_a_complete_checkpoint_and_the_next_save_works() {
    let exe = common::example_bin("ckpt_crash");
    let project = std::env::temp_dir().join(format!("ivme-crash-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&project);
    let ckpts = project.join("checkpoints");
    // Calibrate on a real save, then kill at fractions of each phase so kills land early,
    // midway and late inside every step, including inside the commit itself.
    let phases = phase_times(&exe, &project);
    let mut plan: Vec<(String, usize, Duration)> = vec![("start".into(), 1, Duration::ZERO)];
    for (marker, secs) in &phases {
        let fractions: &[f64] = match marker.as_str() {
            "commit" => &[
                0.0, 0.08, 0.16, 0.24, 0.32, 0.4, 0.48, 0.56, 0.64, 0.72, 0.8, 0.88, 0.96,
            ],
            "rotated" => &[],
            _ => &[0.1, 0.5, 0.9],
        };
        for (k, f) in fractions.iter().enumerate() {
            plan.push((
                marker.clone(),
                if marker == "start" { 1 } else { 1 + k % 2 },
                Duration::from_secs_f64(secs * f),
            ));
        }
    }
    for ms in [70, 230, 610] {
        plan.push((String::new(), 0, Duration::from_millis(ms)));
    }
    assert!(plan.len() >= 20, "{phases:?}");
    let mut newest: Option<u64> = None;
    for (marker, nth, delay) in &plan {
        let what = format!("kill {delay:?} after {marker} #{nth}");
        kill_during(&exe, &project, marker, *nth, *delay);
        let latest = check_after_kill(&ckpts, &what);
        assert!(
            latest >= newest,
            "{what}: the newest checkpoint went back from {newest:?} to {latest:?}"
        );
        let out = Command::new(&exe)
            .arg(&project)
            .arg("--once")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{what}: the next save failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let after = check_after_kill(&ckpts, &format!("save after {what}"));
        assert!(
            after > latest,
            "{what}: the next save did not become the newest"
        );
        newest = after;
    }
    let _ = std::fs::remove_dir_all(&project);
}

/// Runs `ckpt_faults` with `args` and extra environment; returns (success, stdout, stderr).
fn faults(args: &[&str], env: &[(&str, String)]) -> (bool, String, String) {
    let mut child = Command::new(common::example_bin("ckpt_faults"))
        .args(args)
        .env_remove("IVME_CRASH_TRACE")
        .env_remove("IVME_CRASH_AT")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("ckpt_faults {args:?} hung");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The words after `word` on the first stdout line starting with it.
fn line_with<'a>(out: &'a str, word: &str) -> Option<Vec<&'a str>> {
    out.lines()
        .find(|l| l.starts_with(word))
        .map(|l| l.split(' ').skip(1).collect())
}

#[test]
fn a_crash_at_every_step_of_a_save_is_recovered_by_the_next_run() {
    let root = common::Scratch::new("crash-every-step");
    let base = root.0.join("base");
    let b = base.to_str().unwrap();
    // Two committed checkpoints (A = checkpoint_1 is the newest), rotation keeping two.
    let (ok, out, err) = faults(&["save", b, "1", "2"], &[]);
    assert!(ok, "{err}");
    let fp_a = out
        .lines()
        .last()
        .unwrap()
        .split(' ')
        .nth(2)
        .unwrap()
        .to_string();
    // One uninterrupted resume + save, traced: the numbered steps every crash run goes through.
    let traced = root.0.join("traced");
    common::copy_tree(&base, &traced);
    let (ok, out, err) = faults(
        &["resume", traced.to_str().unwrap(), "1"],
        &[("IVME_CRASH_TRACE", "1".into())],
    );
    assert!(ok, "{err}");
    let steps: Vec<String> = err
        .lines()
        .filter_map(|l| l.strip_prefix("ivme: crash point "))
        .map(|l| l.split_once(": ").unwrap().1.to_string())
        .collect();
    // From this step on the new manifest is complete (in the page cache, which a SIGKILL
    // does not lose), so the save must be recovered; before it, the previous one must win.
    let manifest_written = 1 + steps
        .iter()
        .position(|s| s.starts_with("written ") && s.ends_with("/manifest.json"))
        .expect("the trace shows the manifest being written");
    assert!(steps.len() > 40, "{steps:?}");
    let fp_b = line_with(&out, "saving").unwrap()[0].to_string();
    for k in 1..=steps.len() + 1 {
        let work = root.0.join(format!("k{k}"));
        common::copy_tree(&base, &work);
        let w = work.to_str().unwrap();
        let (ok, out, err) = faults(&["resume", w, "1"], &[("IVME_CRASH_AT", k.to_string())]);
        let what = format!(
            "crash at step {k} ({})",
            steps.get(k - 1).map_or("none", |s| s.as_str())
        );
        assert_eq!(ok, k > steps.len(), "{what}: {err}");
        assert_eq!(
            line_with(&out, "saving").unwrap()[0],
            fp_b,
            "{what}: the run is deterministic"
        );
        // The next run: load_state(None) must load the newest complete save, then save.
        let (ok, out, err) = faults(&["load", w], &[]);
        assert!(ok, "{what}: the next run failed: {err}\n{out}");
        let loaded = line_with(&out, "loaded").unwrap();
        let (want_dir, want_fp) = if k >= manifest_written {
            ("checkpoint_2", &fp_b)
        } else {
            ("checkpoint_1", &fp_a)
        };
        assert!(
            loaded[0].ends_with(want_dir),
            "{what}: loaded {}",
            loaded[0]
        );
        assert_eq!(
            loaded[1],
            want_fp.as_str(),
            "{what}: loaded the wrong state"
        );
        assert!(
            line_with(&out, "saved").is_some(),
            "{what}: the next save failed: {out}"
        );
        // Nothing half-written is left under a checkpoint name, nor anything else.
        let ckpts = work.join("checkpoints");
        for e in std::fs::read_dir(&ckpts).unwrap() {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            match name.as_str() {
                ".ivme-lock" => {}
                n if checkpoint_number(Path::new(n)).is_some() => {
                    verify(&ckpts.join(n)).unwrap_or_else(|e| panic!("{what}: {n}: {e}"));
                }
                other => panic!("{what}: leftover {other}"),
            }
        }
        let _ = std::fs::remove_dir_all(&work);
    }
}
