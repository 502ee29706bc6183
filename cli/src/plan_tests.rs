//! Flags → plan → command line and environment, checked without starting anything.

use super::*;
use crate::cli::Parsed;
use crate::mpirun::Flavor;
use crate::settings::Settings;
use ivme::Precision;
use std::time::Duration;

fn words(w: &[&str]) -> Vec<String> {
    w.iter().map(|s| s.to_string()).collect()
}

fn parse(w: &[&str]) -> LaunchArgs {
    match LaunchArgs::parse(&words(w)).unwrap() {
        Parsed::Args(a) => *a,
        Parsed::Help(_) => panic!("unexpected help for {w:?}"),
    }
}

fn plan(w: &[&str]) -> LaunchPlan {
    LaunchPlan::resolve(parse(w), std::env::var("PATH").ok().as_deref()).unwrap()
}

fn get<'a>(env: &'a [(String, String)], key: &str) -> Option<&'a str> {
    env.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

fn ctx(machine: Machine, flavor: Flavor) -> Context {
    Context {
        machine,
        inherited: vec![],
        mpirun: Some(Mpirun {
            path: "/usr/bin/mpirun".into(),
            flavor,
            major: Some(4),
        }),
        ivme_exe: "/opt/ivme".into(),
        status_dir: "/tmp/st".into(),
        restart: 0,
    }
}

const TWO_CORES_ROOT: Machine = Machine {
    cores: 2,
    slots: 2,
    root: true,
};

#[test]
fn every_flag_is_read_in_either_spelling() {
    let a = parse(&[
        "--num-processes=3",
        "--cpu",
        "--mixed_precision",
        "bf16",
        "--gradient-accumulation-steps",
        "4",
        "--dry_run",
        "train",
        "--lr",
        "0.1",
    ]);
    assert_eq!(
        a,
        LaunchArgs {
            settings: Settings {
                num_processes: Some(3),
                cpu: Some(true),
                hostfile: None,
                mixed_precision: Some(Precision::Bf16),
                gradient_accumulation_steps: Some(4),
                ..Settings::default()
            },
            dry_run: true,
            program: Some("train".into()),
            program_args: words(&["--lr", "0.1"]),
            ..LaunchArgs::default()
        }
    );
    assert!(matches!(
        LaunchArgs::parse(&words(&["--help"])).unwrap(),
        Parsed::Help(text) if text.contains("--num_processes <count>")
    ));
}

#[test]
fn bad_values_name_the_flag_and_the_fix() {
    let msg = |w: &[&str]| LaunchArgs::parse(&words(w)).unwrap_err().to_string();
    let m = msg(&["--num_processes", "0", "prog"]);
    assert!(
        m.contains("--num_processes 0") && m.contains("at least 1"),
        "{m}"
    );
    let m = msg(&["--mixed_precision", "fp8", "prog"]);
    assert!(m.contains("use one of no, fp16, bf16"), "{m}");
    let m = msg(&["--gradient_accumulation_steps", "0", "prog"]);
    assert!(m.contains("at least 1"), "{m}");
}

#[test]
fn a_plan_needs_a_program_that_exists() {
    let m = LaunchPlan::resolve(parse(&["--cpu"]), None)
        .unwrap_err()
        .to_string();
    assert!(
        m.contains("missing the program") && m.contains("ivme launch"),
        "{m}"
    );
    let m = LaunchPlan::resolve(parse(&["./no-such-prog"]), None)
        .unwrap_err()
        .to_string();
    assert!(m.contains("does not exist"), "{m}");
    let m = LaunchPlan::resolve(parse(&["--hostfile", "/no/such/hosts", "sh"]), None)
        .unwrap_err()
        .to_string();
    assert!(m.contains("cannot read the hostfile /no/such/hosts"), "{m}");
}

#[test]
fn defaults_run_one_process_directly() {
    let p = plan(&["sh", "-c", "true"]);
    assert_eq!(p.num_processes, 1);
    let s = &p.settings;
    assert!(s.cpu.is_none() && !p.dry_run && s.mixed_precision.is_none());
    assert!(s.gradient_accumulation_steps.is_none());
    assert!(p.program.is_absolute() && p.program.ends_with("sh"));
    assert!(!p.uses_mpi());
    let inv = p.invocation(&ctx(TWO_CORES_ROOT, Flavor::OpenMpi)).unwrap();
    assert_eq!(
        inv.argv,
        vec![p.program.display().to_string(), "-c".into(), "true".into()]
    );
    assert_eq!(inv.status_dir, None);
}

