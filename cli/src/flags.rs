//! The flags of `ivme launch`, read into [`LaunchArgs`]: every field optional, so that the
//! environment and a config file can fill what the flags leave unset (sources.rs).

use crate::cli::{self, Checked};
use crate::mpirun;
use crate::settings::Settings;
use clap::Parser;
use ivme::{BufferSync, Precision, Result, Sharding};
use std::path::PathBuf;
use std::time::Duration;

/// The subcommand's name.
pub const COMMAND: &str = "launch";

/// Start PROGRAM on one or more processes, with ivme's settings in its environment.
#[derive(Parser, Debug)]
#[command(
    rename_all = "snake_case",
    override_usage = "ivme launch [FLAGS] PROGRAM [ARGS...]",
    after_help = notes()
)]
struct Flags {
    /// how many processes to start (default 1; more than 1 goes through mpirun)
    #[arg(long, value_name = "count", value_parser = Checked(cli::positive))]
    num_processes: Option<usize>,
    /// compute on the CPU even where a GPU is present (IVME_CPU=1)
    #[arg(long, value_name = cli::SWITCH)]
    cpu: Option<bool>,
    /// machines to run on, one per line (`node1 slots=4`), handed to mpirun
    #[arg(long, value_name = "file", value_parser = Checked(cli::text))]
    hostfile: Option<String>,
    /// compute precision, passed as IVME_PRECISION
    #[arg(long, value_name = "no|fp16|bf16", value_parser = Checked(cli::precision))]
    mixed_precision: Option<Precision>,
    /// ZeRO sharding stage (or 0|1|2), passed as IVME_SHARDING
    #[arg(long, value_name = "no|optimizer|gradients", value_parser = Checked(cli::sharding))]
    sharding: Option<Sharding>,
    /// how buffers (BatchNorm statistics) agree across processes, passed as IVME_BUFFERS
    #[arg(long, value_name = "broadcast|average|local", value_parser = Checked(cli::buffers))]
    buffers: Option<BufferSync>,
    /// micro-batches per optimizer step, passed as IVME_GRAD_ACCUM
    #[arg(long, value_name = "steps", value_parser = Checked(cli::positive))]
    gradient_accumulation_steps: Option<usize>,
    /// machines in the run (more than 1 needs the config's `hosts` or --hostfile)
    #[arg(long, value_name = "count", value_parser = Checked(cli::positive))]
    num_machines: Option<usize>,
    /// this machine's rank; only rank 0 starts anything (it starts every machine's ranks)
    #[arg(long, value_name = "rank", value_parser = Checked(cli::machine_rank))]
    machine_rank: Option<usize>,
    /// the main machine's address (the first of the machines), as IVME_MAIN_PROCESS_IP
    #[arg(long, value_name = "address", value_parser = Checked(cli::text))]
    main_process_ip: Option<String>,
    /// rendezvous port on the main machine, passed as IVME_MAIN_PROCESS_PORT
    #[arg(long, value_name = "port", value_parser = Checked(cli::port))]
    main_process_port: Option<u16>,
    /// relaunch a failed job up to this many times (default 0); ranks see IVME_RESTART_COUNT
    #[arg(long, value_name = "count", value_parser = Checked(cli::restarts))]
    max_restarts: Option<usize>,
    /// deadline of each collective (90, 90s, 10m, 1h, 500ms), as IVME_COLLECTIVE_TIMEOUT seconds
    #[arg(long, value_name = "duration", value_parser = Checked(cli::duration))]
    collective_timeout: Option<Duration>,
    /// check that the ranks call the same collectives in the same order (IVME_DEBUG_SYNC=1)
    #[arg(long, value_name = cli::SWITCH)]
    debug_sync: Option<bool>,
    /// signals that stop the job for a preemption (default TERM,USR1; none), IVME_PREEMPT_SIGNALS
    #[arg(long, value_name = "list", value_parser = Checked(cli::signals))]
    preempt_signals: Option<String>,
    /// how long a preempted rank may take to stop and save (default 25s), IVME_PREEMPT_GRACE
    #[arg(long, value_name = "duration", value_parser = Checked(cli::duration))]
    preempt_grace: Option<Duration>,
    /// the launcher's exit code after a preemption, for a scheduler to requeue on (default 75)
    #[arg(long, value_name = "code", value_parser = Checked(cli::exit_code))]
    requeue_exit_code: Option<u8>,
    /// the config file to read (default: $IVME_CONFIG, else ~/.config/ivme/default_config.toml)
    #[arg(long, value_name = "file", value_parser = Checked(cli::text))]
    config_file: Option<String>,
    /// print the settings with their sources, the command and environment; run nothing
    #[arg(long, value_name = cli::SWITCH)]
    dry_run: Option<bool>,
    /// the program to start and its arguments, passed to it unchanged
    #[arg(trailing_var_arg = true, value_name = "PROGRAM")]
    command: Vec<String>,
}

/// What `ivme launch --help` says after the flags.
fn notes() -> String {
    format!(
        "Flags come before PROGRAM (`--num-processes` and `--num_processes=2` work too);\n\
         everything after PROGRAM is passed to it unchanged. Each rank sees IVME_NUM_PROCESSES,\n\
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
         checkpoint.\n\
         \nA SIGTERM or SIGUSR1 to the launcher is a preemption (--preempt_signals): it reaches\n\
         every rank as SIGUSR1, the ranks stop after the optimizer step they agree on, save at\n\
         their preemption point, and the launcher exits with 75 (--requeue_exit_code) for a\n\
         scheduler to requeue on; never restarted.",
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

/// What the command line asked for: the help text, or a launch.
pub type Parsed = cli::Parsed<Box<LaunchArgs>>;

impl LaunchArgs {
    /// Reads the arguments that follow `ivme launch`.
    pub fn parse(words: &[String]) -> Result<Parsed> {
        let f = match cli::parse::<Flags>(COMMAND, words)? {
            cli::Parsed::Help(text) => return Ok(cli::Parsed::Help(text)),
            cli::Parsed::Args(f) => f,
        };
        let settings = Settings {
            num_processes: f.num_processes,
            cpu: f.cpu,
            hostfile: f.hostfile.map(PathBuf::from),
            mixed_precision: f.mixed_precision,
            sharding: f.sharding,
            buffers: f.buffers,
            gradient_accumulation_steps: f.gradient_accumulation_steps,
            num_machines: f.num_machines,
            machine_rank: f.machine_rank,
            main_process_ip: f.main_process_ip,
            main_process_port: f.main_process_port,
            max_restarts: f.max_restarts,
            collective_timeout: f.collective_timeout,
            debug_sync: f.debug_sync,
            preempt_signals: f.preempt_signals,
            preempt_grace: f.preempt_grace,
            requeue_exit_code: f.requeue_exit_code,
            ..Settings::default()
        };
        let mut command = f.command.into_iter();
        Ok(cli::Parsed::Args(Box::new(LaunchArgs {
            settings,
            config_file: f.config_file.map(PathBuf::from),
            dry_run: f.dry_run.unwrap_or(false),
            program: command.next(),
            program_args: command.collect(),
        })))
    }
}
