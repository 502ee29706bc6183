//! Fault tolerance of `ivme launch` with real processes: a job killed mid-run and relaunched by
//! `--max_restarts` ends exactly like one that never stopped; restarts stop when they are used
//! up, and never follow a stop the user asked for; and a one-machine job keeps its listening
//! sockets on loopback.
//!
//! Needs `cargo build --workspace --bins --examples` first (the `ivme` binary and the
//! `restartable` example), Open MPI's `mpirun`, and `ss` (iproute2) for the socket check. Every
//! job runs under a time limit: on overrun its whole process group is killed and reaped.

mod common;

use common::job::{report, restartable, uninterrupted_then_crashed, weight_bits, words, Job};
use common::Scratch;
use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn a_run_killed_mid_way_and_restarted_ends_bit_for_bit_like_an_uninterrupted_one() {
    let dir = Scratch::new("restart-exact");
    let (a_project, a_out) = (dir.0.join("a-project"), dir.0.join("a-out"));
    let a = restartable(&[], &a_project, &a_out, &[], &[]).wait();
    assert!(
        a.status.success(),
        "the uninterrupted run failed\n{}",
        a.show()
    );
    assert!(!a.stderr.contains("restart"), "{}", a.show());

    // 48 samples, 2 ranks, batches of 4: 6 steps an epoch, 18 in all; saved every 4 steps, so
    // rank 1 dies at step 10 with checkpoints of steps 4 and 8 committed.
    let (b_project, b_out) = (dir.0.join("b-project"), dir.0.join("b-out"));
    let b = restartable(
        &["--max_restarts", "1"],
        &b_project,
        &b_out,
        &[],
        &[("IVME_TEST_DIE_AT", "10")],
    )
    .wait();
    assert!(b.status.success(), "the restarted run failed\n{}", b.show());
    assert!(
        b.stderr.contains(
            "ivme: restart 1 of 1 after rank 1 failed with exit code 137 (killed by signal 9)"
        ),
        "no restart line\n{}",
        b.show()
    );
    assert!(
        b.stdout
            .contains("restartable: rank 1, attempt 0: starting afresh")
            && b.stdout
                .contains("restartable: rank 1, attempt 1: resumed from")
            && b.stdout.contains("at step 8"),
        "the second attempt did not resume from the step-8 checkpoint\n{}",
        b.show()
    );

    let (a, b) = (report(&a_out), report(&b_out));
    assert_eq!(
        (a["restart_count"].as_u64(), a["start_step"].as_u64()),
        (Some(0), Some(0))
    );
    // Starting over would give the same weights too: the report says it really resumed.
    assert_eq!(
        (b["restart_count"].as_u64(), b["start_step"].as_u64()),
        (Some(1), Some(8)),
        "{b}"
    );
    assert_eq!(
        (a["steps"].as_u64(), b["steps"].as_u64()),
        (Some(18), Some(18))
    );
    assert_eq!(
        weight_bits(&a),
        weight_bits(&b),
        "the restarted run ended with different weights"
    );
}

#[test]
fn a_checkpoint_that_does_not_fit_the_program_is_not_restarted_over_and_over() {
    let dir = Scratch::new("restart-unfit");
    let (project, out) = (dir.0.join("project"), dir.0.join("out"));
    let first = restartable(&[], &project, &out, &["epochs=1"], &[]).wait();
    assert!(first.status.success(), "{}", first.show());
    // The program changed (another output width): its checkpoints no longer fit it.
    let changed = restartable(
        &["--max_restarts", "2"],
        &project,
        &out,
        &["epochs=2"],
        &[("IVME_TEST_OUT_FEATURES", "3")],
    )
    .wait();
    assert!(!changed.status.success(), "{}", changed.show());
    assert!(
        changed.stderr.contains("ivme: not restarting: rank ")
            && changed.stderr.contains("a restart would fail the same way"),
        "no reason given for not restarting\n{}",
        changed.show()
    );
    assert!(
        !changed.stderr.contains("restart 1 of 2"),
        "a failure that recurs was restarted\n{}",
        changed.show()
    );
}

/// The lines `program` appended to `log`, sorted.
fn logged(log: &Path) -> Vec<String> {
    let mut lines: Vec<String> = std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect();
    lines.sort();
    lines
}