#[test]
fn hostfiles_count_distinct_machines() {
    let path = std::env::temp_dir().join(format!("ivme-hosts-{}", std::process::id()));
    std::fs::write(
        &path,
        "# cluster\nnode1 slots=2\n\nnode2 slots=2 # second\nnode1\n",
    )
    .unwrap();
    let p = plan(&[
        "--hostfile",
        path.to_str().unwrap(),
        "--num_processes",
        "5",
        "sh",
    ]);
    std::fs::write(&path, "# nothing\n\n").unwrap();
    let empty = crate::hosts::Hosts::read(&path).unwrap_err().to_string();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(p.hosts.as_ref().unwrap().machines.len(), 2);
    assert_eq!(p.num_machines, 2);
    assert!(p.uses_mpi());
    // 5 ranks over 2 machines: the fuller machine holds 3.
    assert_eq!(p.processes_per_machine(), 3);
    assert!(empty.contains("names no machines"), "{empty}");
}

#[test]
fn environment_carries_the_settings_given() {
    let p = plan(&[
        "--num_processes",
        "3",
        "--cpu",
        "--mixed_precision",
        "fp16",
        "sh",
    ]);
    let machine = Machine {
        cores: 8,
        slots: 4,
        root: false,
    };
    let env = p.env(&machine, 0, &[]);
    assert_eq!(get(&env, "IVME_NUM_PROCESSES"), Some("3"));
    assert_eq!(get(&env, "IVME_CPU"), Some("1"));
    assert_eq!(get(&env, "IVME_PRECISION"), Some("fp16"));
    assert_eq!(get(&env, "IVME_LAUNCHER"), Some("ivme"));
    assert_eq!(get(&env, "IVME_GRAD_ACCUM"), None);
    // 8 cores shared by 3 ranks: 2 threads each, never more than the cores.
    assert_eq!(get(&env, "RAYON_NUM_THREADS"), Some("2"));

    let p = plan(&["--gradient_accumulation_steps", "4", "sh"]);
    let env = p.env(&machine, 0, &[]);
    assert_eq!(get(&env, "IVME_GRAD_ACCUM"), Some("4"));
    assert_eq!(get(&env, "IVME_CPU"), None);
    assert_eq!(get(&env, "IVME_PRECISION"), None);
    assert_eq!(get(&env, "IVME_SHARDING"), None);
    assert_eq!(get(&env, "RAYON_NUM_THREADS"), Some("8"));
}

#[test]
fn the_sharding_stage_reaches_the_ranks_and_bad_stages_are_refused() {
    let stages = [
        ("2", "gradients"),
        ("optimizer", "optimizer"),
        ("no", "no"),
        ("3", "parameters"),
        ("parameters", "parameters"),
    ];
    for (word, passed) in stages {
        let p = plan(&["--sharding", word, "sh"]);
        let env = p.env(&TWO_CORES_ROOT, 0, &[]);
        assert_eq!(get(&env, "IVME_SHARDING"), Some(passed));
    }
    let m = LaunchArgs::parse(&words(&["--sharding", "4", "prog"]))
        .unwrap_err()
        .to_string();
    assert!(
        m.contains("`--sharding 4` is not a sharding stage") && m.contains("parameters"),
        "{m}"
    );
}

#[test]
fn overlap_keeps_a_core_of_each_share_for_the_sync_thread() {
    let machine = Machine {
        cores: 8,
        slots: 8,
        root: false,
    };
    let env = plan(&["--num_processes", "2", "--overlap", "sh"]).env(&machine, 0, &[]);
    assert_eq!(get(&env, "RAYON_NUM_THREADS"), Some("3"));
    assert_eq!(get(&env, "IVME_OVERLAP"), Some("1"));
    // One core a process: nothing to keep (the ranks warn).
    let env = plan(&["--num_processes", "2", "--overlap", "sh"]).env(&TWO_CORES_ROOT, 0, &[]);
    assert_eq!(get(&env, "RAYON_NUM_THREADS"), Some("1"));
}

