//! `ivme launch`: start a program on one or many processes.
//!
//! The plan (what to run, how, with which environment) comes from [`crate::plan`], with what the
//! flags leave unset taken from the config file ([`crate::settings`]); this module runs it, then
//! reads which ranks failed and picks the exit code. With `--max_restarts N` a failed job is
//! run again, whole, up to N times; a stop the user asked for (Ctrl-C) never is, nor a
//! preemption (SIGTERM or SIGUSR1 by default), after which it exits with the requeue code.

use crate::cli::Parsed;
use crate::elastic;
use crate::faults;
use crate::flags::LaunchArgs;
use crate::hosts::Hosts;
use crate::lost::{self, LostMachines};
use crate::mpirun::{Flavor, Mpirun};
use crate::plan::{Context, Invocation, LaunchPlan, Machine};
use crate::process::{self, Outcome};
use crate::rank::{self, Failure};
use crate::report;
use crate::settings::Location;
use ivme::{Error, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

/// Removes a folder of the launch (the status folder, the snapshots) however the launch ends.
struct StatusDir(PathBuf);

impl Drop for StatusDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The folder the ranks keep in-memory snapshots in: memory-backed `/dev/shm` where there is
/// one. Created by the ranks when they take one.
fn snapshot_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    base.join(format!("ivme-snapshots-{}-{nanos}", std::process::id()))
}

fn fresh_status_dir() -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::env::temp_dir().join(format!("ivme-launch-{}-{nanos}", std::process::id()))
}

/// Runs `ivme launch` and returns the exit code.
pub fn main(words: &[String]) -> Result<i32> {
    let args = match LaunchArgs::parse(words)? {
        Parsed::Help(text) => {
            print!("{text}");
            return Ok(0);
        }
        Parsed::Args(args) => *args,
    };
    // Variables that are not UTF-8 cannot be ivme's; skipping them avoids env::vars' panic.
    let inherited: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect();
    let lookup = |key: &str| {
        inherited
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    };
    let location = Location::find(args.config_file.as_deref(), lookup)?;
    let config = location.load()?;
    let mut plan = LaunchPlan::resolve_with(
        args,
        config.as_ref().map(|c| (location.path.as_path(), c)),
        &inherited,
        lookup("PATH").as_deref(),
    )?;
    if plan.is_secondary() {
        if plan.dry_run {
            print!("{}", report::describe_settings(&plan));
        }
        print!("{}", report::secondary_message(&plan));
        return Ok(0);
    }
    // The flags, the environment or the defaults, as the plan resolved them.
    let preempt = ivme::preempt::PreemptSettings::read(|k| match k {
        k if k == ivme::env::PREEMPT_SIGNALS.name => plan.settings.preempt_signals.clone(),
        k if k == ivme::env::PREEMPT_GRACE.name => {
            plan.settings.preempt_grace.map(ivme::env::seconds_text)
        }
        _ => None,
    })?;
    let requeue = i32::from(plan.requeue_exit_code);
    let preempt = Preemption {
        supervise: process::Preempt {
            signals: preempt.signals,
            grace: Some(preempt.grace),
        },
        requeue,
    };
    let mpirun = if plan.uses_mpi() {
        Some(Mpirun::find(lookup)?)
    } else {
        None
    };
    if let Some(m) = mpirun.as_ref().filter(|m| m.flavor == Flavor::Unknown) {
        eprintln!(
            "ivme: warning: {} is neither Open MPI nor MPICH; passing only `-np` and the hostfile",
            m.path.display()
        );
    }
    let mut ctx = Context {
        machine: Machine::this(),
        inherited,
        mpirun,
        ivme_exe: std::env::current_exe()
            .map_err(|e| Error::io("finding the ivme executable", e))?,
        status_dir: fresh_status_dir(),
        restart: 0,
    };
    if plan.dry_run {
        let inv = plan.invocation(&ctx)?;
        let config_line = match &config {
            Some(_) => format!(
                "# config file: {} (from {})\n",
                location.path.display(),
                location.chosen_by
            ),
            None => format!(
                "# config file: none (nothing at {})\n",
                location.path.display()
            ),
        };
        print!(
            "{config_line}{}{}",
            report::describe_settings(&plan),
            inv.describe(plan.num_processes)
        );
        return Ok(0);
    }
    let profile = plan.settings.profile.clone();
    let started = std::time::SystemTime::now();
    let code = attempts(&mut plan, &mut ctx, &preempt)?;
    if let Some(dir) = profile {
        crate::profile_cmd::after_launch(&dir, started);
    }
    Ok(code)
}

