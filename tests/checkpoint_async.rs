//! Asynchronous checkpoints (`save_state_async`, `async_checkpoints(true)`): resuming from one
//! is bit-exact on 1 and 2 processes, a SIGKILL while a background write is in progress leaves
//! the previous checkpoint as the one the next run resumes from, and a failed background write
//! (a real `EFBIG` on one rank) is an error on every rank at the next call, never a hang.
//!
//! The subject is `examples/subjects/ckpt_async.rs` (see its docs). Every run is bounded in time and
//! started in its own process group, which is killed whole if it is late.
//! Needs `cargo build --workspace --bins --examples` first.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::Scratch;
use ivme::checkpoint::project::checkpoint_number;
use ivme::checkpoint::{latest_valid, verify};

const LIMIT: Duration = Duration::from_secs(120);

/// The subject on `procs` processes (1: the program itself; 2: through `ivme launch`).
fn command(procs: usize, args: &[&str], env: &[(&str, String)]) -> Command {
    let exe = common::example_bin("ckpt_async");
    let mut cmd = if procs == 1 {
        Command::new(exe)
    } else {
        let mut c = Command::new(common::ivme_bin());
        c.args(["launch", "--num_processes", &procs.to_string(), "--cpu"])
            .arg(exe);
        c
    };
    cmd.args(args)
        .env_remove("IVME_CRASH_AT")
        .env_remove("IVME_CRASH_TRACE")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own group, so a late run is killed with every process it started.
        .process_group(0);
    cmd
}

/// A started run, killed with its whole process group when dropped.
struct Job(Child);

impl Job {
    fn start(mut cmd: Command) -> Job {
        Job(cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}")))
    }

    /// Waits up to [`LIMIT`]; returns (status, stdout, stderr).
    fn finish(mut self) -> (ExitStatus, String, String) {
        let mut out = self.0.stdout.take().unwrap();
        let mut err = self.0.stderr.take().unwrap();
        let so = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        });
        let se = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        let deadline = Instant::now() + LIMIT;
        let status = loop {
            if let Some(s) = self.0.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "a run hung past {LIMIT:?}");
            std::thread::sleep(Duration::from_millis(10));
        };
        (status, so.join().unwrap(), se.join().unwrap())
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // SAFETY: signals the process group this test started (its leader's pid).
        unsafe {
            libc::kill(-(self.0.id() as i32), libc::SIGKILL);
        }
        let _ = self.0.wait();
    }
}

fn run(procs: usize, args: &[&str], env: &[(&str, String)]) -> (ExitStatus, String, String) {
    Job::start(command(procs, args, env)).finish()
}

/// Runs and insists on success; returns stdout.
fn ok(procs: usize, args: &[&str], env: &[(&str, String)]) -> String {
    let (status, out, err) = run(procs, args, env);
    assert!(
        status.success(),
        "{args:?} {env:?} on {procs}: {status}\n{out}\n{err}"
    );
    out
}

/// The words after `word` on the last stdout line starting with it.
fn last<'a>(out: &'a str, word: &str) -> Vec<&'a str> {
    out.lines()
        .rev()
        .find(|l| l.split(' ').next() == Some(word))
        .unwrap_or_else(|| panic!("no `{word}` line in:\n{out}"))
        .split(' ')
        .skip(1)
        .collect()
}

