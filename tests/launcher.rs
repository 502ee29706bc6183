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

/// Runs `mpirun -np 2 PROGRAM ARGS` (Open MPI, as root where needed) and returns the ranks'
/// sorted lines.
fn plain_mpirun(program: &str, args: &[&str]) -> (Output, Vec<String>) {
    let out = Command::new("mpirun")
        .args(["--oversubscribe", "-np", "2", program])
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("mpirun runs");
    let mut got: Vec<String> = text(&out).0.lines().map(String::from).collect();
    got.sort();
    (out, got)
}

#[test]
fn plain_mpirun_and_srun_give_each_process_its_rank() {
    let bin = whoami();
    let bin = bin.to_str().unwrap();
    let (out, got) = plain_mpirun(bin, &[]);
    assert_eq!(got, ["rank 0 of 2", "rank 1 of 2"], "{:?}", text(&out));
    // `srun --mpi=pmix`, simulated: MPI forms its world through PMIx (mpirun's server here),
    // and the process learns its place only from SLURM's task variables, as under srun (PMIx
    // exports the rank, not the size; Open MPI's own variables are removed).
    let srun = format!(
        "SLURM_PROCID=$OMPI_COMM_WORLD_RANK SLURM_LOCALID=$OMPI_COMM_WORLD_LOCAL_RANK \
         SLURM_STEP_NUM_TASKS=2 SLURM_NODEID=0 SLURM_STEP_TASKS_PER_NODE=2 \
         exec env -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u OMPI_COMM_WORLD_LOCAL_RANK \
         -u OMPI_COMM_WORLD_LOCAL_SIZE {bin}"
    );
    let (out, got) = plain_mpirun("sh", &["-c", &srun]);
    assert_eq!(got, ["rank 0 of 2", "rank 1 of 2"], "{:?}", text(&out));
    // srun without MPI's process manager: each task is a world of its own, and says how to fix it.
    let out = Command::new(bin)
        .env("SLURM_PROCID", "1")
        .env("SLURM_STEP_NUM_TASKS", "2")
        .output()
        .unwrap();
    let (so, se) = text(&out);
    assert!(!out.status.success(), "{so}");
    assert!(
        se.contains("rank 1 of 2") && se.contains("srun --mpi=pmix"),
        "{se}"
    );
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
            "--collective_timeout",
            "2m",
            "--debug_sync",
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
            "IVME_COLLECTIVE_TIMEOUT=120",
            "IVME_DEBUG_SYNC=1",
            "IVME_RESTART_COUNT=0",
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
#[cfg(target_os = "linux")]
fn ranks_get_allocator_and_candle_settings_unless_the_user_set_them() {
    let out = launch(2, &whoami(), &[], &[("WHOAMI_SHOW_ENV", "1")]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let got = lines(&stdout);
    for rank in 0..2 {
        for var in [
            "MALLOC_MMAP_THRESHOLD_=33554432",
            "MALLOC_TRIM_THRESHOLD_=17179869184",
            "CANDLE_BARRIER_POOL_SPIN_LIMIT=1000",
        ] {
            let line = format!("rank {rank}: {var}");
            assert!(
                got.contains(&line.as_str()),
                "missing `{line}` in\n{stdout}"
            );
        }
    }
    let out = launch(
        2,
        &whoami(),
        &[],
        &[
            ("WHOAMI_SHOW_ENV", "1"),
            ("MALLOC_TRIM_THRESHOLD_", "4096"),
            ("CANDLE_BARRIER_POOL_SPIN_LIMIT", "25000"),
        ],
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let got = lines(&stdout);
    assert!(
        got.contains(&"rank 1: MALLOC_TRIM_THRESHOLD_=4096"),
        "{stdout}"
    );
    assert!(
        got.contains(&"rank 1: CANDLE_BARRIER_POOL_SPIN_LIMIT=25000"),
        "{stdout}"
    );
    assert!(
        got.contains(&"rank 1: MALLOC_MMAP_THRESHOLD_=33554432"),
        "{stdout}"
    );
    let out = launch(
        2,
        &whoami(),
        &[],
        &[("WHOAMI_SHOW_ENV", "1"), ("IVME_MALLOC_TUNING", "0")],
    );
    let (stdout, _) = text(&out);
    assert!(!stdout.contains("MALLOC_MMAP_THRESHOLD_"), "{stdout}");
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
        "--max_restarts",
        "--collective_timeout",
        "--debug_sync",
    ] {
        assert!(stdout.contains(flag), "{flag} missing from\n{stdout}");
    }
    for var in [
        "IVME_RESTART_COUNT",
        "IVME_COLLECTIVE_TIMEOUT",
        "IVME_DEBUG_SYNC",
    ] {
        assert!(stdout.contains(var), "{var} missing from\n{stdout}");
    }
}

mod reference;

/// Several machines, played by this one: a hostfile or the config's `hosts` naming `localhost`
/// and `127.0.0.1`, which Open MPI runs as one node but ivme launches through its
/// multi-machine path (a host list, no loopback binding, machine ranks).
mod multi_machine {
    use super::common::{example_bin, ivme_bin, ok, refused};
    use super::reference;
    use serde_json::Value;
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};
    use std::process::{Command, Output};

    fn scratch(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("ivme-machines-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Runs `ivme args...` with `config` as its config file and a home folder of its own.
    fn ivme(dir: &Path, config: &Path, args: &[&str]) -> Output {
        Command::new(ivme_bin())
            .args(args)
            .env("IVME_CONFIG", config)
            .env("HOME", dir)
            .env_remove("XDG_CONFIG_HOME")
            .output()
            .expect("the ivme binary runs")
    }

    fn params(path: &Path) -> BTreeMap<String, Vec<f32>> {
        let v: Value = serde_json::from_slice(
            &std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
        .unwrap();
        assert_eq!(v["world"], 2, "{v}");
        serde_json::from_value(v["params"].clone()).unwrap()
    }

    /// Trains the harness on two "machines" of this host and checks both ranks end equal, and equal
    /// to one plain process with the two ranks' batches together.
    fn two_machine_run(dir: &Path, config: &Path, launch_args: &[&str], tag: &str) {
        let out_dir = dir.join(tag);
        let harness = example_bin("harness");
        let mut args: Vec<String> = ["launch", "--cpu"]
            .iter()
            .chain(launch_args)
            .map(|s| s.to_string())
            .collect();
        args.push(harness.display().to_string());
        for a in ["opt=sgd", "steps=3", "batch=4", "n=32", "lr=0.05"] {
            args.push(a.into());
        }
        args.push(format!("out={}", out_dir.display()));
        let words: Vec<&str> = args.iter().map(String::as_str).collect();
        ok(&ivme(dir, config, &words));
        let (r0, r1) = (
            params(&out_dir.join("rank0.json")),
            params(&out_dir.join("rank1.json")),
        );
        assert_eq!(
            reference::max_diff(&r0, &r1),
            0.0,
            "{tag}: the two machines' ranks ended with different weights"
        );
        let order: Vec<usize> = (0..32).collect();
        let expected =
            reference::train::<candle_nn::SGD>(32, &reference::chunks(&order, 8, 3), 0.05);
        let diff = reference::max_diff(&r0, &expected);
        assert!(
            diff <= 1e-6,
            "{tag}: max abs diff from one plain process: {diff}"
        );
    }

    #[test]
    fn two_machines_on_localhost_train_in_step() {
        let dir = scratch("two-machines");
        let hostfile = dir.join("hosts");
        std::fs::write(&hostfile, "localhost slots=1\n127.0.0.1 slots=1\n").unwrap();
        let none = dir.join("none.toml");
        // An empty config: every setting comes from the flags.
        std::fs::write(&none, "version = 1\n").unwrap();
        two_machine_run(
            &dir,
            &none,
            &["--hostfile", hostfile.to_str().unwrap()],
            "hostfile",
        );

        // The same two machines from the config's address list, no hostfile.
        let cfg = dir.join("machines.toml");
        std::fs::write(&cfg, "version = 1\nnum_processes = 2\nnum_machines = 2\nhosts = [\"localhost\", \"127.0.0.1\"]\n").unwrap();
        let report = ok(&ivme(&dir, &cfg, &["launch", "--dry_run", "sh"]));
        let command = report.lines().last().unwrap();
        assert!(
            command.contains("--host localhost:1,127.0.0.1:1 -np 2"),
            "{report}"
        );
        assert!(
            !command.contains("127.0.0.1/8"),
            "several machines must not be held to loopback: {command}"
        );
        assert!(
            report.lines().any(|l| l == "IVME_NUM_MACHINES=2"),
            "{report}"
        );
        two_machine_run(&dir, &cfg, &[], "config-hosts");

        // Any machine but the main one starts nothing and says where to launch.
        let marker = dir.join("ran");
        let script = format!("touch {}", marker.display());
        let stdout = ok(&ivme(
            &dir,
            &cfg,
            &["launch", "--machine_rank", "1", "sh", "-c", &script],
        ));
        assert!(
            stdout.contains("this is machine 1 of 2")
                && stdout.contains("main machine (localhost)"),
            "{stdout}"
        );
        assert!(!marker.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn machine_settings_that_cannot_work_are_refused() {
        let dir = scratch("machines-bad");
        let none = dir.join("none.toml");
        // An empty config: every setting comes from the flags.
        std::fs::write(&none, "version = 1\n").unwrap();
        let msg = refused(&ivme(&dir, &none, &["launch", "--num_machines", "2", "sh"]));
        assert!(
            msg.contains("2 machines need their addresses") && msg.contains("--hostfile"),
            "{msg}"
        );
        let cfg = dir.join("m.toml");
        std::fs::write(
            &cfg,
            "version = 1\nnum_machines = 2\nhosts = [\"a\", \"b\"]\n",
        )
        .unwrap();
        let msg = refused(&ivme(&dir, &cfg, &["launch", "--num_processes", "3", "sh"]));
        assert!(msg.contains("multiple of 2"), "{msg}");
        let msg = refused(&ivme(&dir, &cfg, &["launch", "--machine_rank", "2", "sh"]));
        assert!(
            msg.contains("machine_rank 2 does not exist") && msg.contains("from 0 to 1"),
            "{msg}"
        );
        let msg = refused(&ivme(
            &dir,
            &cfg,
            &["launch", "--main_process_ip", "b", "sh"],
        ));
        assert!(
            msg.contains("first machine of the config's `hosts` is a"),
            "{msg}"
        );
        let hostfile = dir.join("hosts");
        std::fs::write(&hostfile, "a slots=1\nb slots=1\n").unwrap();
        let h = hostfile.to_str().unwrap();
        let msg = refused(&ivme(
            &dir,
            &none,
            &["launch", "--hostfile", h, "--num_processes", "3", "sh"],
        ));
        assert!(msg.contains("3 processes do not fit the 2 slots"), "{msg}");
        std::fs::write(&hostfile, "a slots=1 max_slots=2\n").unwrap();
        let msg = refused(&ivme(&dir, &none, &["launch", "--hostfile", h, "sh"]));
        assert!(
            msg.contains("line 1: `max_slots=2` is not understood"),
            "{msg}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The launcher contract's variables are read by the library as the launcher writes them: an
/// on/off value it cannot read is an error naming it (not a silent "off"), and a deadline may
/// carry a unit, as `--collective_timeout` does.
#[test]
fn a_program_reads_the_contract_variables_as_the_launcher_writes_them() {
    let whoami = common::example_bin("whoami");
    let run = |vars: &[(&str, &str)]| {
        std::process::Command::new(&whoami)
            .envs(vars.iter().copied())
            .output()
            .unwrap()
    };
    let e = common::refused(&run(&[("IVME_CPU", "maybe")]));
    assert!(e.contains("IVME_CPU") && e.contains("1 or 0"), "{e}");
    common::ok(&run(&[("IVME_CPU", "yes")]));
    common::ok(&run(&[
        ("IVME_CPU", "1"),
        ("IVME_COLLECTIVE_TIMEOUT", "10m"),
    ]));
    let e = common::refused(&run(&[("IVME_COLLECTIVE_TIMEOUT", "soon")]));
    assert!(
        e.contains("IVME_COLLECTIVE_TIMEOUT") && e.contains("10m"),
        "{e}"
    );
}
