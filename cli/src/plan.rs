//! The launch plan: the flags ([`LaunchArgs`], flags.rs) merged with the environment and the
//! config file (sources.rs), resolved and checked into a [`LaunchPlan`], and turned into an
//! [`Invocation`], the exact command and environment that `--dry_run` prints and a real launch
//! runs. Nothing here starts a process, so all of it is tested without one.

use crate::flags::LaunchArgs;
use crate::hosts::Hosts;
pub use crate::invocation::Invocation;
use crate::mpirun::{self, MpiJob, Mpirun};
use crate::process;
use crate::rank;
use crate::settings::Settings;
use crate::sources::{self, Origin};
use crate::table::ROWS;
use crate::tuning;
use ivme::env;
use ivme::{Error, Result};
use std::path::PathBuf;

/// A checked launch: what runs, on how many processes, with which settings.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchPlan {
    /// Number of ranks.
    pub num_processes: usize,
    /// The machines, for a multi-machine run (from a hostfile or the config's `hosts`).
    pub hosts: Option<Hosts>,
    /// Machines in the run.
    pub num_machines: usize,
    /// This machine's rank among them.
    pub machine_rank: usize,
    /// Every setting as the layers gave it, with the machines' counts and this machine's rank
    /// as resolved above; the ranks' environment is made from it.
    pub settings: Settings,
    /// Where each setting came from, for `--dry_run` (empty when built from flags alone).
    pub origins: Vec<Origin>,
    /// How many times a failed job is started again.
    pub max_restarts: usize,
    /// The launcher's exit code after a preemption.
    pub requeue_exit_code: u8,
    /// The program's absolute path.
    pub program: PathBuf,
    /// The program's arguments.
    pub program_args: Vec<String>,
    /// Print instead of running.
    pub dry_run: bool,
}

impl LaunchPlan {
    /// Applies defaults and checks that the program and hostfile exist; `path_var` is the
    /// `PATH` used to find a program given by name.
    pub fn resolve(args: LaunchArgs, path_var: Option<&str>) -> Result<LaunchPlan> {
        let machines = crate::machines::resolve(&args.settings)?;
        let s = args.settings;
        let Some(program) = args.program else {
            return Err(Error::Usage(
                "missing the program to run: write `ivme launch [FLAGS] PROGRAM [ARGS...]`, e.g. \
                 `ivme launch --num_processes 2 ./target/release/train`"
                    .into(),
            ));
        };
        let settings = Settings {
            num_processes: Some(machines.num_processes),
            num_machines: Some(machines.num_machines),
            machine_rank: Some(machines.machine_rank),
            ..s
        };
        Ok(LaunchPlan {
            num_processes: machines.num_processes,
            hosts: machines.hosts,
            num_machines: machines.num_machines,
            machine_rank: machines.machine_rank,
            origins: Vec::new(),
            max_restarts: settings.max_restarts.unwrap_or(0),
            requeue_exit_code: settings
                .requeue_exit_code
                .unwrap_or(ivme::preempt::DEFAULT_REQUEUE_EXIT_CODE as u8),
            settings,
            program: process::find_executable(&program, path_var)?,
            program_args: args.program_args,
            dry_run: args.dry_run,
        })
    }

    /// Reads the flags, fills the rest from the environment and the config file, and resolves
    /// the result, keeping each setting's origin.
    pub fn resolve_with(
        flags: LaunchArgs,
        config: Option<(&std::path::Path, &Settings)>,
        inherited: &[(String, String)],
        path_var: Option<&str>,
    ) -> Result<LaunchPlan> {
        let (settings, origins) = sources::merge(&flags.settings, config, inherited)?;
        let args = LaunchArgs { settings, ..flags };
        let mut plan = LaunchPlan::resolve(args, path_var)?;
        plan.origins = origins;
        Ok(plan)
    }

    /// Runs the next attempt on `hosts` with `num_processes` ranks: an elastic restart on the
    /// machines still there.
    pub fn on_machines(&mut self, hosts: Hosts, num_processes: usize) {
        self.num_machines = hosts.machines.len();
        self.settings.num_machines = Some(self.num_machines);
        self.num_processes = num_processes;
        self.settings.num_processes = Some(num_processes);
        self.hosts = Some(hosts);
    }

    /// Whether the ranks go through mpirun (a lone local process runs directly).
    pub fn uses_mpi(&self) -> bool {
        self.num_processes > 1 || self.hosts.is_some()
    }

    /// Whether this is a machine other than the main one, which starts nothing itself.
    pub fn is_secondary(&self) -> bool {
        self.num_machines > 1 && self.machine_rank > 0
    }

    /// How many ranks share one machine's cores: the busiest machine's share.
    pub fn processes_per_machine(&self) -> usize {
        self.hosts
            .as_ref()
            .map_or(self.num_processes, |h| h.busiest(self.num_processes))
    }

