//! Checkpoints never lie: two jobs saving into one folder, a full disk, a FIFO in a checkpoint,
//! and the Hugging Face hub-cache layout of model files. The processes are
//! `examples/subjects/ckpt_faults.rs` (see its docs); every one is bounded in time and killed if late.
//!
//! Needs `cargo build --workspace --bins --examples` first.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor, Var};
use common::Scratch;
use ivme::checkpoint::{load_checkpoint_in_model, save_model, ShardSize};
use serde_json::json;

const LIMIT: Duration = Duration::from_secs(120);

/// A started example whose stdout lines arrive on a channel; killed when dropped.
struct Job {
    child: Child,
    lines: mpsc::Receiver<String>,
    stderr: std::thread::JoinHandle<String>,
}

impl Job {
    fn start(mut cmd: Command) -> Job {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
                let _ = tx.send(line);
            }
        });
        let mut err = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        Job {
            child,
            lines,
            stderr,
        }
    }

    /// Waits for the next stdout line (panics after the time limit).
    fn next_line(&self) -> String {
        self.lines.recv_timeout(LIMIT).expect("a line from the job")
    }

    /// Waits for the end (killing it past the limit); returns success, stdout lines, stderr.
    fn finish(mut self) -> (bool, Vec<String>, String) {
        let deadline = Instant::now() + LIMIT;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("the job ran past {LIMIT:?} and was killed");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut lines = Vec::new();
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(5)) {
            lines.push(l);
        }
        let stderr = std::mem::replace(&mut self.stderr, std::thread::spawn(String::new));
        (status.success(), lines, stderr.join().unwrap())
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn faults(args: &[&str]) -> Command {
    let mut cmd = Command::new(common::example_bin("ckpt_faults"));
    cmd.args(args).env("CKPT_KEEP", "0");
    cmd
}

/// `saved <dir> <fp>` lines → (dir, fp).
fn saved(lines: &[String]) -> Vec<(String, String)> {
    lines
        .iter()
        .filter_map(|l| l.strip_prefix("saved "))
        .map(|r| {
            let (d, fp) = r.split_once(' ').unwrap();
            (d.to_string(), fp.to_string())
        })
        .collect()
}

/// `ckpt_faults args...` on `n` processes through `ivme launch`.
fn launched(n: usize, args: &[&str]) -> Command {
    let mut cmd = Command::new(common::ivme_bin());
    cmd.args(["launch", "--num_processes", &n.to_string(), "--cpu"])
        .arg(common::example_bin("ckpt_faults"))
        .args(args)
        .env("CKPT_KEEP", "0");
    cmd
}

/// Loads every reported checkpoint in a fresh process and asserts it holds what was reported.
fn assert_all_load(scratch: &Path, reported: &[(String, String)]) {
    assert_all_load_on(1, scratch, reported)
}

/// Like [`assert_all_load`] for checkpoints saved by `n` processes (loaded on `n`).
fn assert_all_load_on(n: usize, scratch: &Path, reported: &[(String, String)]) {
    let list = scratch.join("reported.txt");
    let text: String = reported.iter().map(|(d, f)| format!("{d} {f}\n")).collect();
    std::fs::write(&list, text).unwrap();
    let args = ["check", list.to_str().unwrap()];
    let cmd = if n == 1 {
        faults(&args)
    } else {
        launched(n, &args)
    };
    let (ok, lines, err) = Job::start(cmd).finish();
    assert!(ok, "check failed: {err}");
    let bad: Vec<&String> = lines.iter().filter(|l| !l.starts_with("ok ")).collect();
    assert!(
        bad.is_empty(),
        "checkpoints reported saved that do not load: {bad:#?}"
    );
    assert_eq!(lines.len(), reported.len(), "{lines:?}");
}