/// Runs the job, and again after a failure while `--max_restarts` allows; the exit code.
fn attempts(plan: &mut LaunchPlan, ctx: &mut Context, preempt: &Preemption) -> Result<i32> {
    // The ranks' in-memory snapshots outlive each attempt, not the launcher.
    let snapshots = StatusDir(snapshot_dir());
    let mut last_code = 1;
    loop {
        // Every other machine answers over ssh before any rank starts (cli/src/reach.rs); on a
        // restart with `--min_machines`, the ones that do not are left out if enough remain.
        if let Some(hosts) = plan.hosts.clone().filter(|_| ctx.mpirun.is_some()) {
            match plan.settings.min_machines.filter(|_| ctx.restart > 0) {
                None => crate::reach::check(&hosts)?,
                Some(min) => {
                    let silent = crate::reach::silent(&hosts);
                    if !silent.is_empty() {
                        let lost: Vec<usize> = silent.iter().map(|(i, _)| *i).collect();
                        let (left, n) = elastic::without(&hosts, plan.num_processes, &lost);
                        let said: Vec<&str> = silent.iter().map(|(_, l)| l.as_str()).collect();
                        if left.machines.len() < min {
                            eprintln!(
                                "ivme: not restarting: {} machine(s) still answer, fewer than \
                                 --min_machines {min}; did not answer:\n  {}",
                                left.machines.len(),
                                said.join("\n  ")
                            );
                            return Ok(last_code);
                        }
                        eprintln!(
                            "ivme: restarting on the {} machines that still answer, with {n} \
                             processes (was {}); left out:\n  {}",
                            left.machines.len(),
                            plan.num_processes,
                            said.join("\n  ")
                        );
                        plan.on_machines(left, n);
                    }
                }
            }
        }
        let inv = plan.invocation(ctx)?;
        let machines = plan.hosts.as_ref().map(|h| (h, plan.num_processes));
        let (code, cause) = match run_once(&inv, preempt, &snapshots.0, machines)? {
            Ended::Done(code) => return Ok(code),
            Ended::Failed(code, cause) => {
                last_code = code;
                (code, cause)
            }
            Ended::Recurs(code, note) => {
                if ctx.restart < plan.max_restarts {
                    eprintln!(
                        "ivme: not restarting: {note}; a restart would fail the same way, so \
                         change the program, its settings or its files first"
                    );
                }
                return Ok(code);
            }
        };
        // A preemption that came while the job was failing: the scheduler requeues it.
        if let Some(sig) = process::preempted_by() {
            eprintln!(
                "ivme: preempted (signal {sig} to the launcher); not restarting; exiting with {} \
                 so a scheduler can requeue the job",
                preempt.requeue
            );
            return Ok(preempt.requeue);
        }
        // Ctrl-C or SIGTERM while the launcher waited between attempts: stop here too.
        if let Some(sig) = process::stopped_by() {
            eprintln!("ivme: stopped by signal {sig}; not restarting");
            return Ok(128 + sig);
        }
        if ctx.restart >= plan.max_restarts {
            if plan.max_restarts > 0 {
                eprintln!("{}", faults::exhausted_line(plan.max_restarts, &cause));
            }
            return Ok(code);
        }
        ctx.restart += 1;
        ctx.status_dir = fresh_status_dir();
        eprintln!(
            "{}",
            faults::restart_line(ctx.restart, plan.max_restarts, &cause)
        );
    }
}

/// What `ivme launch` does on a preemption signal, and its exit code after one.
struct Preemption {
    supervise: process::Preempt,
    requeue: i32,
}

/// How one attempt at the job ended.
enum Ended {
    /// Success, or a stop the user asked for: the launcher exits with this code.
    Done(i32),
    /// A failure that a restart may get past: the exit code and what failed, for messages.
    Failed(i32, String),
    /// A failure a rank noted would recur on a restart (a checkpoint that does not fit, a
    /// model that cannot be prepared): the exit code and the first rank's note.
    Recurs(i32, String),
}

