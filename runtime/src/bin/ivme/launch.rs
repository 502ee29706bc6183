//! `ivme launch`: start a program on one or many processes.
//!
//! The plan (what to run, how, with which environment) comes from [`crate::plan`], with what the
//! flags leave unset taken from the config file ([`crate::settings`]); this module runs it, then
//! reads which ranks failed and picks the exit code.

use crate::machines;
use crate::mpirun::{Flavor, Mpirun};
use crate::plan::{usage, Context, Invocation, LaunchArgs, LaunchPlan, Machine, Parsed};
use crate::process::{self, Outcome};
use crate::rank::{self, Failure};
use crate::settings::Location;
use ivme::{Error, Result};
use std::path::PathBuf;
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

/// The subcommand's name.
pub const COMMAND: &str = "launch";

/// Removes the status folder however the launch ends.
struct StatusDir(PathBuf);

impl Drop for StatusDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
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
        Parsed::Help => {
            print!("{}", usage());
            return Ok(0);
        }
        Parsed::Launch(args) => *args,
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
    let plan = LaunchPlan::resolve_with(
        args,
        config.as_ref().map(|c| (location.path.as_path(), c)),
        &inherited,
        lookup("PATH").as_deref(),
    )?;
    if plan.is_secondary() {
        if plan.dry_run {
            print!("{}", machines::describe_settings(&plan));
        }
        print!("{}", machines::secondary_message(&plan));
        return Ok(0);
    }
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
    let ctx = Context {
        machine: Machine::this(),
        inherited,
        mpirun,
        ivme_exe: std::env::current_exe()
            .map_err(|e| Error::io("finding the ivme executable", e))?,
        status_dir: fresh_status_dir(),
    };
    let inv = plan.invocation(&ctx)?;
    if plan.dry_run {
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
            machines::describe_settings(&plan),
            inv.describe(plan.num_processes)
        );
        return Ok(0);
    }
    let _cleanup = inv.status_dir.clone().map(StatusDir);
    if let Some(dir) = &inv.status_dir {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    }
    let mut cmd = Command::new(&inv.argv[0]);
    cmd.args(&inv.argv[1..]).envs(inv.env.iter().cloned());
    let outcome = process::supervise(&mut cmd)
        .map_err(|e| Error::io(format!("starting `{}`", inv.argv[0]), e))?;
    report(&inv, outcome)
}

/// Tells the user which rank failed and picks the launcher's exit code.
fn report(inv: &Invocation, outcome: Outcome) -> Result<i32> {
    if let Some(sig) = process::stopped_by().filter(|_| outcome.code != 0) {
        let what = if sig == 2 {
            "Ctrl-C"
        } else {
            "a termination signal"
        };
        eprintln!("ivme: stopped by {what} (signal {sig}); the program was stopped too");
        return Ok(128 + sig);
    }
    let Some(dir) = &inv.status_dir else {
        if outcome.code != 0 {
            eprintln!("ivme: the program failed with {}", outcome.describe());
        }
        return Ok(outcome.code);
    };
    if let Some((msg, code)) = rank::summarize(&Failure::read_all(dir)?) {
        eprintln!("{msg}");
        return Ok(if code != 0 { code } else { 1 });
    }
    if outcome.code != 0 {
        eprintln!(
            "ivme: mpirun failed with {} before any rank reported a failure; its messages are above",
            outcome.describe()
        );
    }
    Ok(outcome.code)
}