    /// The variables every rank of attempt `restart` (0 for the first run) sees: ivme's
    /// settings, plus `IVME_*` and `RAYON_NUM_THREADS` already in the launcher's environment
    /// (`inherited`), with the flags winning.
    pub fn env(
        &self,
        machine: &Machine,
        restart: usize,
        inherited: &[(String, String)],
    ) -> Vec<(String, String)> {
        let user_rayon = inherited.iter().find(|(k, _)| k == RAYON_VAR);
        let mut ours: Vec<(String, String)> = vec![
            (env::LAUNCHER.name.into(), "ivme".into()),
            (
                env::NUM_PROCESSES.name.into(),
                self.num_processes.to_string(),
            ),
            (env::RESTART_COUNT.name.into(), restart.to_string()),
        ];
        ours.extend(
            ROWS.iter()
                .filter_map(|row| row.for_ranks(&self.settings))
                .map(|(var, text)| (var.to_string(), text)),
        );
        if user_rayon.is_none() {
            let share = (machine.cores / self.processes_per_machine()).max(1);
            // `--overlap` keeps a core of each share for the sync thread, where there is one
            // to keep.
            let threads = match self.settings.overlap {
                Some(true) if share > 1 => share - 1,
                _ => share,
            };
            ours.push((RAYON_VAR.into(), threads.to_string()));
        }
        ours.extend(tuning::malloc_tuning(inherited));
        ours.extend(tuning::candle_tuning(inherited));
        let mut kept: Vec<(String, String)> = inherited
            .iter()
            .filter(|(k, _)| {
                k.starts_with("IVME_")
                    || k == RAYON_VAR
                    || k == tuning::CANDLE_SPIN_VAR
                    || tuning::is_malloc_var(k)
            })
            .filter(|(k, _)| k != mpirun::MPIRUN_VAR && !ours.iter().any(|(o, _)| o == k))
            .cloned()
            .collect();
        kept.sort();
        ours.extend(kept);
        ours
    }

    /// The exact command and environment this plan runs.
    pub fn invocation(&self, ctx: &Context) -> Result<Invocation> {
        let env = self.env(&ctx.machine, ctx.restart, &ctx.inherited);
        if !self.uses_mpi() {
            let mut argv = vec![self.program.display().to_string()];
            argv.extend(self.program_args.iter().cloned());
            return Ok(Invocation {
                argv,
                env,
                runner: "directly".into(),
                status_dir: None,
            });
        }
        let Some(mpirun) = &ctx.mpirun else {
            return Err(Error::Setup(
                "more than one process needs mpirun, and none was found".into(),
            ));
        };
        let mut rank_command = vec![ctx.ivme_exe.display().to_string()];
        rank_command.extend(rank::wrapper_args(
            &ctx.status_dir,
            &self.program,
            &self.program_args,
        ));
        let hosts = self.hosts.as_ref().map(Hosts::spec);
        let job = MpiJob {
            num_processes: self.num_processes,
            hosts: hosts.as_deref(),
            as_root: ctx.machine.root,
            // Listed machines state their own slots; locally Open MPI allows one rank per core.
            oversubscribe: self.hosts.is_none() && self.num_processes > ctx.machine.slots,
            env: &env,
            rank_command: &rank_command,
        };
        Ok(Invocation {
            argv: mpirun::command_line(mpirun, &job),
            env,
            runner: format!("through {}", mpirun.flavor.name()),
            status_dir: Some(ctx.status_dir.clone()),
        })
    }
}

const RAYON_VAR: &str = "RAYON_NUM_THREADS";

/// What this machine offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    /// CPUs this process may use.
    pub cores: usize,
    /// Ranks Open MPI places here without `--oversubscribe` (its count of physical cores).
    pub slots: usize,
    /// Whether the launcher runs as root.
    pub root: bool,
}

impl Machine {
    /// Looks at the machine this runs on.
    pub fn this() -> Machine {
        let cores = process::cores();
        let slots = process::physical_cores().map_or(cores, |p| p.min(cores));
        Machine {
            cores,
            slots,
            root: process::is_root(),
        }
    }
}

/// Everything an invocation depends on outside the plan.
#[derive(Debug, Clone)]
pub struct Context {
    /// This machine.
    pub machine: Machine,
    /// The launcher's environment.
    pub inherited: Vec<(String, String)>,
    /// The mpirun to use, when the plan needs one.
    pub mpirun: Option<Mpirun>,
    /// The ivme executable each rank's wrapper runs from.
    pub ivme_exe: PathBuf,
    /// Where ranks record failures.
    pub status_dir: PathBuf,
    /// Which attempt this is: 0 for the first run, 1 for the first restart.
    pub restart: usize,
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
