//! The `ivme` command: start training programs on one or many processes.
//!
//! Each subcommand lives in its own module with a `main(&[String]) -> Result<i32>` that reads
//! its flags (cli.rs); this file only picks one, on clap, and turns its result into an exit
//! status.

mod cli;
mod config_cmd;
mod elastic;
mod env_cmd;
mod expand;
mod faults;
mod flags;
mod hosts;
mod invocation;
mod launch;
mod lost;
mod machines;
mod merge_cmd;
mod mpirun;
mod plan;
mod process;
mod profile_cmd;
mod prompt;
mod rank;
mod reach;
mod report;
mod row;
mod selftest;
mod settings;
mod sources;
mod table;
mod tuning;
mod values;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use ivme::{Error, Result};
use std::process::ExitCode;

/// Accelerate-style distributed training for candle.
#[derive(Parser)]
#[command(
    name = "ivme",
    version,
    disable_help_subcommand = true,
    arg_required_else_help = true,
    after_help = "Run `ivme <COMMAND> --help` for a command's flags."
)]
struct Ivme {
    #[command(subcommand)]
    command: Commands,
}

/// The subcommands; each reads its own words (cli.rs).
#[derive(Subcommand)]
enum Commands {
    /// start a program on one or more processes (through mpirun for more than one)
    #[command(name = flags::COMMAND)]
    Launch(Words),
    /// answer a few questions once so that `ivme launch PROGRAM` needs no flags
    #[command(name = config_cmd::COMMAND)]
    Config(Words),
    /// print versions, hardware and config for a bug report
    #[command(name = env_cmd::COMMAND)]
    Env(Words),
    /// check that training works end to end on the configured processes
    #[command(name = selftest::COMMAND)]
    Test(Words),
    /// print what `#[accelerate]` writes for a source file's functions, without compiling
    #[command(name = expand::COMMAND)]
    Expand(Words),
    /// write a training checkpoint's weights (any layout) as a Hugging Face model folder
    #[command(name = merge_cmd::COMMAND)]
    MergeWeights(Words),
    /// summarise and draw a profile that `ivme launch --profile DIR` recorded
    #[command(name = profile_cmd::COMMAND)]
    Profile(Words),
    /// The launcher's wrapper around each rank.
    #[command(name = rank::COMMAND, hide = true)]
    Rank(Words),
    /// What every rank of `ivme test` runs.
    #[command(name = selftest::RANK_COMMAND, hide = true)]
    SelftestRank(Words),
}

/// The words after a subcommand's name, untouched.
#[derive(Args)]
#[command(disable_help_flag = true)]
struct Words {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    words: Vec<String>,
}

fn run(argv: &[String]) -> Result<i32> {
    // `ivme help launch` is `ivme launch --help`.
    let argv: Vec<String> = match argv.split_first() {
        Some((help, rest)) if help == "help" => {
            rest.iter().cloned().chain(["--help".into()]).collect()
        }
        _ => argv.to_vec(),
    };
    let top = std::iter::once("ivme".to_string()).chain(argv);
    let parsed = Ivme::command()
        .try_get_matches_from(top)
        .and_then(|m| Ivme::from_arg_matches(&m));
    let command = match parsed {
        Ok(ivme) => ivme.command,
        Err(e) => return refusal(&e),
    };
    match command {
        Commands::Launch(w) => launch::main(&w.words),
        Commands::Config(w) => config_cmd::main(&w.words),
        Commands::Env(w) => env_cmd::main(&w.words),
        Commands::Test(w) => selftest::main(&w.words),
        Commands::Expand(w) => expand::main(&w.words),
        Commands::MergeWeights(w) => merge_cmd::main(&w.words),
        Commands::Profile(w) => profile_cmd::main(&w.words),
        Commands::Rank(w) => rank::main(&w.words),
        Commands::SelftestRank(w) => selftest::rank_main(&w.words),
    }
}

/// Help and the version as asked, the usage on stderr for no command, ivme's words otherwise.
fn refusal(e: &clap::Error) -> Result<i32> {
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            print!("{}", e.render());
            Ok(0)
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            eprint!("{}", e.render());
            Ok(2)
        }
        _ => {
            let Some(ContextValue::String(other)) = e.get(ContextKind::InvalidSubcommand) else {
                return Err(Error::Usage(format!(
                    "{}; run `ivme --help`",
                    cli::in_clap_words(e)
                )));
            };
            let cmd = Ivme::command();
            let names: Vec<&str> = cmd
                .get_subcommands()
                .filter(|c| !c.is_hide_set())
                .map(|c| c.get_name())
                .collect();
            let hint = cli::closest(other, names.iter().copied())
                .map(|c| format!("did you mean `ivme {c}`? "))
                .unwrap_or_default();
            Err(Error::Usage(format!(
                "unknown command `{other}`; {hint}the commands are: {}; run `ivme --help`",
                names.join(", ")
            )))
        }
    }
}

fn main() -> ExitCode {
    // Lossy rather than a panic on non-UTF-8 arguments.
    let argv: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    match run(&argv) {
        Ok(code) => ExitCode::from(process::exit_byte(code)),
        Err(e) => {
            eprintln!("ivme: error: {e}");
            // Misuse gets the conventional usage-error status, other failures a plain 1.
            ExitCode::from(if matches!(e, Error::Usage(_)) { 2 } else { 1 })
        }
    }
}
