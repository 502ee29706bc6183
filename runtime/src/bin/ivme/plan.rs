//! The launch plan: flags read into [`LaunchArgs`], resolved and checked into a [`LaunchPlan`],
//! and turned into an [`Invocation`], the exact command and environment that `--dry_run`
//! prints and a real launch runs.
//!
//! Every [`LaunchArgs`] field is optional so that a config file can fill what the flags leave
//! unset; nothing here starts a process, so all of it is tested without one.

use crate::args::{self, Flag, Kind};
use crate::launch::COMMAND;
use crate::mpirun::{self, MpiJob, Mpirun};
use crate::process;
use crate::rank;
use ivme::{Error, Precision, Result};
use std::path::{Path, PathBuf};

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
    GRAD_ACCUM,
    Flag {
        name: "dry_run",
        kind: Kind::Switch,
        help: "print the command and environment, then exit without running anything",
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
         already set) and the variables of the flags given. Set {} to use a particular mpirun.\n",
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
    /// `--gradient_accumulation_steps`.
    pub gradient_accumulation_steps: Option<usize>,
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
    Launch(LaunchArgs),
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
        let mut rest = s.rest.clone().into_iter();
        Ok(Parsed::Launch(LaunchArgs {
            num_processes: args::positive(&s, &NUM_PROCESSES)?,
            cpu: args::switch(&s, "cpu")?,
            hostfile: s.value("hostfile").map(PathBuf::from),
            mixed_precision,
            gradient_accumulation_steps: args::positive(&s, &GRAD_ACCUM)?,
            dry_run: args::switch(&s, "dry_run")?.unwrap_or(false),
            program: rest.next(),
            program_args: rest.collect(),
        }))
    }
}

/// A host list for a multi-machine run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hostfile {
    /// Where it is.
    pub path: PathBuf,
    /// How many distinct machines it names.
    pub hosts: usize,
}

impl Hostfile {
    /// Reads a hostfile and counts its machines (comments and blank lines skipped).
    pub fn read(path: &Path) -> Result<Hostfile> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Usage(format!(
                "cannot read the hostfile {}: {e}; check the path given to `--hostfile`",
                path.display()
            ))
        })?;
        let mut hosts: Vec<&str> = text
            .lines()
            .filter_map(|l| l.split('#').next()?.split_whitespace().next())
            .collect();
        hosts.sort_unstable();
        hosts.dedup();
        if hosts.is_empty() {
            return Err(Error::Usage(format!(
                "the hostfile {} names no machines; write one per line, e.g. `node1 slots=4`",
                path.display()
            )));
        }
        Ok(Hostfile {
            path: path.to_path_buf(),
            hosts: hosts.len(),
        })
    }
}

/// A checked launch: what runs, on how many processes, with which settings.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchPlan {
    /// Number of ranks.
    pub num_processes: usize,
    /// Whether to force the CPU.
    pub cpu: bool,
    /// The machines, for a multi-machine run.
    pub hostfile: Option<Hostfile>,
    /// The compute precision, when given.
    pub precision: Option<Precision>,
    /// Micro-batches per optimizer step, when given.
    pub grad_accum: Option<usize>,
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
        let Some(program) = args.program else {
            return Err(Error::Usage(
                "missing the program to run: write `ivme launch [FLAGS] PROGRAM [ARGS...]`, e.g. \
                 `ivme launch --num_processes 2 ./target/release/train`"
                    .into(),
            ));
        };
        let hostfile = args.hostfile.as_deref().map(Hostfile::read).transpose()?;
        Ok(LaunchPlan {
            num_processes: args.num_processes.unwrap_or(1),
            cpu: args.cpu.unwrap_or(false),
            hostfile,
            precision: args.mixed_precision,
            grad_accum: args.gradient_accumulation_steps,
            program: process::find_executable(&program, path_var)?,
            program_args: args.program_args,
            dry_run: args.dry_run,
        })
    }

    /// Whether the ranks go through mpirun (a lone local process runs directly).
    pub fn uses_mpi(&self) -> bool {
        self.num_processes > 1 || self.hostfile.is_some()
    }

    /// How many ranks share one machine's cores (ranks spread evenly over the hostfile).
    pub fn processes_per_machine(&self) -> usize {
        let machines = self.hostfile.as_ref().map_or(1, |h| h.hosts);
        self.num_processes.div_ceil(machines)
    }

    /// The variables every rank sees: ivme's settings, plus `IVME_*` and `RAYON_NUM_THREADS`
    /// already in the launcher's environment (`inherited`), with the flags winning.
    pub fn env(&self, machine: &Machine, inherited: &[(String, String)]) -> Vec<(String, String)> {
        let user_rayon = inherited.iter().find(|(k, _)| k == RAYON_VAR);
        let mut ours: Vec<(String, String)> = vec![
            ("IVME_LAUNCHER".into(), "ivme".into()),
            ("IVME_NUM_PROCESSES".into(), self.num_processes.to_string()),
        ];
        if self.cpu {
            ours.push(("IVME_CPU".into(), "1".into()));
        }
        if let Some(p) = self.precision {
            ours.push(("IVME_PRECISION".into(), p.as_str().into()));
        }
        if let Some(k) = self.grad_accum {
            ours.push(("IVME_GRAD_ACCUM".into(), k.to_string()));
        }
        if user_rayon.is_none() {
            let threads = (machine.cores / self.processes_per_machine()).max(1);
            ours.push((RAYON_VAR.into(), threads.to_string()));
        }
        let mut kept: Vec<(String, String)> = inherited
            .iter()
            .filter(|(k, _)| k.starts_with("IVME_") || k == RAYON_VAR)
            .filter(|(k, _)| k != mpirun::MPIRUN_VAR && !ours.iter().any(|(o, _)| o == k))
            .cloned()
            .collect();
        kept.sort();
        ours.extend(kept);
        ours
    }

    /// The exact command and environment this plan runs.
    pub fn invocation(&self, ctx: &Context) -> Result<Invocation> {
        let env = self.env(&ctx.machine, &ctx.inherited);
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
        let job = MpiJob {
            num_processes: self.num_processes,
            hostfile: self.hostfile.as_ref().map(|h| h.path.as_path()),
            as_root: ctx.machine.root,
            // A hostfile states its own slots; locally Open MPI allows one rank per core.
            oversubscribe: self.hostfile.is_none() && self.num_processes > ctx.machine.slots,
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
}

/// The command a plan runs, with its environment.
#[derive(Debug, Clone, PartialEq)]
pub struct Invocation {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Variables set for every rank.
    pub env: Vec<(String, String)>,
    /// How the ranks are started, for messages.
    pub runner: String,
    /// Where ranks record failures (mpirun launches only).
    pub status_dir: Option<PathBuf>,
}

impl Invocation {
    /// The `--dry_run` report: a header, the variables, then the command on one line.
    pub fn describe(&self, num_processes: usize) -> String {
        let plural = if num_processes == 1 {
            "process"
        } else {
            "processes"
        };
        let mut out = format!(
            "# ivme launch --dry_run: {num_processes} {plural} {}; nothing was started\n\
             # environment of every rank:\n",
            self.runner
        );
        for (k, v) in &self.env {
            out.push_str(&format!("{k}={}\n", process::shell_quote(v)));
        }
        out.push_str("# command:\n");
        out.push_str(&process::shell_join(&self.argv));
        out.push('\n');
        out
    }
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
