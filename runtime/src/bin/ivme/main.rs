//! The `ivme` command: start training programs on one or many processes.
//!
//! Each subcommand lives in its own module with a `main(&[String]) -> Result<i32>`; this file
//! only picks one and turns its result into an exit status.

mod cli;
mod config_cmd;
mod env_cmd;
mod expand;
mod faults;
mod flags;
mod hosts;
mod invocation;
mod launch;
mod machines;
mod merge_cmd;
mod mpirun;
mod plan;
mod process;
mod prompt;
mod rank;
mod report;
mod selftest;
mod settings;
mod sources;
mod tuning;

use ivme::{Error, Result};
use std::process::ExitCode;

/// The visible subcommands with one line each, for `ivme --help`.
const COMMANDS: &[(&str, &str)] = &[
    (
        launch::COMMAND,
        "start a program on one or more processes (through mpirun for more than one)",
    ),
    (
        config_cmd::COMMAND,
        "answer a few questions once so that `ivme launch PROGRAM` needs no flags",
    ),
    (
        env_cmd::COMMAND,
        "print versions, hardware and config for a bug report",
    ),
    (
        selftest::COMMAND,
        "check that training works end to end on the configured processes",
    ),
    (
        expand::COMMAND,
        "print what #[accelerate] writes for a source file's functions, without compiling",
    ),
    (
        merge_cmd::COMMAND,
        "write a training checkpoint's weights (any layout) as a Hugging Face model folder",
    ),
];

fn usage() -> String {
    let width = COMMANDS.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
    let list: String = COMMANDS
        .iter()
        .map(|(n, h)| format!("  {n:width$}  {h}\n"))
        .collect();
    format!(
        "ivme {}: Accelerate-style distributed training for candle\n\n\
         Usage: ivme <COMMAND> [ARGS...]\n\nCommands:\n{list}\n\
         Run `ivme <COMMAND> --help` for a command's flags.\n",
        env!("CARGO_PKG_VERSION")
    )
}

fn run(argv: &[String]) -> Result<i32> {
    let Some((command, rest)) = argv.split_first() else {
        eprint!("{}", usage());
        return Ok(2);
    };
    match command.as_str() {
        launch::COMMAND => launch::main(rest),
        rank::COMMAND => rank::main(rest),
        config_cmd::COMMAND => config_cmd::main(rest),
        env_cmd::COMMAND => env_cmd::main(rest),
        expand::COMMAND => expand::main(rest),
        merge_cmd::COMMAND => merge_cmd::main(rest),
        selftest::COMMAND => selftest::main(rest),
        selftest::RANK_COMMAND => selftest::rank_main(rest),
        "-h" | "--help" | "help" => {
            print!("{}", usage());
            Ok(0)
        }
        "-V" | "--version" => {
            println!("ivme {}", env!("CARGO_PKG_VERSION"));
            Ok(0)
        }
        other => {
            let hint = cli::closest(other, COMMANDS.iter().map(|(n, _)| *n))
                .map(|c| format!("did you mean `ivme {c}`? "))
                .unwrap_or_default();
            let names: Vec<&str> = COMMANDS.iter().map(|(n, _)| *n).collect();
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