#[test]
fn a_job_that_always_fails_runs_once_per_allowed_restart_then_gives_up() {
    let dir = Scratch::new("restart-exhausted");
    let log = dir.0.join("attempts");
    // Every rank notes its attempt, gives the others time to do the same, and fails.
    let script = format!(
        "echo \"$IVME_RESTART_COUNT\" >> {}; sleep 0.5; exit 3",
        log.display()
    );
    let job = Job::start(
        &words(&[
            "--num_processes",
            "2",
            "--max_restarts",
            "2",
            "sh",
            "-c",
            &script,
        ]),
        &[],
    );
    let end = job.wait();
    assert_eq!(end.status.code(), Some(3), "{}", end.show());
    assert_eq!(
        logged(&log),
        ["0", "0", "1", "1", "2", "2"],
        "{}",
        end.show()
    );
    for n in [1, 2] {
        let line = format!("ivme: restart {n} of 2 after rank ");
        assert!(end.stderr.contains(&line), "no `{line}`\n{}", end.show());
    }
    assert!(!end.stderr.contains("restart 3 of"), "{}", end.show());
    assert!(
        end.stderr.contains("restarts exhausted") && end.stderr.contains("failed 3 times"),
        "{}",
        end.show()
    );

    // One process, run without mpirun, is restarted the same way.
    let log = dir.0.join("single");
    let script = format!("echo \"$IVME_RESTART_COUNT\" >> {}; exit 4", log.display());
    let end = Job::start(&words(&["--max-restarts=2", "sh", "-c", &script]), &[]).wait();
    assert_eq!(end.status.code(), Some(4), "{}", end.show());
    assert_eq!(logged(&log), ["0", "1", "2"], "{}", end.show());
    assert!(
        end.stderr
            .contains("ivme: restart 2 of 2 after the program failed with exit code 4"),
        "{}",
        end.show()
    );
}

#[test]
fn a_stop_asked_for_or_a_usage_error_is_never_restarted() {
    let dir = Scratch::new("restart-stop");
    let log = dir.0.join("started");
    let script = format!("echo started >> {}; exec sleep 60", log.display());
    let job = Job::start(
        &words(&[
            "--num_processes",
            "2",
            "--max_restarts",
            "3",
            "sh",
            "-c",
            &script,
        ]),
        // SIGTERM is a stop here, not a preemption (tests/preempt.rs).
        &[("IVME_PREEMPT_SIGNALS", "none")],
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while logged(&log).len() < 2 {
        assert!(Instant::now() < deadline, "the ranks never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = job.pid().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let end = job.wait();
    assert_eq!(end.status.code(), Some(143), "{}", end.show());
    assert!(!end.stderr.contains("ivme: restart"), "{}", end.show());
    assert_eq!(
        logged(&log).len(),
        2,
        "a rank started again\n{}",
        end.show()
    );

    // The launcher's own usage errors end it before anything runs.
    let marker = dir.0.join("ran");
    let touch = format!("touch {}", marker.display());
    for bad in [
        &[
            "--max_restarts",
            "2",
            "--collective_timeout",
            "0",
            "sh",
            "-c",
            &touch,
        ][..],
        &["--max_restarts", "2", "--collective_timeout", "soon", "sh"],
        &["--max_restarts", "-1", "sh", "-c", &touch],
        &["--max_restarts", "2", "./no/such/program"],
    ] {
        let end = Job::start(&words(bad), &[]).wait();
        assert_eq!(end.status.code(), Some(2), "{bad:?}\n{}", end.show());
        assert!(
            end.stderr.contains("ivme: error:") && !end.stderr.contains("restart "),
            "{bad:?}\n{}",
            end.show()
        );
    }
    assert!(!marker.exists(), "a refused launch ran the program");
}

/// Every process whose parent chain leads to `root`, `root` included.
fn descendants(root: u32) -> BTreeSet<u32> {
    let mut parent: HashMap<u32, u32> = HashMap::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
        let after = &stat[stat.rfind(')').map_or(0, |i| i + 1)..];
        if let Some(ppid) = after.split_whitespace().nth(1).and_then(|p| p.parse().ok()) {
            parent.insert(pid, ppid);
        }
    }
    let mut found = BTreeSet::from([root]);
    loop {
        let more: Vec<u32> = parent
            .iter()
            .filter(|(pid, ppid)| found.contains(ppid) && !found.contains(pid))
            .map(|(pid, _)| *pid)
            .collect();
        if more.is_empty() {
            return found;
        }
        found.extend(more);
    }
}

/// A listening socket: its local address and the processes holding it.
#[derive(Debug)]
struct Listener {
    addr: String,
    owners: Vec<(String, u32)>,
}

/// The listening TCP sockets `ss -ltnpH` reports.
fn listeners() -> Vec<Listener> {
    let out = Command::new("ss").args(["-ltnpH"]).output().expect(
        "`ss` could not run: install iproute2 (scripts/setup.sh does) to check listening sockets",
    );
    assert!(out.status.success(), "ss -ltnpH failed: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let addr = cols.get(3)?.to_string();
            let users = cols.get(5).copied().unwrap_or("");
            // users:(("mpirun",pid=9942,fd=17),("x",pid=1,fd=3))
            let owners = users
                .split("),(")
                .filter_map(|u| {
                    let name = u.split('"').nth(1)?.to_string();
                    let pid = u
                        .split("pid=")
                        .nth(1)?
                        .split([',', ')'])
                        .next()?
                        .parse()
                        .ok()?;
                    Some((name, pid))
                })
                .collect();
            Some(Listener { addr, owners })
        })
        .collect()
}

/// Whether `ss`'s local address (`127.0.0.1:80`, `[::1]:80`, `*:80`, `0.0.0.0:80`) is loopback.
fn is_loopback(addr: &str) -> bool {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let host = host.split('%').next().unwrap_or(host);
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => v4.is_loopback(),
        Ok(IpAddr::V6(v6)) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
        // `*` is every address.
        Err(_) => false,
    }
}