#[test]
fn two_jobs_saving_into_one_project_never_lose_a_reported_checkpoint() {
    let s = Scratch::new("faults-two-jobs");
    let project = s.0.join("project");
    let p = project.to_str().unwrap();
    let a = Job::start(faults(&["save", p, "1", "30", "15"]));
    let pid_a = a.child.id();
    let first = a.next_line();
    assert!(first.starts_with("saved "), "job 1 saves first: {first}");
    // Job 2 starts while job 1 holds the folder, and tries 30 times.
    let b = Job::start(faults(&["save", p, "2", "30", "0"]));
    let (ok_b, lines_b, err_b) = b.finish();
    let (ok_a, mut lines_a, err_a) = a.finish();
    assert!(ok_a && ok_b, "{err_a}\n{err_b}");
    lines_a.insert(0, first);
    assert_eq!(
        saved(&lines_a).len(),
        30,
        "job 1 saves every time: {lines_a:?}"
    );
    let refused: Vec<&String> = lines_b
        .iter()
        .filter(|l| l.starts_with("failed "))
        .collect();
    // Job 2 is refused while job 1 holds the folder (and may save once job 1 has exited).
    assert!(
        !refused.is_empty(),
        "job 2 must be refused while job 1 runs: {lines_b:?}"
    );
    assert_eq!(refused.len() + saved(&lines_b).len(), 30, "{lines_b:?}");
    for r in &refused {
        assert!(
            r.contains("is locked by another job")
                && r.contains(&format!("pid {pid_a}"))
                && r.contains("since")
                && r.contains("project_dir"),
            "the refusal names the holder and what to do: {r}"
        );
    }
    let mut reported = saved(&lines_a);
    reported.extend(saved(&lines_b));
    assert_all_load(&s.0, &reported);
}

#[test]
fn a_two_rank_job_holds_its_folder_against_another_job() {
    let s = Scratch::new("faults-two-ranks");
    let project = s.0.join("project");
    let p = project.to_str().unwrap();
    let a = Job::start(launched(2, &["save", p, "1", "12", "40"]));
    let first = a.next_line();
    assert!(
        first.starts_with("saved "),
        "the 2-rank job saves first: {first}"
    );
    let (ok_b, lines_b, err_b) = Job::start(faults(&["save", p, "2", "5", "0"])).finish();
    let (ok_a, mut lines_a, err_a) = a.finish();
    assert!(ok_a && ok_b, "{err_a}\n{err_b}");
    lines_a.insert(0, first);
    assert_eq!(saved(&lines_a).len(), 12, "{lines_a:?}");
    let refused: Vec<&String> = lines_b
        .iter()
        .filter(|l| l.starts_with("failed "))
        .collect();
    assert!(!refused.is_empty(), "job 2 must be refused: {lines_b:?}");
    for l in refused {
        assert!(
            l.contains("is locked by another job") && l.contains("pid "),
            "{l}"
        );
    }
    assert_all_load_on(2, &s.0, &saved(&lines_a));
    // What job 2 saved once job 1 had exited loads too (on its one process).
    assert_all_load_on(1, &s.0, &saved(&lines_b));
}

