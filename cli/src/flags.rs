//! The flags of `ivme launch`, read into [`LaunchArgs`]: every field optional, so that the
//! environment and a config file can fill what the flags leave unset (sources.rs).

use crate::cli::{self, Checked};
use crate::mpirun;
use crate::settings::Settings;
use crate::table::ROWS;
use crate::values;
use clap::{Args, Command, FromArgMatches, Parser};
use ivme::Result;
use std::path::PathBuf;

/// The subcommand's name.
pub const COMMAND: &str = "launch";

// The settings' flags come from their rows (table.rs); these are the flags that only the
// command line has.
/// Start PROGRAM on one or more processes, with ivme's settings in its environment.
#[derive(Parser, Debug)]
#[command(
    rename_all = "snake_case",
    override_usage = "ivme launch [FLAGS] PROGRAM [ARGS...]",
    after_help = notes()
)]
struct Flags {
    /// the config file to read (default: $IVME_CONFIG, else ~/.config/ivme/default_config.toml)
    #[arg(long, value_name = "file", value_parser = Checked::new(values::text))]
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
         IVME_LAUNCHER=ivme, RAYON_NUM_THREADS (cores shared between the ranks on a machine, one\n\
         fewer with --overlap, unless already set), glibc allocator settings on Linux (MALLOC_MMAP_THRESHOLD_ and\n\
         MALLOC_TRIM_THRESHOLD_ unless set; IVME_MALLOC_TUNING=0 turns them off),\n\
         CANDLE_BARRIER_POOL_SPIN_LIMIT=1000 unless set (candle's idle CPU worker otherwise spins\n\
         a core away from the matrix products) and the variables of the settings given. Set {} to use a particular mpirun.\n\
         \nSettings come from flags, then these variables already in the environment:\n{},\n\
         then the config file (`ivme config`), then the defaults.\n\
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
        mpirun::MPIRUN_VAR,
        environment_layer()
    )
}

/// The variables of the settings that the launcher's own environment can give, for `--help`.
fn environment_layer() -> String {
    let vars: Vec<&str> = ROWS.iter().filter_map(|row| row.env_layer()).collect();
    let mut lines = String::new();
    let mut line = String::new();
    for var in vars {
        if !line.is_empty() && line.len() + var.len() > 88 {
            lines.push_str(line.trim_end());
            lines.push('\n');
            line.clear();
        }
        line.push_str(var);
        line.push(' ');
    }
    lines.push_str(line.trim_end());
    lines
}

/// A flag's example value for error messages: a launch setting's from its row, else the
/// other commands' (`cli::example`).
pub fn example(name: &str) -> &'static str {
    crate::table::row(name).map_or(cli::example(name), |r| r.example())
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
        let settings_flags = ROWS.iter().filter_map(|row| row.arg());
        let cmd = Flags::augment_args(Command::new(COMMAND).args(settings_flags));
        let read = |m: &clap::ArgMatches| {
            let mut settings = Settings::default();
            for row in ROWS {
                row.read_flag(m, &mut settings);
            }
            Ok((settings, Flags::from_arg_matches(m)?))
        };
        let examples =
            |name: &str| crate::table::row(name).map_or(cli::example(name), |r| r.example());
        let (settings, f) = match cli::parse_with(COMMAND, cmd, words, examples, read)? {
            cli::Parsed::Help(text) => return Ok(cli::Parsed::Help(text)),
            cli::Parsed::Args(parsed) => parsed,
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