/// The newest valid checkpoint's number, after checking that every visible one verifies.
fn newest(project: &Path) -> Option<u64> {
    let ckpts = project.join("checkpoints");
    for e in std::fs::read_dir(&ckpts).into_iter().flatten() {
        let p = e.unwrap().path();
        if checkpoint_number(&p).is_some() {
            verify(&p).unwrap_or_else(|e| panic!("{} is visible but invalid: {e}", p.display()));
        }
    }
    latest_valid(&ckpts)
        .unwrap()
        .map(|(d, _)| checkpoint_number(&d).unwrap())
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn resuming_from_an_async_checkpoint_is_bit_exact_on_one_and_two_processes() {
    // Every write starts 50 ms late, after the next steps changed the weights in place: only
    // the copy taken when the save returned can be what is written.
    let late = || ("IVME_ASYNC_WRITE_DELAY_MS", "50".to_string());
    for procs in [1, 2] {
        let root = Scratch::new(&format!("async-exact-{procs}"));
        let (whole, part) = (root.0.join("whole"), root.0.join("part"));
        let out = ok(procs, &[s(&whole), "20", "4"], &[late()]);
        let want = last(&out, "final")[0].to_string();
        assert_eq!(newest(&whole), Some(4), "the drop committed the last save");
        // End two steps after the save at step 8 (the drop commits it), then resume.
        let env = [("CKPT_STOP", "8".into()), late()];
        let out = ok(procs, &[s(&part), "20", "4"], &env);
        let at8 = last(&out, "pending")[1].to_string();
        assert!(at8.starts_with("s8-"), "{out}");
        assert!(last(&out, "final")[0].starts_with("s10-"), "{out}");
        let out = ok(procs, &[s(&part), "20", "4"], &[late()]);
        let loaded = last(&out, "loaded");
        assert!(loaded[0].ends_with("checkpoint_1"), "{out}");
        assert_eq!(
            loaded[1], at8,
            "on {procs}: the checkpoint holds the state it was taken at"
        );
        assert_eq!(
            last(&out, "final")[0],
            want,
            "on {procs}: resumed != uninterrupted"
        );
        // The explicit API, with an explicit wait at the end, resumes the same way.
        let explicit = root.0.join("explicit");
        let env = [
            ("CKPT_EXPLICIT", "1".into()),
            ("CKPT_WAIT", "1".into()),
            late(),
        ];
        let out = ok(procs, &[s(&explicit), "12", "4"], &env);
        assert!(
            last(&out, "committed")[0].ends_with("checkpoint_2"),
            "{out}"
        );
        let out = ok(procs, &[s(&explicit), "20", "4"], &env);
        assert!(last(&out, "loaded")[0].ends_with("checkpoint_2"), "{out}");
        assert_eq!(last(&out, "final")[0], want, "on {procs}: explicit API");
    }
}

/// The crash points of the second save's background write on `rank`, from a traced run of
/// `procs` processes (`IVME_CRASH_TRACE` on that rank only), numbered as `IVME_CRASH_AT` counts.
fn background_steps(procs: usize, rank: usize, project: &Path) -> Vec<usize> {
    let env = [
        ("IVME_CRASH_TRACE", "1".into()),
        ("CKPT_CRASH_RANK", rank.to_string()),
    ];
    let (status, _, err) = run(procs, &[s(project), "12", "4"], &env);
    assert!(status.success(), "{err}");
    let _ = std::fs::remove_dir_all(project);
    let mine = format!(".tmp/rank{rank}");
    let steps: Vec<usize> = err
        .lines()
        .filter_map(|l| l.strip_prefix("ivme: crash point "))
        .filter_map(|l| l.split_once(": "))
        .filter(|(_, step)| step.contains("/.checkpoint_1.save-") && step.contains(&mine))
        .map(|(n, _)| n.parse().unwrap())
        .collect();
    assert!(
        steps.len() >= 10,
        "too few background steps on rank {rank}:\n{err}"
    );
    steps
}

/// After a kill during the second save's background write: checkpoint_0 is the newest and
/// valid, and the next run resumes from it to the uninterrupted result.
fn check_resume(procs: usize, project: &Path, want: &str, what: &str) {
    assert_eq!(
        newest(project),
        Some(0),
        "{what}: the previous checkpoint is the newest"
    );
    let out = ok(procs, &[s(project), "12", "4"], &[]);
    assert!(
        last(&out, "loaded")[0].ends_with("checkpoint_0"),
        "{what}: {out}"
    );
    assert_eq!(
        last(&out, "final")[0],
        want,
        "{what}: resumed != uninterrupted"
    );
    let _ = std::fs::remove_dir_all(project);
}

#[test]
fn sigkill_during_a_background_write_leaves_the_previous_checkpoint_to_resume_from() {
    let root = Scratch::new("async-kill");
    let project = root.0.join("p");
    // One process: a crash at every step of the background write (the hook SIGKILLs).
    let want = last(&ok(1, &[s(&project), "12", "4"], &[]), "final")[0].to_string();
    let _ = std::fs::remove_dir_all(&project);
    for k in background_steps(1, 0, &project) {
        let env = [("IVME_CRASH_AT", k.to_string())];
        let (status, _, err) = run(1, &[s(&project), "12", "4"], &env);
        assert_eq!(status.signal(), Some(9), "crash at {k}: {status}\n{err}");
        check_resume(1, &project, &want, &format!("crash at step {k}"));
    }
    // One process, killed from outside while the save at step 8 runs in the background.
    let mut job = Job::start(command(
        1,
        &[s(&project), "12", "4"],
        &[("CKPT_PAUSE_MS", "3000".into())],
    ));
    let lines = BufReader::new(job.0.stdout.take().unwrap()).lines();
    for line in lines.map_while(|l| l.ok()) {
        if line.starts_with("pending") && line.contains("checkpoint_1") {
            break;
        }
    }
    job.0.kill().unwrap();
    assert_eq!(job.0.wait().unwrap().signal(), Some(9));
    drop(job);
    check_resume(
        1,
        &project,
        &want,
        "SIGKILL after the save at step 8 returned",
    );
    // Two processes: each rank killed early, midway and late in its background write.
    let want = last(&ok(2, &[s(&project), "12", "4"], &[]), "final")[0].to_string();
    let _ = std::fs::remove_dir_all(&project);
    for rank in [0, 1] {
        let steps = background_steps(2, rank, &project);
        for k in [steps[0], steps[steps.len() / 2], steps[steps.len() - 1]] {
            let env = [
                ("IVME_CRASH_AT", k.to_string()),
                ("CKPT_CRASH_RANK", rank.to_string()),
            ];
            let (status, _, err) = run(2, &[s(&project), "12", "4"], &env);
            assert!(!status.success(), "rank {rank} at {k}: {err}");
            assert!(
                err.contains(&format!("injected crash at step {k}")),
                "rank {rank} at {k}: {err}"
            );
            check_resume(
                2,
                &project,
                &want,
                &format!("rank {rank} crashed at step {k}"),
            );
        }
    }
}

/// The `rank<R> failed ...` lines of a run, by rank.
fn failures(out: &str) -> Vec<(usize, String)> {
    out.lines()
        .filter_map(|l| {
            let (who, msg) = l.split_once(" failed ")?;
            Some((who.strip_prefix("rank")?.parse().ok()?, msg.to_string()))
        })
        .collect()
}

#[test]
fn a_failed_background_write_is_an_error_on_every_rank_at_the_next_call() {
    let root = Scratch::new("async-fail");
    for procs in [1, 2] {
        let p = |name: &str| -> PathBuf { root.0.join(format!("{name}{procs}")) };
        let want = last(&ok(procs, &[s(&p("ref")), "16", "4"], &[]), "final")[0].to_string();
        let _ = std::fs::remove_dir_all(p("ref"));
        // Rank `procs - 1` cannot write the save at step 8 (EFBIG); the save at 12 reports it
        // on every rank, and its retry works.
        let bad = (procs - 1).to_string();
        let env = [("CKPT_BIG_AT", "8".into()), ("CKPT_BIG_RANK", bad.clone())];
        let out = ok(procs, &[s(&p("a")), "16", "4"], &env);
        let f = failures(&out);
        assert_eq!(f.len(), procs, "one failure per rank: {out}");
        for (rank, msg) in &f {
            if *rank == procs - 1 {
                assert!(msg.contains("File too large"), "{msg}");
            } else {
                assert!(msg.contains(&format!("failed on rank(s) [{bad}]")), "{msg}");
            }
        }
        assert!(!out.contains("failed again"), "the retry works: {out}");
        assert_eq!(newest(&p("a")), Some(2));
        let out = ok(procs, &[s(&p("a")), "16", "4"], &[]);
        assert_eq!(
            last(&out, "final")[0],
            want,
            "on {procs}: after the failure"
        );
        // The last save fails: an explicit wait returns the error on every rank ...
        let env = [
            ("CKPT_BIG_AT", "8".into()),
            ("CKPT_BIG_RANK", bad.clone()),
            ("CKPT_WAIT", "1".into()),
        ];
        let out = ok(procs, &[s(&p("b")), "8", "4"], &env);
        assert_eq!(failures(&out).len(), procs, "{out}");
        assert_eq!(newest(&p("b")), Some(0));
        // ... and without one the drop says so on every rank and the run still ends.
        let env = [("CKPT_BIG_AT", "8".into()), ("CKPT_BIG_RANK", bad)];
        let (status, out, err) = run(procs, &[s(&p("c")), "8", "4"], &env);
        assert!(status.success(), "{out}\n{err}");
        for rank in 0..procs {
            assert!(
                err.contains(&format!("rank {rank}: the checkpoint"))
                    && err.contains("was not committed"),
                "rank {rank}: {err}"
            );
        }
        assert_eq!(newest(&p("c")), Some(0));
    }
    // A rank that returns an error while its save is in the background: its drop and the
    // other rank's next collective fail at once instead of waiting, and the save is dropped.
    let env = [("CKPT_QUIT_AT", "8".into()), ("CKPT_QUIT_RANK", "1".into())];
    let started = Instant::now();
    let d = root.0.join("d");
    let (status, out, err) = run(2, &[s(&d), "16", "4"], &env);
    assert!(!status.success(), "{out}\n{err}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
    assert!(err.contains("rank 1 quits at step 8"), "{err}");
    assert_eq!(newest(&d), Some(0));
}