#[test]
fn two_jobs_saving_the_same_explicit_folders_never_merge() {
    let s = Scratch::new("faults-explicit");
    let place = s.0.join("shared");
    let p = place.to_str().unwrap();
    let a = Job::start(faults(&["explicit", p, "1", "30"]));
    let b = Job::start(faults(&["explicit", p, "2", "30"]));
    let (ok_a, lines_a, err_a) = a.finish();
    let (ok_b, lines_b, err_b) = b.finish();
    assert!(ok_a && ok_b, "{err_a}\n{err_b}");
    let mut owners: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (dir, fp) in saved(&lines_a).into_iter().chain(saved(&lines_b)) {
        owners.entry(dir).or_default().push(fp);
    }
    for (dir, fps) in &owners {
        assert_eq!(fps.len(), 1, "{dir} was reported saved by both jobs");
    }
    for l in lines_a
        .iter()
        .chain(&lines_b)
        .filter(|l| l.starts_with("failed "))
    {
        assert!(
            l.contains("already holds a verified checkpoint") || l.contains("appeared while"),
            "a lost race must say so: {l}"
        );
    }
    assert_eq!(owners.len(), 30, "every name was saved by one of the jobs");
    let reported: Vec<(String, String)> =
        owners.into_iter().map(|(d, f)| (d, f[0].clone())).collect();
    assert_all_load(&s.0, &reported);
    let leftovers: Vec<_> = std::fs::read_dir(&place)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_full_disk_names_the_file_and_keeps_the_previous_checkpoint() {
    let s = Scratch::new("faults-fsize");
    let project = s.0.join("project");
    // A 512 KiB limit on any file this process writes, with SIGXFSZ ignored so the write
    // fails with EFBIG (what a full disk looks like to the writer) instead of killing it.
    let script = format!(
        "trap '' XFSZ; ulimit -f 1024 && exec \"$0\" grow '{}'",
        project.display()
    );
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(script)
        .arg(common::example_bin("ckpt_faults"));
    let (ok, lines, err) = Job::start(cmd).finish();
    assert!(ok, "{lines:?}\n{err}");
    let first = saved(&lines);
    assert_eq!(first.len(), 1, "{lines:?}");
    let failed = lines
        .iter()
        .find(|l| l.starts_with("failed "))
        .expect("the big save fails");
    assert!(
        failed.contains("custom_0.safetensors") && failed.contains("File too large"),
        "the error names the file: {failed}"
    );
    let loaded = lines
        .iter()
        .find_map(|l| l.strip_prefix("loaded "))
        .unwrap();
    assert_eq!(
        loaded,
        format!("{} {}", first[0].0, first[0].1),
        "the previous checkpoint still loads, unchanged"
    );
    let left: Vec<_> = std::fs::read_dir(project.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        left.iter()
            .all(|n| n == "checkpoint_0" || n == ".ivme-lock"),
        "the failed save left {left:?}"
    );
}

fn mkfifo(path: &Path) {
    let st = Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("mkfifo runs");
    assert!(st.success());
}

/// Runs `f` in a thread and fails the test if it does not return within 20 s (a hang).
fn bounded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20))
        .expect("returned in time instead of blocking on a FIFO")
}