#[test]
fn more_ranks_than_cores_still_get_one_thread() {
    let p = plan(&["--num_processes", "5", "sh"]);
    let env = p.env(&TWO_CORES_ROOT, 0, &[]);
    assert_eq!(get(&env, "RAYON_NUM_THREADS"), Some("1"));
}

#[test]
fn the_users_own_variables_are_kept_and_flags_win() {
    let p = plan(&["--num_processes", "2", "--mixed_precision", "bf16", "sh"]);
    let inherited = vec![
        ("RAYON_NUM_THREADS".to_string(), "7".to_string()),
        ("IVME_PRECISION".to_string(), "fp16".to_string()),
        ("IVME_LOG".to_string(), "debug".to_string()),
        ("IVME_MPIRUN".to_string(), "/opt/mpirun".to_string()),
        ("HOME".to_string(), "/root".to_string()),
    ];
    let env = p.env(&TWO_CORES_ROOT, 0, &inherited);
    assert_eq!(get(&env, "RAYON_NUM_THREADS"), Some("7"));
    assert_eq!(get(&env, "IVME_PRECISION"), Some("bf16"));
    assert_eq!(get(&env, "IVME_LOG"), Some("debug"));
    assert_eq!(get(&env, "IVME_MPIRUN"), None);
    assert_eq!(get(&env, "HOME"), None);
    let keys: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
    let mut unique = keys.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), keys.len(), "{keys:?}");
}

#[test]
#[cfg(target_os = "linux")] // the allocator settings are for glibc
fn open_mpi_ranks_run_under_the_wrapper_with_every_variable_forwarded() {
    let p = plan(&["--num_processes", "4", "--cpu", "sh", "-c", "echo hi"]);
    let inv = p.invocation(&ctx(TWO_CORES_ROOT, Flavor::OpenMpi)).unwrap();
    let sh = p.program.display().to_string();
    let expect = [
        "/usr/bin/mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
        "--mca",
        "pml",
        "ob1",
        "--mca",
        "btl",
        "self,vader",
        "--mca",
        "oob_tcp_if_include",
        "127.0.0.1/8",
        "-np",
        "4",
        "-x",
        "IVME_LAUNCHER",
        "-x",
        "IVME_NUM_PROCESSES",
        "-x",
        "IVME_RESTART_COUNT",
        "-x",
        "IVME_CPU",
        "-x",
        "RAYON_NUM_THREADS",
        "-x",
        "MALLOC_MMAP_THRESHOLD_",
        "-x",
        "MALLOC_TRIM_THRESHOLD_",
        "-x",
        "CANDLE_BARRIER_POOL_SPIN_LIMIT",
        "/opt/ivme",
        "__rank",
        "--status-dir",
        "/tmp/st",
        "--",
        &sh,
        "-c",
        "echo hi",
    ];
    assert_eq!(inv.argv, expect);
    assert_eq!(inv.status_dir, Some(PathBuf::from("/tmp/st")));
}

#[test]
fn oversubscribe_and_root_flags_only_when_needed() {
    let p = plan(&["--num_processes", "2", "sh"]);
    let machine = Machine {
        cores: 4,
        slots: 2,
        root: false,
    };
    let line = p
        .invocation(&ctx(machine, Flavor::OpenMpi))
        .unwrap()
        .argv
        .join(" ");
    assert!(
        !line.contains("--oversubscribe") && !line.contains("root"),
        "{line}"
    );
    let p = plan(&["--num_processes", "3", "sh"]);
    let machine = Machine {
        cores: 4,
        slots: 2,
        root: false,
    };
    let line = p
        .invocation(&ctx(machine, Flavor::OpenMpi))
        .unwrap()
        .argv
        .join(" ");
    assert!(line.contains("--oversubscribe"), "{line}");
}

#[test]
fn mpich_gets_values_instead_of_open_mpi_flags() {
    let p = plan(&["--num_processes", "4", "sh"]);
    let line = p
        .invocation(&ctx(TWO_CORES_ROOT, Flavor::Mpich))
        .unwrap()
        .argv
        .join(" ");
    assert!(line.contains("-genv IVME_NUM_PROCESSES 4"), "{line}");
    assert!(
        !line.contains("--allow-run-as-root") && !line.contains("-x "),
        "{line}"
    );
}

