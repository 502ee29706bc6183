//! The launch plan: flags read into [`LaunchArgs`], resolved and checked into a [`LaunchPlan`],
//! and turned into an [`Invocation`], the exact command and environment that `--dry_run`
//! prints and a real launch runs.
//!
//! Every [`LaunchArgs`] field is optional so that a config file can fill what the flags leave
//! unset; nothing here starts a process, so all of it is tested without one.

use crate::args::{self, Flag, Kind};
use crate::faults;
use crate::hosts::Hosts;
pub use crate::invocation::Invocation;
use crate::launch::COMMAND;
use crate::mpirun::{self, MpiJob, Mpirun};
use crate::process;
use crate::rank;
use crate::sources::{self, Origin};
use crate::tuning;
use ivme::env;
use ivme::{Error, Precision, Result, Sharding};
use std::path::PathBuf;
use std::time::Duration;

const NUM_PROCESSES: Flag = Flag {
    name: "num_processes",
    kind: Kind::Value("count"),
    help: "how many processes to start (default 1; more than 1 goes through mpirun)",
    example: "2",
};
const GRAD_ACCUM: Flag = Flag {
    name: "gradient_accumulation_steps",
    kind: Kind::Value("steps"),
    help: "micro-batches per optimizer step, passed as IVME_GRAD_ACCUM",
    example: "4",
};
const NUM_MACHINES: Flag = Flag {
    name: "num_machines",
    kind: Kind::Value("count"),
    help: "machines in the run (more than 1 needs the config's `hosts` or --hostfile)",
    example: "2",
};
const MACHINE_RANK: Flag = Flag {
    name: "machine_rank",
    kind: Kind::Value("rank"),
    help: "this machine's rank; only rank 0 starts anything (it starts every machine's ranks)",
    example: "0",
};
const MAIN_PORT: Flag = Flag {
    name: "main_process_port",
    kind: Kind::Value("port"),
    help: "rendezvous port on the main machine, passed as IVME_MAIN_PROCESS_PORT",
    example: "29500",
};

/// The flags `ivme launch` accepts.
pub const FLAGS: &[Flag] = &[
    NUM_PROCESSES,
    Flag {
        name: "cpu",
        kind: Kind::Switch,
        help: "compute on the CPU even where a GPU is present (IVME_CPU=1)",
        example: "",
    },
    Flag {
        name: "hostfile",
        kind: Kind::Value("file"),
        help: "machines to run on, one per line (`node1 slots=4`), handed to mpirun",
        example: "hosts.txt",
    },
    Flag {
        name: "mixed_precision",
        kind: Kind::Value("no|fp16|bf16"),
        help: "compute precision, passed as IVME_PRECISION",
        example: "bf16",
    },
    Flag {
        name: "sharding",
        kind: Kind::Value("no|optimizer|gradients"),
        help: "ZeRO sharding stage (or 0|1|2), passed as IVME_SHARDING",
        example: "gradients",
    },
    GRAD_ACCUM,
    NUM_MACHINES,
    MACHINE_RANK,
    Flag {
        name: "main_process_ip",
        kind: Kind::Value("address"),
        help: "the main machine's address (the first of the machines), as IVME_MAIN_PROCESS_IP",
        example: "10.0.0.1",
    },
    MAIN_PORT,
    faults::MAX_RESTARTS,
    faults::COLLECTIVE_TIMEOUT,
    faults::DEBUG_SYNC,
    Flag {
        name: "config_file",
        kind: Kind::Value("file"),
        help: "the config file to read (default: $IVME_CONFIG, else ~/.config/ivme/default_config.toml)",
        example: "ivme.toml",
    },
    Flag {
        name: "dry_run",
        kind: Kind::Switch,
        help: "print the settings with their sources, the command and environment; run nothing",
        example: "",
    },
];

/// The help text for `ivme launch --help`.
pub fn usage() -> String {
    format!(
        "Start PROGRAM on one or more processes, with ivme's settings in its environment.\n\n\
         Usage: ivme launch [FLAGS] PROGRAM [ARGS...]\n\n\
         Flags (`--num-processes` and `--num_processes=2` work too):\n{}\
         \nEverything after PROGRAM is passed to it unchanged. Each rank sees IVME_NUM_PROCESSES,\n\
         IVME_LAUNCHER=ivme, RAYON_NUM_THREADS (cores shared between the ranks on a machine, unless\n\
         already set), glibc allocator settings on Linux (MALLOC_MMAP_THRESHOLD_ and\n\
         MALLOC_TRIM_THRESHOLD_ unless set; IVME_MALLOC_TUNING=0 turns them off) and the variables\n\
         of the settings given. Set {} to use a particular mpirun.\n\
         \nSettings come from flags, then IVME_PRECISION / IVME_GRAD_ACCUM / IVME_CPU /\n\
         IVME_COLLECTIVE_TIMEOUT / IVME_DEBUG_SYNC already in the environment, then the config\n\
         file (`ivme config`), then the defaults.\n\
         \nSeveral machines: run `ivme launch` on machine 0 only; mpirun starts every machine's\n\
         ranks over ssh, so each machine needs the program at the same path. The machines come from\n\
         --hostfile (`node1 slots=4` per line) or the config's `hosts` list with --num_machines.\n\
         One machine: the ranks talk through shared memory, and mpirun to them over loopback.\n\
         \nWhen a rank fails, the job ends; with --max_restarts N it is started again, up to N\n\
         times (never after Ctrl-C), and each rank sees IVME_RESTART_COUNT (0 at first), so a\n\
         program that calls `load_state_if_any` right after preparing continues from its newest\n\
         checkpoint.\n",
        args::help_table(FLAGS),
        mpirun::MPIRUN_VAR
    )
}