#[test]
fn a_fifo_in_a_checkpoint_is_refused_without_blocking() {
    let s = Scratch::new("faults-fifo");
    let project = s.0.join("project");
    let p = project.to_str().unwrap().to_string();
    let (ok, lines, err) = Job::start(faults(&["save", &p, "1", "2"])).finish();
    assert!(ok, "{err}");
    let dirs: Vec<PathBuf> = saved(&lines)
        .into_iter()
        .map(|(d, _)| PathBuf::from(d))
        .collect();
    // A listed file replaced by a FIFO, and an unlisted FIFO beside the files.
    let newest = dirs[1].clone();
    std::fs::remove_file(newest.join("rank0/rng.json")).unwrap();
    mkfifo(&newest.join("rank0/rng.json"));
    mkfifo(&dirs[0].join("rank0/pipe"));
    for (dir, name) in [(&newest, "rng.json"), (&dirs[0], "pipe")] {
        let d = dir.clone();
        let e = bounded(move || ivme::checkpoint::verify(&d).map(drop))
            .expect_err("a FIFO fails verification");
        let e = e.to_string();
        assert!(e.contains(name) && e.contains("FIFO"), "{e}");
        let d = dir.clone();
        let e = bounded(move || ivme::checkpoint::read_rank(&d, 0).map(drop))
            .expect_err("a FIFO is not read");
        assert!(e.to_string().contains(name), "{e}");
    }
    // The whole Accelerator path, in a process: an explicit load errors, an automatic one
    // finds no complete checkpoint, and neither hangs.
    let list = s.0.join("list.txt");
    std::fs::write(&list, format!("{} x\n", newest.display())).unwrap();
    let (ok, lines, err) = Job::start(faults(&["check", list.to_str().unwrap()])).finish();
    assert!(ok, "{err}");
    assert!(
        lines[0].starts_with("bad") && lines[0].contains("FIFO"),
        "{lines:?}"
    );
    let (ok, _, err) = Job::start(faults(&["load", &p])).finish();
    assert!(!ok && err.contains("no complete checkpoint"), "{err}");
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn a_model_in_the_hub_cache_layout_loads_through_relative_links() {
    let s = Scratch::new("faults-hub");
    let dev = Device::Cpu;
    let tensors: Vec<(String, Tensor)> = (0..3)
        .map(|i| {
            let v: Vec<f32> = (0..20).map(|k| (i * 100 + k) as f32 * 0.5).collect();
            (
                format!("layer{i}.weight"),
                Tensor::from_vec(v, (4, 5), &dev).unwrap(),
            )
        })
        .collect();
    let staged = s.0.join("staged");
    let files = save_model(&tensors, &staged, Some(ShardSize::from_bytes(100).unwrap())).unwrap();
    assert_eq!(files.len(), 4, "3 shards and an index");
    // models--org--name/{blobs/<sha>, snapshots/<rev>/<file> -> ../../blobs/<sha>}
    let repo = s.0.join("models--org--name");
    let (blobs, snap) = (repo.join("blobs"), repo.join("snapshots/0123abc"));
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    for f in &files {
        let bytes = std::fs::read(f).unwrap();
        let sha = format!(
            "{:08x}{:08x}",
            bytes.len(),
            bytes.iter().map(|&b| b as u32).sum::<u32>()
        );
        std::fs::write(blobs.join(&sha), &bytes).unwrap();
        let name = f.file_name().unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{sha}"), snap.join(name)).unwrap();
    }
    let vars: Vec<(String, Var)> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), Var::zeros(t.shape(), DType::F32, &dev).unwrap()))
        .collect();
    let report = load_checkpoint_in_model(&vars, &snap, &dev).unwrap();
    assert_eq!(report.loaded.len(), 3);
    for ((_, v), (_, t)) in vars.iter().zip(&tensors) {
        assert_eq!(values(v.as_tensor()), values(t));
    }
    // The same through an Accelerator-prepared model.
    let mut acc = ivme::Accelerator::builder().cpu(true).build().unwrap();
    let vm = candle_nn::VarMap::new();
    for (n, t) in &tensors {
        vm.get(t.shape(), n, candle_nn::Init::Const(0.), DType::F32, &dev)
            .unwrap();
    }
    let vm = acc.prepare(vm).unwrap();
    acc.load_model(&snap).unwrap();
    assert_eq!(
        common::flat_weights(&vm),
        tensors
            .iter()
            .flat_map(|(_, t)| values(t))
            .collect::<Vec<f32>>()
    );
    // Traversal through the index is still refused: the index names where to look.
    // (`evil.safetensors` really exists where each entry leads, so only the index is at fault.)
    let evil = s.0.join("evil.safetensors");
    std::fs::copy(&files[0], &evil).unwrap();
    for entry in [
        "../evil.safetensors",
        evil.to_str().unwrap(),
        "./../evil.safetensors",
        "sub/../../evil.safetensors",
    ] {
        let dir = s.0.join(format!("evil-{}", entry.len()));
        std::fs::create_dir_all(&dir).unwrap();
        let index = json!({"metadata": {}, "weight_map": {"layer0.weight": entry}});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        let err = load_checkpoint_in_model(&vars[..1], &dir, &dev)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("outside the checkpoint folder"),
            "{entry}: {err}"
        );
    }
}

#[test]
fn two_ranks_skip_a_newest_checkpoint_damaged_on_one_rank_alike() {
    // Rank 1's own file of the newest checkpoint has one flipped bit (same size, so only the
    // checksum taken while loading can tell): both ranks must drop it and resume from the
    // older one together, without a separate verification pass.
    let s = Scratch::new("faults-newest-2r");
    let project = s.0.join("project");
    let p = project.to_str().unwrap();
    let (ok, lines, err) = Job::start(launched(2, &["resume", p, "2"])).finish();
    assert!(ok, "{err}");
    let saved = saved(&lines);
    assert_eq!(saved.len(), 2, "{lines:?}");
    let newest = PathBuf::from(&saved[1].0);
    let file = newest.join("rank1/rng.safetensors");
    let file = if file.is_file() {
        file
    } else {
        newest.join("rank1/training.safetensors")
    };
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() - 1;
    bytes[at] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    let (ok, lines, err) = Job::start(launched(2, &["resume", p, "0"])).finish();
    assert!(ok, "{err}");
    assert_eq!(
        lines.first().map(String::as_str),
        Some(format!("loaded {} {}", saved[0].0, saved[0].1).as_str()),
        "{lines:?}\n{err}"
    );
    assert!(err.contains("skipping damaged checkpoint"), "{err}");
}
