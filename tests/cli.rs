//! The `ivme` command beyond a plain launch, on real processes: the config questionnaire fed by
//! piped answers, `config default` / `config show`, bad config files, launching from a config
//! file, where each setting came from, `ivme env` and `ivme test`. The multi-machine runs are in
//! `launcher.rs`.
//!
//! Needs `cargo build --workspace --bins --examples` first, and Open MPI for the multi-process
//! cases. Every test uses its own config path; none touches the real home folder.

mod common;

use common::{example_bin, ivme_bin, ok, refused, text};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// A scratch folder unique to this test process and `tag`.
fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ivme-cli-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `ivme args...` with `config` as its config file (through IVME_CONFIG), a home folder of
/// its own, and `stdin` piped in.
fn ivme_in(dir: &Path, config: &Path, args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(ivme_bin())
        .args(args)
        .env("IVME_CONFIG", config)
        .env("HOME", dir)
        .env_remove("XDG_CONFIG_HOME")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the ivme binary starts");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().expect("ivme ends")
}

/// Runs `ivme args...` with `config` as its config file and nothing on stdin.
fn ivme(dir: &Path, config: &Path, args: &[&str]) -> Output {
    ivme_in(dir, config, args, "")
}

/// The `key = value` lines of a config file, comments dropped.
fn settings(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_questionnaire_writes_the_answers_given() {
    let dir = scratch("wizard");
    let cfg = dir.join("nested/ivme.toml");
    // this machine, 2 processes, CPU only, bf16, 4 micro-batches per step, ZeRO stage 1
    let out = ivme_in(&dir, &cfg, &["config"], "1\n2\nyes\nbf16\n4\noptimizer\n");
    let stdout = ok(&out);
    assert!(
        stdout.contains(&format!("wrote {}", cfg.display())),
        "{stdout}"
    );
    assert_eq!(
        settings(&cfg),
        [
            "version = 1",
            "num_processes = 2",
            "cpu = true",
            "mixed_precision = \"bf16\"",
            "sharding = \"optimizer\"",
            "gradient_accumulation_steps = 4",
            "backend = \"mpi\"",
            "num_machines = 1",
        ]
    );
    let shown = ok(&ivme(&dir, &cfg, &["config", "show"]));
    assert!(
        shown.contains(&format!(
            "# ivme config: {} (from IVME_CONFIG)",
            cfg.display()
        )),
        "{shown}"
    );
    assert!(shown.contains("mixed_precision = \"bf16\""), "{shown}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_questionnaire_asks_for_several_machines() {
    let dir = scratch("wizard-machines");
    let cfg = dir.join("ivme.toml");
    // several machines, no hostfile, 2 machines, this is rank 1, main at 10.0.0.1, default
    // port, the other machine, 3 processes (refused: not a multiple of 2), then 4, defaults.
    let answers = "2\n\n2\n1\n10.0.0.1\n\n10.0.0.2\n3\n4\nno\nno\n1\nno\n";
    let out = ivme_in(
        &dir,
        &cfg,
        &["config", "--config_file", cfg.to_str().unwrap()],
        answers,
    );
    let stdout = ok(&out);
    assert!(
        stdout.contains("3 cannot be shared evenly by 2 machines"),
        "{stdout}"
    );
    let got = settings(&cfg);
    for line in [
        "num_processes = 4",
        "cpu = false",
        "num_machines = 2",
        "machine_rank = 1",
        "main_process_ip = \"10.0.0.1\"",
        "main_process_port = 29500",
        "hosts = [\"10.0.0.1\", \"10.0.0.2\"]",
    ] {
        assert!(
            got.contains(&line.to_string()),
            "missing `{line}` in {got:?}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_answers_are_asked_again_and_running_out_is_an_error() {
    let dir = scratch("wizard-bad");
    let cfg = dir.join("ivme.toml");
    let out = ivme_in(&dir, &cfg, &["config"], "1\n0\ntwo\n2\nyes\nfp8\nbf16\n");
    let (stdout, _) = text(&out);
    let stderr = refused(&out);
    assert!(
        stdout.contains("`0` is not a whole number of at least 1; try again"),
        "{stdout}"
    );
    assert!(stdout.contains("`two` is not a whole number"), "{stdout}");
    assert!(
        stdout.contains("`fp8` is not one of the choices: no, fp16, bf16"),
        "{stdout}"
    );
    // The answers stop before the accumulation question.
    assert!(
        stderr.contains("answers ended before the question `Gradient accumulation"),
        "{stderr}"
    );
    assert!(!cfg.exists(), "a half-answered questionnaire wrote a file");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn config_default_writes_a_sane_file_once() {
    let dir = scratch("default");
    let cfg = dir.join("a/b/default.toml");
    ok(&ivme(&dir, &cfg, &["config", "default"]));
    // The default computes on the CPU unless the binary was built with CUDA.
    let report = ok(&ivme(&dir, &cfg, &["env"]));
    let features = report
        .lines()
        .find(|l| l.starts_with("- features: "))
        .unwrap();
    let cuda_built = features
        .split("(not built")
        .next()
        .unwrap()
        .contains("cuda");
    let expected_cpu = format!("cpu = {}", !cuda_built);
    assert_eq!(
        settings(&cfg),
        [
            "version = 1",
            "num_processes = 1",
            expected_cpu.as_str(),
            "mixed_precision = \"no\"",
            "gradient_accumulation_steps = 1",
            "backend = \"mpi\"",
            "num_machines = 1",
        ]
    );
    let msg = refused(&ivme(&dir, &cfg, &["config", "default"]));
    assert!(
        msg.contains("already exists") && msg.contains("--force"),
        "{msg}"
    );
    ok(&ivme(&dir, &cfg, &["config", "default", "--force"]));
    let shown = ok(&ivme(&dir, &cfg, &["config", "show"]));
    assert!(
        shown.contains(&cfg.display().to_string()) && shown.contains("num_processes = 1"),
        "{shown}"
    );
    // Without IVME_CONFIG or a flag the default location is under the home folder.
    let out = Command::new(ivme_bin())
        .args(["config", "default"])
        .env_remove("IVME_CONFIG")
        .env("XDG_CONFIG_HOME", dir.join("xdg"))
        .output()
        .unwrap();
    ok(&out);
    assert!(dir.join("xdg/ivme/default_config.toml").is_file());
    let msg = refused(&ivme(&dir, &dir.join("missing.toml"), &["config", "show"]));
    assert!(
        msg.contains("missing.toml (from IVME_CONFIG) does not exist")
            && msg.contains("ivme config default --config_file"),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_config_files_are_refused_naming_the_key_and_the_file() {
    let dir = scratch("bad-files");
    let cases: &[(&str, &[&str])] = &[
        (
            "version = 1\nnum_procesess = 2\n",
            &[
                "unknown key `num_procesess`",
                "did you mean `num_processes`",
            ],
        ),
        (
            "version = 1\nmixed_precision = \"fp8\"\n",
            &["`mixed_precision` = \"fp8\"", "use one of no, fp16, bf16"],
        ),
        (
            "version = 1\nnum_processes = 0\n",
            &["`num_processes` = \"0\"", "at least 1"],
        ),
        (
            "version = 1\ncpu = \"yes\"\n",
            &["`cpu`", "use true or false"],
        ),
        (
            "version = 1\nbackend = \"gloo\"\n",
            &["`backend` = \"gloo\"", "use one of mpi"],
        ),
        ("version = 2\n", &["`version` = \"2\"", "reads version 1"]),
        ("num_processes = 2\n", &["has no `version`", "version = 1"]),
        ("version = 1\nnum_processes = \n", &["is not valid TOML"]),
    ];
    for (i, (body, wants)) in cases.iter().enumerate() {
        let cfg = dir.join(format!("bad{i}.toml"));
        std::fs::write(&cfg, body).unwrap();
        for args in [&["config", "show"][..], &["launch", "--dry_run", "sh"]] {
            let msg = refused(&ivme(&dir, &cfg, args));
            assert!(
                msg.contains(&cfg.display().to_string()),
                "{args:?} {body:?}: no file named in {msg}"
            );
            for want in *wants {
                assert!(
                    msg.contains(want),
                    "{args:?} {body:?}: `{want}` missing from {msg}"
                );
            }
        }
    }
    let msg = refused(&ivme(&dir, &dir.join("nope.toml"), &["launch", "sh"]));
    assert!(
        msg.contains("does not exist") && msg.contains("(from IVME_CONFIG)"),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn launch_with_only_a_config_file_runs_its_processes() {
    let dir = scratch("from-config");
    let cfg = dir.join("ivme.toml");
    std::fs::write(
        &cfg,
        "version = 1\nnum_processes = 2\ncpu = true\ngradient_accumulation_steps = 3\n",
    )
    .unwrap();
    let prog = example_bin("whoami");
    let mut cmd = Command::new(ivme_bin());
    cmd.args(["launch"])
        .arg(&prog)
        .env("IVME_CONFIG", &cfg)
        .env("WHOAMI_SHOW_ENV", "1");
    let stdout = ok(&cmd.output().unwrap());
    for line in [
        "rank 0 of 2",
        "rank 1 of 2",
        "rank 1: IVME_CPU=1",
        "rank 0: IVME_GRAD_ACCUM=3",
    ] {
        assert!(
            stdout.lines().any(|l| l.trim() == line),
            "missing `{line}` in\n{stdout}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The `# settings` line of a dry run for `key`.
fn setting_line<'a>(report: &'a str, key: &str) -> &'a str {
    report
        .lines()
        .find(|l| l.starts_with("#   ") && l[4..].split_whitespace().next() == Some(key))
        .unwrap_or_else(|| panic!("no setting `{key}` in\n{report}"))
}

#[test]
fn dry_run_shows_flags_overriding_the_file_and_each_source() {
    let dir = scratch("provenance");
    let cfg = dir.join("ivme.toml");
    std::fs::write(
        &cfg,
        "version = 1\nnum_processes = 2\nmixed_precision = \"fp16\"\ncpu = true\nmax_restarts = 2\n",
    )
    .unwrap();
    let c = cfg.to_str().unwrap();
    let out = Command::new(ivme_bin())
        .args([
            "launch",
            "--config_file",
            c,
            "--dry_run",
            "--mixed_precision",
            "bf16",
            "--debug_sync",
            "sh",
            "-c",
            "true",
        ])
        .env("IVME_GRAD_ACCUM", "5")
        .env("IVME_COLLECTIVE_TIMEOUT", "1.5m")
        .output()
        .unwrap();
    let report = ok(&out);
    let line = setting_line(&report, "mixed_precision");
    assert!(
        line.contains("bf16")
            && line.contains("(flag --mixed_precision; the config file's fp16 is overridden)"),
        "{line}"
    );
    let line = setting_line(&report, "num_processes");
    assert!(
        line.contains("= 2") && line.ends_with(&format!("(config file {c})")),
        "{line}"
    );
    let line = setting_line(&report, "gradient_accumulation_steps");
    assert!(
        line.contains("= 5") && line.ends_with("(environment IVME_GRAD_ACCUM)"),
        "{line}"
    );
    assert!(
        setting_line(&report, "machine_rank").ends_with("(default)"),
        "{report}"
    );
    let line = setting_line(&report, "max_restarts");
    assert!(
        line.contains("= 2") && line.ends_with(&format!("(config file {c})")),
        "{line}"
    );
    let line = setting_line(&report, "collective_timeout");
    assert!(
        line.contains("= 90s") && line.ends_with("(environment IVME_COLLECTIVE_TIMEOUT)"),
        "{line}"
    );
    let line = setting_line(&report, "debug_sync");
    assert!(
        line.contains("= true") && line.ends_with("(flag --debug_sync)"),
        "{line}"
    );
    assert!(
        report.contains(&format!("# config file: {c} (from --config_file)")),
        "{report}"
    );
    let lines: Vec<&str> = report.lines().collect();
    assert!(
        lines.contains(&"IVME_PRECISION=bf16") && lines.contains(&"IVME_CPU=1"),
        "{report}"
    );
    // The collective deadline reaches the ranks in seconds; each attempt is counted from 0.
    for var in [
        "IVME_COLLECTIVE_TIMEOUT=90",
        "IVME_DEBUG_SYNC=1",
        "IVME_RESTART_COUNT=0",
    ] {
        assert!(lines.contains(&var), "no {var} in\n{report}");
    }
    // One machine: the ranks use shared memory only, mpirun's channel advertises loopback.
    let command = lines.last().unwrap();
    assert!(
        command.contains("--mca btl self,")
            && command.contains("--mca oob_tcp_if_include 127.0.0.1/8"),
        "{command}"
    );
    assert!(!command.contains("btl_tcp"), "{command}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn env_reports_every_section() {
    let dir = scratch("env");
    let cfg = dir.join("ivme.toml");
    std::fs::write(&cfg, "version = 1\nnum_processes = 3\n").unwrap();
    let report = ok(&ivme(&dir, &cfg, &["env"]));
    for section in [
        "- ivme version: 0.1.0",
        "- candle version: 0.11.1",
        "- MPI: ",
        "- OS: ",
        "- CPUs: ",
        "- GPUs: ",
        "- features: ",
    ] {
        assert!(
            report.contains(section),
            "`{section}` missing from\n{report}"
        );
    }
    assert!(report.contains("- rustc version: rustc 1."), "{report}");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(report.contains(&format!("- CPUs: {cpus}\n")), "{report}");
    assert!(
        report.contains(&format!(
            "- config: {} (from IVME_CONFIG), valid:",
            cfg.display()
        )),
        "{report}"
    );
    assert!(report.contains("    num_processes = 3"), "{report}");
    let report = ok(&ivme(&dir, &dir.join("none.toml"), &["env"]));
    assert!(report.contains("- config: none (nothing at"), "{report}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn self_test_passes_on_one_and_two_processes() {
    let dir = scratch("selftest");
    let cfg = dir.join("ivme.toml");
    std::fs::write(
        &cfg,
        "version = 1\nnum_processes = 2\ncpu = true\ngradient_accumulation_steps = 2\n",
    )
    .unwrap();
    let stdout = ok(&ivme(&dir, &cfg, &["test"]));
    assert!(
        stdout.contains("ivme test: PASS: 2 process(es)")
            && stdout.contains("2 micro-batch(es) per step"),
        "{stdout}"
    );
    assert!(
        stdout.contains("save_state then load_state restored the weights exactly"),
        "{stdout}"
    );
    let stdout = ok(&ivme(&dir, &cfg, &["test", "--num_processes", "1"]));
    assert!(
        stdout.contains("ivme test: PASS: 1 process(es)"),
        "{stdout}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn self_test_says_what_failed() {
    let dir = scratch("selftest-fail");
    let cfg = dir.join("ivme.toml");
    std::fs::write(&cfg, "version = 1\nnum_processes = 2\ncpu = true\n").unwrap();
    let out = Command::new(ivme_bin())
        .args(["test", "--config_file", cfg.to_str().unwrap()])
        .env("IVME_SELFTEST_FAULT", "desync")
        .output()
        .unwrap();
    let (stdout, _) = text(&out);
    refused(&out);
    // Every rank detects the mismatch; which rank's line comes first is up to scheduling.
    assert!(
        stdout.contains("ivme test: FAIL: rank ")
            && stdout.contains(": gradient sync: rank 1's weights differ"),
        "{stdout}"
    );
    let out = Command::new(ivme_bin())
        .args(["test", "--config_file", cfg.to_str().unwrap()])
        .env("IVME_PRECISION", "fp8")
        .output()
        .unwrap();
    let (stdout, _) = text(&out);
    refused(&out);
    assert!(
        stdout.contains("ivme test: FAIL: could not launch the test")
            && stdout.contains("IVME_PRECISION"),
        "{stdout}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
