//! The flags of `ivme launch`, read into [`LaunchArgs`]: every field optional, so that the
//! environment and a config file can fill what the flags leave unset (sources.rs).

use crate::args::{self, Flag, Kind};
use crate::faults;
use crate::mpirun;
use crate::settings::Settings;
use ivme::{Error, Precision, Result, Sharding};
use std::path::PathBuf;

/// The subcommand's name.
pub const COMMAND: &str = "launch";

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

/// The command line of `ivme launch`: the settings its flags give (the strongest layer), and
/// what only the command line says.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LaunchArgs {
    /// The settings the flags give (no flag sets `hosts` or `backend`).
    pub settings: Settings,
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
        let settings = Settings {
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
            max_restarts: faults::max_restarts(&s)?,
            collective_timeout: faults::collective_timeout(&s)?,
            debug_sync: args::switch(&s, faults::DEBUG_SYNC.name)?,
            ..Settings::default()
        };
        Ok(Parsed::Launch(Box::new(LaunchArgs {
            settings,
            config_file: s.value("config_file").map(PathBuf::from),
            dry_run: args::switch(&s, "dry_run")?.unwrap_or(false),
            program: rest.next(),
            program_args: rest.collect(),
        })))
    }
}