#[test]
fn dry_run_report_shows_the_variables_and_one_quoted_command_line() {
    let p = plan(&[
        "--num_processes",
        "2",
        "--dry_run",
        "sh",
        "-c",
        "echo 'a b'",
    ]);
    let inv = p.invocation(&ctx(TWO_CORES_ROOT, Flavor::OpenMpi)).unwrap();
    let text = inv.describe(p.num_processes);
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].contains("2 processes through Open MPI; nothing was started"),
        "{text}"
    );
    assert!(lines.contains(&"IVME_NUM_PROCESSES=2"), "{text}");
    assert!(lines.contains(&"RAYON_NUM_THREADS=1"), "{text}");
    let command = lines.last().unwrap();
    assert!(
        command.starts_with("/usr/bin/mpirun --allow-run-as-root"),
        "{text}"
    );
    assert!(command.ends_with(r#"-c 'echo '\''a b'\'''"#), "{text}");
}

#[test]
fn fault_flags_are_read_in_either_spelling() {
    let a = parse(&[
        "--max-restarts",
        "3",
        "--collective-timeout=10m",
        "--debug-sync",
        "train",
    ]);
    assert_eq!(a.settings.max_restarts, Some(3));
    assert_eq!(
        a.settings.collective_timeout,
        Some(Duration::from_secs(600))
    );
    assert_eq!(a.settings.debug_sync, Some(true));
    let a = parse(&[
        "--max_restarts",
        "0",
        "--collective_timeout",
        "500ms",
        "train",
    ]);
    assert_eq!(a.settings.max_restarts, Some(0));
    assert_eq!(
        a.settings.collective_timeout,
        Some(Duration::from_millis(500))
    );
    assert_eq!(a.settings.debug_sync, None);
    let msg = |w: &[&str]| LaunchArgs::parse(&words(w)).unwrap_err().to_string();
    let m = msg(&["--collective_timeout", "-3s", "prog"]);
    assert!(
        m.contains("`--collective_timeout -3s` is not a duration") && m.contains("1h"),
        "{m}"
    );
    let m = msg(&["--max_restarts", "many", "prog"]);
    assert!(
        m.contains("`--max_restarts many` is not a whole number"),
        "{m}"
    );
    let m = msg(&["--max_restarts", "prog"]);
    assert!(m.contains("--max_restarts"), "{m}");
}

#[test]
fn fault_settings_reach_every_rank_and_each_attempt_is_counted() {
    let p = plan(&[
        "--num_processes",
        "2",
        "--max_restarts",
        "2",
        "--collective_timeout",
        "1.5",
        "--debug_sync",
        "sh",
    ]);
    assert_eq!(p.max_restarts, 2);
    let env = p.env(&TWO_CORES_ROOT, 0, &[]);
    assert_eq!(get(&env, "IVME_COLLECTIVE_TIMEOUT"), Some("1.5"));
    assert_eq!(get(&env, "IVME_DEBUG_SYNC"), Some("1"));
    assert_eq!(get(&env, "IVME_RESTART_COUNT"), Some("0"));
    // The launcher's own count wins over one inherited from an outer launch.
    let inherited = vec![("IVME_RESTART_COUNT".to_string(), "7".to_string())];
    let env = p.env(&TWO_CORES_ROOT, 2, &inherited);
    assert_eq!(get(&env, "IVME_RESTART_COUNT"), Some("2"));
    let mut c = ctx(TWO_CORES_ROOT, Flavor::OpenMpi);
    c.restart = 1;
    let inv = p.invocation(&c).unwrap();
    assert_eq!(get(&inv.env, "IVME_RESTART_COUNT"), Some("1"));
    let line = inv.argv.join(" ");
    for var in [
        "IVME_RESTART_COUNT",
        "IVME_COLLECTIVE_TIMEOUT",
        "IVME_DEBUG_SYNC",
    ] {
        assert!(line.contains(&format!("-x {var}")), "{line}");
    }
    let text = inv.describe(p.num_processes);
    assert!(text.contains("\nIVME_COLLECTIVE_TIMEOUT=1.5\n"), "{text}");

    let p = plan(&["sh"]);
    assert_eq!(p.max_restarts, 0);
    let env = p.env(&TWO_CORES_ROOT, 0, &[]);
    assert_eq!(get(&env, "IVME_COLLECTIVE_TIMEOUT"), None);
    assert_eq!(get(&env, "IVME_DEBUG_SYNC"), None);
    // A single process, run directly, is counted too.
    assert_eq!(get(&env, "IVME_RESTART_COUNT"), Some("0"));
}

#[test]
fn preemption_flags_reach_the_ranks_and_the_launchers_exit_code() {
    let p = plan(&[
        "--num_processes",
        "2",
        "--preempt-signals",
        "USR2,TERM",
        "--preempt_grace",
        "90s",
        "--requeue_exit_code",
        "99",
        "sh",
    ]);
    assert_eq!(p.settings.preempt_signals.as_deref(), Some("USR2,TERM"));
    assert_eq!(p.settings.preempt_grace, Some(Duration::from_secs(90)));
    assert_eq!(p.requeue_exit_code, 99);
    let env = p.env(&TWO_CORES_ROOT, 0, &[]);
    assert_eq!(get(&env, "IVME_PREEMPT_SIGNALS"), Some("USR2,TERM"));
    assert_eq!(get(&env, "IVME_PREEMPT_GRACE"), Some("90"));
    // The exit code is the launcher's own: the ranks are not told.
    assert_eq!(get(&env, "IVME_REQUEUE_EXIT_CODE"), None);
    let p = plan(&["sh"]);
    assert_eq!(
        (p.settings.preempt_signals.as_deref(), p.requeue_exit_code),
        (None, 75)
    );
    let msg = |w: &[&str]| LaunchArgs::parse(&words(w)).unwrap_err().to_string();
    let m = msg(&["--preempt_signals", "TERM,KILL", "prog"]);
    assert!(
        m.contains("is not a list of signals") && m.contains("none"),
        "{m}"
    );
    let m = msg(&["--requeue_exit_code", "0", "prog"]);
    assert!(
        m.contains("`--requeue_exit_code 0` is not an exit code"),
        "{m}"
    );
    let m = msg(&["--preempt_grace", "soon", "prog"]);
    assert!(m.contains("is not a duration"), "{m}");
}

#[test]
fn snapshots_are_set_by_a_flag_the_environment_or_the_config_file_and_reach_the_ranks() {
    // The one row of `snapshot_every` gives the flag, the variable, the file key and the
    // ranks' variable.
    let p = plan(&["--snapshot_every", "5", "sh"]);
    let env = p.env(&TWO_CORES_ROOT, 0, &[]);
    assert_eq!(get(&env, "IVME_SNAPSHOT_EVERY"), Some("5"));
    let file = Settings::parse("version = 1\nsnapshot_every = 3\n", "/c.toml".as_ref()).unwrap();
    assert_eq!(file.snapshot_every, Some(3));
    let from_file = LaunchPlan::resolve_with(
        parse(&["sh"]),
        Some(("/c.toml".as_ref(), &file)),
        &[],
        Some("/bin:/usr/bin"),
    )
    .unwrap();
    assert_eq!(
        get(
            &from_file.env(&TWO_CORES_ROOT, 0, &[]),
            "IVME_SNAPSHOT_EVERY"
        ),
        Some("3")
    );
    let origin = |p: &LaunchPlan| {
        let o = p.origins.iter().find(|o| o.key == "snapshot_every");
        o.unwrap().describe()
    };
    assert_eq!(origin(&from_file), "config file /c.toml");
    let inherited = vec![("IVME_SNAPSHOT_EVERY".to_string(), "7".to_string())];
    let from_env = LaunchPlan::resolve_with(
        parse(&["sh"]),
        Some(("/c.toml".as_ref(), &file)),
        &inherited,
        Some("/bin:/usr/bin"),
    )
    .unwrap();
    assert_eq!(from_env.settings.snapshot_every, Some(7));
    assert_eq!(
        origin(&from_env),
        "environment IVME_SNAPSHOT_EVERY; the config file's 3 is overridden"
    );
    let bad = vec![("IVME_SNAPSHOT_EVERY".to_string(), "often".to_string())];
    let e = LaunchPlan::resolve_with(parse(&["sh"]), None, &bad, Some("/bin:/usr/bin"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("IVME_SNAPSHOT_EVERY") && e.contains("often"),
        "{e}"
    );
    let e = LaunchArgs::parse(&words(&["--snapshot-every", "-2", "sh"]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`--snapshot_every -2` is not a whole number of steps"),
        "{e}"
    );
}