/// The launch settings as given, before defaults and checks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LaunchArgs {
    /// `--num_processes`.
    pub num_processes: Option<usize>,
    /// `--cpu`.
    pub cpu: Option<bool>,
    /// `--hostfile`.
    pub hostfile: Option<PathBuf>,
    /// `--mixed_precision`.
    pub mixed_precision: Option<Precision>,
    /// `--sharding`.
    pub sharding: Option<Sharding>,
    /// `--gradient_accumulation_steps`.
    pub gradient_accumulation_steps: Option<usize>,
    /// `--num_machines`.
    pub num_machines: Option<usize>,
    /// `--machine_rank`.
    pub machine_rank: Option<usize>,
    /// `--main_process_ip`.
    pub main_process_ip: Option<String>,
    /// `--main_process_port`.
    pub main_process_port: Option<u16>,
    /// The machines' addresses (the config's `hosts`; no flag).
    pub hosts: Option<Vec<String>>,
    /// `--max_restarts`.
    pub max_restarts: Option<usize>,
    /// `--collective_timeout`.
    pub collective_timeout: Option<Duration>,
    /// `--debug_sync`.
    pub debug_sync: Option<bool>,
    /// `--config_file`.
    pub config_file: Option<PathBuf>,
    /// `--dry_run`.
    pub dry_run: bool,
    /// The program to start, as typed.
    pub program: Option<String>,
    /// The program's own arguments.
    pub program_args: Vec<String>,
}

/// What the command line asked for.
#[derive(Debug, PartialEq)]
pub enum Parsed {
    /// `--help`: print the usage and stop.
    Help,
    /// A launch.
    Launch(Box<LaunchArgs>),
}

impl LaunchArgs {
    /// Reads the arguments that follow `ivme launch`.
    pub fn parse(words: &[String]) -> Result<Parsed> {
        let s = args::scan(COMMAND, FLAGS, words)?;
        if s.help {
            return Ok(Parsed::Help);
        }
        let mixed_precision = match s.value("mixed_precision") {
            None => None,
            Some(raw) => Some(raw.parse::<Precision>().map_err(|_| {
                Error::Usage(format!(
                    "`--mixed_precision {raw}` is not a precision; use one of {}",
                    Precision::VALID.join(", ")
                ))
            })?),
        };
        let sharding = match s.value("sharding") {
            None => None,
            Some(raw) => Some(raw.parse::<Sharding>().map_err(|_| {
                Error::Usage(format!(
                    "`--sharding {raw}` is not a sharding stage; use one of {}",
                    Sharding::VALID.join(", ")
                ))
            })?),
        };
        let machine_rank = match s.value("machine_rank") {
            None => None,
            Some(raw) => Some(raw.trim().parse::<usize>().map_err(|_| {
                Error::Usage(format!(
                    "`--machine_rank {raw}` is not a whole number; machine ranks count from 0, e.g. `--machine_rank 0`"
                ))
            })?),
        };
        let main_process_port = match args::positive(&s, &MAIN_PORT)? {
            None => None,
            Some(p) => Some(u16::try_from(p).map_err(|_| {
                Error::Usage(format!("`--main_process_port {p}` is not a port; use 1 to 65535, e.g. `--main_process_port 29500`"))
            })?),
        };
        let mut rest = s.rest.clone().into_iter();
        Ok(Parsed::Launch(Box::new(LaunchArgs {
            num_processes: args::positive(&s, &NUM_PROCESSES)?,
            cpu: args::switch(&s, "cpu")?,
            hostfile: s.value("hostfile").map(PathBuf::from),
            mixed_precision,
            sharding,
            gradient_accumulation_steps: args::positive(&s, &GRAD_ACCUM)?,
            num_machines: args::positive(&s, &NUM_MACHINES)?,
            machine_rank,
            main_process_ip: s.value("main_process_ip").map(str::to_string),
            main_process_port,
            hosts: None,
            max_restarts: faults::max_restarts(&s)?,
            collective_timeout: faults::collective_timeout(&s)?,
            debug_sync: args::switch(&s, faults::DEBUG_SYNC.name)?,
            config_file: s.value("config_file").map(PathBuf::from),
            dry_run: args::switch(&s, "dry_run")?.unwrap_or(false),
            program: rest.next(),
            program_args: rest.collect(),
        })))
    }
}

