//! Preemption with real processes: SIGTERM or SIGUSR1 to `ivme launch` or to one rank, at a
//! moment of the run the test does not control, stops every rank after the optimizer step they
//! agree on; the state is saved there, the launcher exits with the requeue code, and running
//! the job again ends bit for bit like a run that was never interrupted.
//!
//! Needs `cargo build --workspace --bins --examples` first (the `ivme` binary, the
//! `restartable` example and the `macro_resume` subject) and Open MPI's `mpirun`. Every job runs
//! under a time limit and is killed with everything it started on overrun.

mod common;

use common::job::{report, weight_bits, words, Ended, Job};
use common::{example_bin, Scratch};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// The exit code `ivme launch` ends a preempted job with by default.
const REQUEUE: i32 = 75;

/// Where a signal goes.
#[derive(Debug, Clone, Copy)]
enum Target {
    Launcher,
    Rank(usize),
}

/// One preemption: ranks, what is signalled with which signal, after how long, and whether
/// saves run in the background.
#[derive(Debug, Clone, Copy)]
struct Case {
    ranks: usize,
    target: Target,
    signal: &'static str,
    after_ms: u64,
    async_saves: bool,
}

/// `restartable`'s settings shared by every run of a comparison (the maths depend on them).
const RUN: &[&str] = &["epochs=6", "save_every=4"];

fn restartable(ranks: usize, project: &Path, out: &Path, extra: &[&str]) -> Job {
    restartable_with(ranks, project, out, extra, &[])
}

/// [`restartable`] with variables for the launcher.
fn restartable_with(
    ranks: usize,
    project: &Path,
    out: &Path,
    extra: &[&str],
    envs: &[(&str, &str)],
) -> Job {
    let n = ranks.to_string();
    let mut args = words(&["--num_processes", &n, "--cpu"]);
    args.push(example_bin("restartable").display().to_string());
    args.push(project.display().to_string());
    args.push(out.display().to_string());
    args.extend(words(RUN));
    args.extend(words(extra));
    Job::start(&args, envs)
}