/// Runs the job once, in a fresh status folder, and reports how it went; `machines` (the
/// machines of a multi-machine job and its number of processes) lets the report name a
/// machine that mpirun lost.
fn run_once(
    inv: &Invocation,
    preempt: &Preemption,
    snapshots: &Path,
    machines: Option<(&Hosts, usize)>,
) -> Result<Ended> {
    // A program started directly notes a preemption in a folder of its own.
    let notes = inv.status_dir.clone().unwrap_or_else(fresh_status_dir);
    let _cleanup = StatusDir(notes.clone());
    std::fs::create_dir_all(&notes)
        .map_err(|e| Error::io(format!("creating {}", notes.display()), e))?;
    let mut cmd = Command::new(&inv.argv[0]);
    cmd.args(&inv.argv[1..]).envs(inv.env.iter().cloned());
    if inv.status_dir.is_none() {
        cmd.env(ivme::preempt::STATUS_DIR_VAR, &notes);
    }
    // This machine's ranks inherit it (snapshots are taken only when all ranks are here).
    cmd.env(ivme::env::SNAPSHOT_DIR.name, snapshots);
    if let Some(dir) = &inv.status_dir {
        // Open MPI keeps its session files under one folder per user and machine, which two
        // jobs starting and ending at once race to create and remove; each launch gets its
        // own (inside the status folder, removed with it) unless the user chose one.
        if std::env::var_os(SESSION_DIR_VAR).is_none() {
            cmd.env(SESSION_DIR_VAR, dir);
        }
    }
    // Across machines, mpirun's messages pass through the launcher, which notes the machines
    // they say were lost.
    if machines.is_some() {
        cmd.stderr(Stdio::piped());
    }
    let mut watch = None;
    let failed = |dir: &Path| Failure::read_all(dir).is_ok_and(|f| !f.is_empty());
    let failed = inv.status_dir.as_deref().map(|dir| move || failed(dir));
    let started = |child: &mut std::process::Child| {
        let relayed = inv.status_dir.clone();
        watch = child.stderr.take().map(|s| LostMachines::watch(s, relayed));
    };
    let outcome = process::supervise_with(
        &mut cmd,
        &preempt.supervise,
        started,
        failed.as_ref().map(|f| f as &dyn Fn() -> bool),
    )
    .map_err(|e| Error::io(format!("starting `{}`", inv.argv[0]), e))?;
    let lost = watch.map(LostMachines::finish).unwrap_or_default();
    if let Some(code) = faults::preempted(&notes, outcome.code, preempt.requeue) {
        return Ok(Ended::Done(code));
    }
    let ended = report(inv, outcome)?;
    if let (Some((hosts, n)), Ended::Failed(..) | Ended::Recurs(..)) = (machines, &ended) {
        if let Some(said) = lost::describe(&lost, hosts, n) {
            eprintln!("{said}");
        }
    }
    Ok(ended)
}

/// Open MPI's parameter for the folder its session files go under.
const SESSION_DIR_VAR: &str = "OMPI_MCA_orte_tmpdir_base";

/// Tells the user which rank failed and picks the launcher's exit code.
fn report(inv: &Invocation, outcome: Outcome) -> Result<Ended> {
    if let Some(sig) = process::stopped_by().filter(|_| outcome.code != 0) {
        let what = if sig == 2 {
            "Ctrl-C"
        } else {
            "a termination signal"
        };
        eprintln!("ivme: stopped by {what} (signal {sig}); the program was stopped too");
        return Ok(Ended::Done(128 + sig));
    }
    let Some(dir) = &inv.status_dir else {
        if outcome.code == 0 {
            return Ok(Ended::Done(0));
        }
        eprintln!("ivme: the program failed with {}", outcome.describe());
        let cause = format!("the program failed with {}", outcome.describe());
        return Ok(Ended::Failed(outcome.code, cause));
    };
    let failures = Failure::read_all(dir)?;
    if let Some((msg, code)) = rank::summarize(&failures) {
        eprintln!("{msg}");
        let code = if code != 0 { code } else { 1 };
        if let Some((r, note)) = rank::recurring(dir).into_iter().next() {
            return Ok(Ended::Recurs(
                code,
                format!("rank {r} failed with `{note}`"),
            ));
        }
        return Ok(Ended::Failed(code, failures[0].describe()));
    }
    if outcome.code == 0 {
        return Ok(Ended::Done(0));
    }
    eprintln!(
        "ivme: mpirun failed with {} before any rank reported a failure; its messages are above",
        outcome.describe()
    );
    let cause = format!("mpirun failed with {}", outcome.describe());
    Ok(Ended::Failed(outcome.code, cause))
}