/// A checked launch: what runs, on how many processes, with which settings.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchPlan {
    /// Number of ranks.
    pub num_processes: usize,
    /// Whether to force the CPU.
    pub cpu: bool,
    /// The machines, for a multi-machine run (from a hostfile or the config's `hosts`).
    pub hosts: Option<Hosts>,
    /// Machines in the run.
    pub num_machines: usize,
    /// This machine's rank among them.
    pub machine_rank: usize,
    /// The main machine's address and rendezvous port, when given.
    pub main_process_ip: Option<String>,
    /// The rendezvous port on the main machine, when given.
    pub main_process_port: Option<u16>,
    /// Where each setting came from, for `--dry_run` (empty when built from flags alone).
    pub origins: Vec<Origin>,
    /// The compute precision, when given.
    pub precision: Option<Precision>,
    /// The ZeRO sharding stage, when given.
    pub sharding: Option<Sharding>,
    /// Micro-batches per optimizer step, when given.
    pub grad_accum: Option<usize>,
    /// How many times a failed job is started again.
    pub max_restarts: usize,
    /// The deadline of every collective, when given.
    pub collective_timeout: Option<Duration>,
    /// Whether the ranks check that they call the same collectives.
    pub debug_sync: bool,
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
        let machines = crate::machines::resolve(&args)?;
        let Some(program) = args.program else {
            return Err(Error::Usage(
                "missing the program to run: write `ivme launch [FLAGS] PROGRAM [ARGS...]`, e.g. \
                 `ivme launch --num_processes 2 ./target/release/train`"
                    .into(),
            ));
        };
        Ok(LaunchPlan {
            num_processes: machines.num_processes,
            cpu: args.cpu.unwrap_or(false),
            hosts: machines.hosts,
            num_machines: machines.num_machines,
            machine_rank: machines.machine_rank,
            main_process_ip: args.main_process_ip,
            main_process_port: args.main_process_port,
            origins: Vec::new(),
            precision: args.mixed_precision,
            sharding: args.sharding,
            grad_accum: args.gradient_accumulation_steps,
            max_restarts: args.max_restarts.unwrap_or(0),
            collective_timeout: args.collective_timeout,
            debug_sync: args.debug_sync.unwrap_or(false),
            program: process::find_executable(&program, path_var)?,
            program_args: args.program_args,
            dry_run: args.dry_run,
        })
    }

    /// Reads the flags, fills the rest from the environment and the config file, and resolves
    /// the result, keeping each setting's origin.
    pub fn resolve_with(
        flags: LaunchArgs,
        config: Option<(&std::path::Path, &crate::settings::Config)>,
        inherited: &[(String, String)],
        path_var: Option<&str>,
    ) -> Result<LaunchPlan> {
        let (args, origins) = sources::merge(flags, config, inherited)?;
        let mut plan = LaunchPlan::resolve(args, path_var)?;
        plan.origins = origins;
        Ok(plan)
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
        if self.cpu {
            ours.push((env::CPU.name.into(), "1".into()));
        }
        if let Some(p) = self.precision {
            ours.push((env::PRECISION.name.into(), p.as_str().into()));
        }
        if let Some(k) = self.grad_accum {
            ours.push((env::GRAD_ACCUM.name.into(), k.to_string()));
        }
        if let Some(s) = self.sharding {
            ours.push((env::SHARDING.name.into(), s.as_str().into()));
        }
        if self.num_machines > 1 {
            ours.push((env::NUM_MACHINES.name.into(), self.num_machines.to_string()));
        }
        if let Some(ip) = &self.main_process_ip {
            ours.push((env::MAIN_PROCESS_IP.name.into(), ip.clone()));
        }
        if let Some(port) = self.main_process_port {
            ours.push((env::MAIN_PROCESS_PORT.name.into(), port.to_string()));
        }
        if let Some(t) = self.collective_timeout {
            ours.push((env::COLLECTIVE_TIMEOUT.name.into(), env::seconds_text(t)));
        }
        if self.debug_sync {
            ours.push((env::DEBUG_SYNC.name.into(), "1".into()));
        }
        if user_rayon.is_none() {
            let threads = (machine.cores / self.processes_per_machine()).max(1);
            ours.push((RAYON_VAR.into(), threads.to_string()));
        }
        ours.extend(tuning::malloc_tuning(inherited));
        let mut kept: Vec<(String, String)> = inherited
            .iter()
            .filter(|(k, _)| k.starts_with("IVME_") || k == RAYON_VAR || tuning::is_malloc_var(k))
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