/// Waits until every rank wrote its pid into `out/ready-rank{R}`.
fn pids(out: &Path, ranks: usize, job: &Job) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let read: Vec<Option<u32>> = (0..ranks)
            .map(|r| {
                std::fs::read_to_string(out.join(format!("ready-rank{r}")))
                    .ok()
                    .and_then(|t| t.trim().parse().ok())
            })
            .collect();
        if read.iter().all(Option::is_some) {
            return read.into_iter().flatten().collect();
        }
        assert!(
            Instant::now() < deadline,
            "the ranks of launcher {} never got ready",
            job.pid()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn send(signal: &str, pid: u32) {
    let ok = Command::new("kill")
        .args(["-s", signal, &pid.to_string()])
        .status()
        .expect("running kill")
        .success();
    assert!(ok, "kill -s {signal} {pid} failed");
}

/// The step and folder the launcher said the ranks stopped and saved at.
fn stopped_at(end: &Ended) -> (u64, String) {
    let line = end
        .stderr
        .lines()
        .find(|l| l.starts_with("ivme: preempted"))
        .unwrap_or_else(|| panic!("no preemption line\n{}", end.show()));
    let after = line
        .split("after optimizer step ")
        .nth(1)
        .unwrap_or_else(|| panic!("no step in {line}"));
    let step = after
        .split_whitespace()
        .next()
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no step in {line}"));
    let saved = after
        .split(" and saved ")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .unwrap_or_else(|| panic!("nothing saved in {line}"))
        .to_string();
    (step, saved)
}

/// Runs one preemption case against `baseline` (the final weights of an uninterrupted run on
/// as many ranks); returns the step it stopped at.
fn preempt_and_resume(dir: &Path, i: usize, case: Case, baseline: &serde_json::Value) -> u64 {
    let project = dir.join(format!("project-{i}"));
    let (out, resumed_out) = (dir.join(format!("out-{i}")), dir.join(format!("again-{i}")));
    let async_arg = if case.async_saves {
        "async=1"
    } else {
        "async=0"
    };
    let job = restartable(case.ranks, &project, &out, &["step_ms=40", async_arg]);
    let ranks = pids(&out, case.ranks, &job);
    std::thread::sleep(Duration::from_millis(case.after_ms));
    match case.target {
        Target::Launcher => send(case.signal, job.pid()),
        Target::Rank(r) => send(case.signal, ranks[r]),
    }
    let sent = Instant::now();
    let end = job.wait();
    let took = sent.elapsed();
    assert_eq!(
        end.status.code(),
        Some(REQUEUE),
        "{case:?}: not the requeue code\n{}",
        end.show()
    );
    assert!(
        took < Duration::from_secs(20),
        "{case:?}: the job took {took:?} to stop\n{}",
        end.show()
    );
    assert!(
        !out.join("params.json").exists(),
        "{case:?}: the run finished before the signal; signal it earlier\n{}",
        end.show()
    );
    let (step, saved) = stopped_at(&end);
    assert!(
        Path::new(&saved).join("manifest.json").is_file() || Path::new(&saved).is_dir(),
        "{case:?}: the checkpoint {saved} is not there\n{}",
        end.show()
    );
    let again = restartable(case.ranks, &project, &resumed_out, &[]).wait();
    assert!(
        again.status.success(),
        "{case:?}: the resumed run failed\n{}",
        again.show()
    );
    let resumed = report(&resumed_out);
    assert_eq!(
        resumed["start_step"].as_u64(),
        Some(step),
        "{case:?}: the resumed run did not start at the step the stop saved\n{}",
        again.show()
    );
    assert_eq!(
        resumed["resumed_from"].as_str(),
        Some(saved.as_str()),
        "{case:?}\n{}",
        again.show()
    );
    assert_eq!(
        weight_bits(&resumed),
        weight_bits(baseline),
        "{case:?}: stopped at step {step} and resumed, the weights differ from the \
         uninterrupted run's"
    );
    eprintln!("{case:?}: stopped after step {step} in {took:?}, resumed bit for bit");
    step
}

fn baseline(dir: &Path, ranks: usize) -> serde_json::Value {
    let (project, out) = (
        dir.join(format!("base-project-{ranks}")),
        dir.join(format!("base-out-{ranks}")),
    );
    let end = restartable(ranks, &project, &out, &[]).wait();
    assert!(end.status.success(), "{}", end.show());
    report(&out)
}

#[test]
fn a_preempted_job_saves_at_the_step_the_ranks_agree_on_and_resumes_bit_for_bit() {
    let dir = Scratch::new("preempt");
    let bases = [baseline(&dir.0, 2), baseline(&dir.0, 3)];
    let cases = [
        (2, Target::Launcher, "TERM", 300, false),
        (2, Target::Rank(1), "USR1", 450, false),
        (2, Target::Launcher, "USR1", 350, true),
        (3, Target::Rank(2), "TERM", 400, true),
        (3, Target::Rank(0), "TERM", 250, false),
    ];
    for (i, (ranks, target, signal, after_ms, async_saves)) in cases.into_iter().enumerate() {
        let case = Case {
            ranks,
            target,
            signal,
            after_ms,
            async_saves,
        };
        preempt_and_resume(&dir.0, i, case, &bases[ranks - 2]);
    }
}

#[test]
fn a_loop_without_a_preemption_point_stops_at_its_next_backward_and_says_nothing_was_saved() {
    // Also the launcher's flags: another signal, another exit code.
    let dir = Scratch::new("preempt-no-point");
    let (project, out) = (dir.0.join("project"), dir.0.join("out"));
    let mut args = words(&[
        "--num_processes",
        "2",
        "--cpu",
        "--preempt_signals",
        "USR2",
        "--requeue_exit_code",
        "99",
    ]);
    args.push(example_bin("restartable").display().to_string());
    args.push(project.display().to_string());
    args.push(out.display().to_string());
    args.extend(words(RUN));
    args.extend(words(&["step_ms=25", "point=0"]));
    let job = Job::start(&args, &[]);
    pids(&out, 2, &job);
    std::thread::sleep(Duration::from_millis(300));
    send("USR2", job.pid());
    let end = job.wait();
    assert_eq!(end.status.code(), Some(99), "{}", end.show());
    assert!(
        end.stderr.contains("without saving") && end.stderr.contains("no preemption point"),
        "{}",
        end.show()
    );
    assert!(!out.join("params.json").exists(), "{}", end.show());
}

#[test]
fn a_rank_that_cannot_stop_within_the_grace_period_exits_and_the_last_checkpoint_stands() {
    let dir = Scratch::new("preempt-grace");
    let base = baseline(&dir.0, 2);
    let (project, out) = (dir.0.join("project"), dir.0.join("out"));
    // Each step takes 1.5 s and is saved; the signal lands inside the second step, whose sync
    // is more than the 0.3 s grace period away.
    let job = restartable_with(
        2,
        &project,
        &out,
        &["step_ms=1500", "save_every=1"],
        &[("IVME_PREEMPT_GRACE", "300ms")],
    );
    pids(&out, 2, &job);
    let saved = project.join("checkpoints");
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::read_dir(&saved).map_or(0, |d| d.count()) == 0 {
        assert!(Instant::now() < deadline, "no checkpoint was ever saved");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    send("TERM", job.pid());
    let sent = Instant::now();
    let end = job.wait();
    let took = sent.elapsed();
    assert_eq!(end.status.code(), Some(REQUEUE), "{}", end.show());
    assert!(
        end.stderr.contains("not stopped within the grace period")
            && end.stderr.contains("before it could stop at a step"),
        "{}",
        end.show()
    );
    assert!(
        took < Duration::from_secs(5),
        "took {took:?}\n{}",
        end.show()
    );
    // The checkpoint of step 1 stands: the job continues from it and ends as if never stopped.
    let again_out = dir.0.join("again");
    let again = restartable(2, &project, &again_out, &[]).wait();
    assert!(again.status.success(), "{}", again.show());
    let resumed = report(&again_out);
    assert_eq!(resumed["start_step"].as_u64(), Some(1), "{}", again.show());
    assert_eq!(weight_bits(&resumed), weight_bits(&base));
}

#[test]
fn a_macro_loop_stops_for_a_preemption_and_resumes_bit_for_bit() {
    let dir = Scratch::new("preempt-macro");
    let run = |project: &Path, out: &Path, extra: &[&str]| {
        let mut args = words(&["--num_processes", "2", "--cpu"]);
        args.push(example_bin("macro_resume").display().to_string());
        args.push(format!("project={}", project.display()));
        args.push(format!("out={}", out.display()));
        args.extend(words(extra));
        Job::start(&args, &[]).wait()
    };
    let whole = run(&dir.0.join("a"), &dir.0.join("a-out"), &[]);
    assert!(whole.status.success(), "{}", whole.show());
    // Rank 1 sends itself SIGTERM after its third optimizer step: the ranks agree at the next
    // gradient sync and stop after step 4.
    let (project, out) = (dir.0.join("b"), dir.0.join("b-out"));
    let stopped = run(&project, &out, &["preempt_at=3"]);
    assert_eq!(stopped.status.code(), Some(REQUEUE), "{}", stopped.show());
    let (step, _) = stopped_at(&stopped);
    assert_eq!(step, 4, "{}", stopped.show());
    let again = run(&project, &out, &[]);
    assert!(again.status.success(), "{}", again.show());
    for rank in 0..2 {
        let read = |d: &str| -> serde_json::Value {
            let path = dir.0.join(d).join(format!("rank{rank}.json"));
            serde_json::from_slice(&std::fs::read(&path).expect("a rank's report")).expect("JSON")
        };
        assert_eq!(
            weight_bits(&read("b-out")),
            weight_bits(&read("a-out")),
            "rank {rank}: stopped at step 4 and resumed, the weights differ"
        );
    }
}

/// `cargo test --test preempt -- --ignored`: 20 preemptions at pseudo-random moments, targets
/// and signals, on 2 and 3 ranks, with and without background saves.
#[test]
#[ignore = "a stress run of about two minutes"]
fn twenty_preemptions_at_random_moments_all_save_and_resume_bit_for_bit() {
    let dir = Scratch::new("preempt-stress");
    let bases = [baseline(&dir.0, 2), baseline(&dir.0, 3)];
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let mut steps = Vec::new();
    for i in 0..20 {
        let ranks = 2 + next(2) as usize;
        let target = match next(ranks as u64 + 1) {
            0 => Target::Launcher,
            r => Target::Rank(r as usize - 1),
        };
        let case = Case {
            ranks,
            target,
            signal: if next(2) == 0 { "TERM" } else { "USR1" },
            after_ms: 150 + next(450),
            async_saves: next(2) == 0,
        };
        steps.push(preempt_and_resume(&dir.0, i, case, &bases[ranks - 2]));
    }
    eprintln!("stopped at steps {steps:?}");
}
