//! `ivme launch` with real processes: ranks, settings, failures and bad input.
//!
//! Needs `cargo build --workspace --bins --examples` first (the `ivme` binary and the `whoami`
//! example) and Open MPI's `mpirun` for the multi-process cases.

mod common;

use common::{example_bin, ivme_bin, launch, text};
use std::path::PathBuf;
use std::process::{Command, Output};

fn whoami() -> PathBuf {
    example_bin("whoami")
}

fn ivme(args: &[&str], envs: &[(&str, &str)]) -> Output {
    Command::new(ivme_bin())
        .args(args)
        .envs(envs.iter().copied())
        .output()
        .expect("the ivme binary runs")
}

fn lines(s: &str) -> Vec<&str> {
    s.lines().map(str::trim_end).collect()
}

/// A scratch folder unique to this test process and `tag`.
fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ivme-launcher-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn two_ranks_each_report_their_rank() {
    let out = launch(2, &whoami(), &[], &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let got = lines(&stdout);
    assert!(got.contains(&"rank 0 of 2"), "{stdout}\n{stderr}");
    assert!(got.contains(&"rank 1 of 2"), "{stdout}\n{stderr}");
}

#[test]
fn one_process_runs_directly_without_mpirun() {
    // No mpirun can be found on this PATH, so success proves the program ran directly.
    let empty = scratch("no-mpi");
    let out = launch(1, &whoami(), &[], &[("PATH", empty.to_str().unwrap())]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(lines(&stdout), ["rank 0 of 1"], "{stderr}");
    std::fs::remove_dir_all(&empty).unwrap();
}

#[test]
fn every_rank_receives_the_settings() {
    let prog = whoami();
    let out = ivme(
        &[
            "launch",
            "--num-processes=2",
            "--cpu",
            "--gradient_accumulation_steps",
            "2",
            "--mixed_precision",
            "bf16",
            prog.to_str().unwrap(),
        ],
        &[("WHOAMI_SHOW_ENV", "1")],
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = format!("RAYON_NUM_THREADS={}", (cores / 2).max(1));
    let got = lines(&stdout);
    for rank in 0..2 {
        for var in [
            "IVME_NUM_PROCESSES=2",
            "IVME_CPU=1",
            "IVME_GRAD_ACCUM=2",
            "IVME_PRECISION=bf16",
            "IVME_LAUNCHER=ivme",
            threads.as_str(),
        ] {
            let line = format!("rank {rank}: {var}");
            assert!(
                got.contains(&line.as_str()),
                "missing `{line}` in\n{stdout}\n{stderr}"
            );
        }
    }
}

#[test]
fn a_users_rayon_setting_is_left_alone() {
    let out = launch(
        2,
        &whoami(),
        &[],
        &[("WHOAMI_SHOW_ENV", "1"), ("RAYON_NUM_THREADS", "5")],
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let got = lines(&stdout);
    assert!(got.contains(&"rank 1: RAYON_NUM_THREADS=5"), "{stdout}");
}

#[test]
fn a_failing_rank_is_named_and_its_code_returned() {
    let out = launch(2, &whoami(), &[], &[("WHOAMI_FAIL_RANK", "1")]);
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(3),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stderr.contains("ivme: rank 1 failed with exit code 3"),
        "{stderr}"
    );
    assert!(
        stderr.contains("ivme: rank 1 failed first, with exit code 3"),
        "{stderr}"
    );
    assert!(!stderr.contains("rank 0 failed first"), "{stderr}");
}

#[test]
fn a_failing_single_process_returns_its_code() {
    let out = launch(1, &whoami(), &[], &[("WHOAMI_FAIL_RANK", "0")]);
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(3),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stderr.contains("failed with exit code 3"), "{stderr}");
}

/// Runs `ivme` expecting a usage error and returns its message.
fn refused(args: &[&str], envs: &[(&str, &str)]) -> String {
    let out = ivme(args, envs);
    let (stdout, stderr) = text(&out);
    assert!(
        !out.status.success(),
        "{args:?} should fail\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.is_empty(), "{args:?} printed on stdout: {stdout}");
    stderr
}

#[test]
fn bad_input_is_refused_with_the_fix() {
    let prog = whoami();
    let prog = prog.to_str().unwrap();
    let msg = refused(&["launch", "--num_processes", "0", prog], &[]);
    assert!(
        msg.contains("--num_processes 0") && msg.contains("at least 1"),
        "{msg}"
    );
    let msg = refused(&["launch", "--num_processes", "2"], &[]);
    assert!(msg.contains("missing the program to run"), "{msg}");
    assert!(
        msg.contains("ivme launch --num_processes 2 ./target/release/train"),
        "{msg}"
    );
    let msg = refused(&["launch", "--num_procs", "2", prog], &[]);
    assert!(msg.contains("unknown flag `--num_procs`"), "{msg}");
    assert!(msg.contains("did you mean `--num_processes`"), "{msg}");
    let msg = refused(&["launch", "./no/such/program"], &[]);
    assert!(msg.contains("does not exist"), "{msg}");
    let msg = refused(&["launch", "--hostfile", "/no/such/hostfile", prog], &[]);
    assert!(
        msg.contains("cannot read the hostfile /no/such/hostfile"),
        "{msg}"
    );
    let msg = refused(&["launch", "--mixed_precision", "fp8", prog], &[]);
    assert!(msg.contains("use one of no, fp16, bf16"), "{msg}");
    let msg = refused(&["lunch", prog], &[]);
    assert!(msg.contains("did you mean `ivme launch`"), "{msg}");
}

#[test]
fn a_missing_mpirun_says_to_install_open_mpi() {
    let empty = scratch("no-mpirun");
    let prog = whoami();
    let msg = refused(
        &["launch", "--num_processes", "2", prog.to_str().unwrap()],
        &[("PATH", empty.to_str().unwrap())],
    );
    std::fs::remove_dir_all(&empty).unwrap();
    assert!(
        msg.contains("apt-get install openmpi-bin libopenmpi-dev"),
        "{msg}"
    );
}

#[test]
fn dry_run_prints_the_command_and_runs_nothing() {
    let dir = scratch("dry-run");
    let marker = dir.join("ran");
    let script = format!("touch {}", marker.display());
    let out = ivme(
        &[
            "launch",
            "--num_processes",
            "2",
            "--cpu",
            "--dry_run",
            "sh",
            "-c",
            &script,
        ],
        &[],
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let got = lines(&stdout);
    assert!(got.contains(&"IVME_NUM_PROCESSES=2"), "{stdout}");
    assert!(got.contains(&"IVME_CPU=1"), "{stdout}");
    assert!(got.contains(&"IVME_LAUNCHER=ivme"), "{stdout}");
    let command = got.last().unwrap();
    assert!(
        command.contains("mpirun") && command.contains("-np 2"),
        "{stdout}"
    );
    assert!(
        command.contains(&format!("-c 'touch {}'", marker.display())),
        "{stdout}"
    );
    // Give a started rank time to act before concluding nothing ran.
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(!marker.exists(), "the dry run started the program");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn help_lists_the_flags() {
    let out = ivme(&["launch", "--help"], &[]);
    let (stdout, _) = text(&out);
    assert!(out.status.success());
    for flag in [
        "--num_processes",
        "--cpu",
        "--hostfile",
        "--mixed_precision",
        "--dry_run",
    ] {
        assert!(stdout.contains(flag), "{flag} missing from\n{stdout}");
    }
}