/// The major version of the `mpirun` on PATH.
fn open_mpi_major() -> Option<u32> {
    let out = Command::new("mpirun").arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let version = text.split("(Open MPI)").nth(1)?.split_whitespace().next()?;
    version.split('.').next()?.parse().ok()
}

#[test]
fn a_one_machine_job_listens_on_loopback_only() {
    // The check itself first: it must tell loopback from every address and outside ones.
    for addr in [
        "127.0.0.1:80",
        "127.0.0.53%lo:53",
        "[::1]:631",
        "[::ffff:127.0.0.1]:9",
    ] {
        assert!(is_loopback(addr), "{addr}");
    }
    for addr in [
        "0.0.0.0:1024",
        "*:43121",
        "[::]:1025",
        "10.0.0.2:22",
        "[fe80::1]:5",
    ] {
        assert!(!is_loopback(addr), "{addr}");
    }
    let dir = Scratch::new("restart-sockets");
    let out = dir.0.join("out");
    // No training: the ranks prepare, then hold MPI for a while with everything connected.
    let job = restartable(
        &[],
        &dir.0.join("project"),
        &out,
        &["epochs=0", "hold_ms=4000"],
        &[],
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    while !(out.join("ready-rank0").exists() && out.join("ready-rank1").exists()) {
        assert!(Instant::now() < deadline, "the ranks never got ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let ours = descendants(job.pid());
    let sockets = listeners();
    let end = job.wait();
    assert!(end.status.success(), "{}", end.show());

    let mine: Vec<(&Listener, &(String, u32))> = sockets
        .iter()
        .flat_map(|l| l.owners.iter().map(move |o| (l, o)))
        .filter(|(_, (_, pid))| ours.contains(pid))
        .collect();
    let shown: Vec<String> = mine
        .iter()
        .map(|(l, (name, pid))| format!("{name} (pid {pid}) on {}", l.addr))
        .collect();
    // Open MPI 4's mpirun binds its out-of-band listener to every address whatever
    // `oob_tcp_if_include` says (it only limits what it advertises), one IPv4 and one IPv6
    // socket: the one exception left, documented in docs/launch.md.
    let open_mpi_4 = open_mpi_major().is_some_and(|m| m < 5);
    let (excused, wrong): (Vec<_>, Vec<_>) = mine
        .iter()
        .copied()
        .filter(|(l, _)| !is_loopback(&l.addr))
        .partition(|(_, (name, _))| open_mpi_4 && name == "mpirun");
    assert!(
        wrong.is_empty(),
        "job processes listen beyond loopback: {wrong:?}\nall of the job's listeners: {shown:#?}"
    );
    assert!(
        excused.len() <= 2,
        "mpirun listens on more than its out-of-band pair: {shown:#?}"
    );
    eprintln!("the job's listening sockets: {shown:#?}");
}

#[test]
fn batches_built_ahead_change_nothing_a_checkpoint_or_a_restart_sees() {
    // The same run with `prefetch=2` (batches built on a worker thread), killed at step 10 and
    // restarted from its step-8 checkpoint, ends bit for bit like the plain uninterrupted run.
    let dir = Scratch::new("restart-prefetch");
    let (a, b, _) = uninterrupted_then_crashed(&dir.0, &["prefetch=2"], &[]);
    assert_eq!(b["start_step"].as_u64(), Some(8), "{b}");
    assert_eq!(weight_bits(&a), weight_bits(&b));
}
