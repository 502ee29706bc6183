//! Flag parsing shared by the `ivme` subcommands, on clap's derive.
//!
//! Each subcommand declares its flags as a `#[derive(Parser)]` struct with snake_case names;
//! [`parse_with`] accepts the kebab-case spelling too (`--num-processes`, `--num_processes=2`), and
//! turns clap's refusals into ivme's: the flag as typed, the nearest real flag, the value to
//! write. Launch stops reading flags at the program: everything from it on is the program's.

use clap::builder::TypedValueParser;
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{Arg, ArgMatches, Command, CommandFactory, FromArgMatches};
use ivme::{Error, Result};
use std::ffi::OsStr;

/// An example value for each flag that takes one and is not a launch setting (the settings'
/// examples are in their rows, table.rs), used in error messages.
const EXAMPLES: &[(&str, &str)] = &[
    ("config_file", "ivme.toml"),
    ("max_shard_size", "2GB"),
    ("dtype", "bf16"),
    ("adapter", "lora-out"),
    ("base", "pretrained"),
    ("checkpoint_dir", "/shared/ivme-test"),
    ("out", "runs/profile/profile.svg"),
    ("steps", "4"),
    ("metric", "loss"),
];

/// The value name that makes a flag a switch (an `Option<bool>` field): `--cpu` alone means
/// on, and `--cpu=false` (or `=0`, `=no`, `=off`) says off.
pub const SWITCH: &str = "on|off";

/// What a command line asked for.
#[derive(Debug, PartialEq)]
pub enum Parsed<T> {
    /// `--help` or `-h`: the help text to print, and nothing to run.
    Help(String),
    /// The flags and arguments given.
    Args(T),
}

/// Reads the words after `ivme <command>` by the flags of `cmd`, then into a value by `read`,
/// or the help text for `--help`; `examples` gives a flag's example value for error messages.
pub fn parse_with<T>(
    command: &str,
    cmd: Command,
    words: &[String],
    examples: fn(&str) -> &'static str,
    read: impl FnOnce(&ArgMatches) -> std::result::Result<T, clap::Error>,
) -> Result<Parsed<T>> {
    let mut cmd = cmd
        .name(format!("ivme {command}"))
        .no_binary_name(true)
        .disable_version_flag(true)
        .mut_args(|a| {
            // A value may start with one dash (`-3s`, refused by its parser with a reason);
            // a word starting with two is a flag, which [`Checked`] says is no value.
            let a = match a.get_long() {
                Some(long) if a.get_action().takes_values() => {
                    debug_assert!(
                        !examples(long).is_empty() || a.get_value_names() == Some(&[SWITCH.into()]),
                        "`--{long}` has no example in cli::EXAMPLES or its row"
                    );
                    a.allow_hyphen_values(true)
                }
                _ => a,
            };
            let a = match a.get_value_names() {
                Some([name]) if name == SWITCH => a
                    .num_args(0..=1)
                    .require_equals(true)
                    .default_missing_value("true")
                    .value_parser(Checked::new(crate::values::switch)),
                _ => a,
            };
            match a.get_long().map(|l| l.replace('_', "-")) {
                Some(kebab) if Some(kebab.as_str()) != a.get_long() => a.alias(kebab),
                _ => a,
            }
        });
    cmd.build();
    let matches: ArgMatches = match cmd.clone().try_get_matches_from(words) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::DisplayHelp => {
            return Ok(Parsed::Help(e.render().to_string()))
        }
        Err(e) => return Err(refusal(command, &cmd, &e, examples)),
    };
    read(&matches)
        .map(Parsed::Args)
        .map_err(|e| refusal(command, &cmd, &e, examples))
}

/// Reads the words after `ivme <command>` into `T`, printing the help text for `--help` (then
/// `None`: nothing more to do).
pub fn read<T: CommandFactory + FromArgMatches>(
    command: &str,
    words: &[String],
) -> Result<Option<T>> {
    read_with(command, words, example)
}

/// [`read`] with the example values of `examples` (for a command with launch settings' flags).
pub fn read_with<T: CommandFactory + FromArgMatches>(
    command: &str,
    words: &[String],
    examples: fn(&str) -> &'static str,
) -> Result<Option<T>> {
    let read = |m: &ArgMatches| T::from_arg_matches(m);
    Ok(
        match parse_with(command, T::command(), words, examples, read)? {
            Parsed::Help(text) => {
                print!("{text}");
                None
            }
            Parsed::Args(flags) => Some(flags),
        },
    )
}

/// Spells a flag the way users type it in errors and help.
pub fn spelled(name: &str) -> String {
    format!("--{name}")
}

/// The example value of a flag that is not a launch setting.
pub fn example(name: &str) -> &'static str {
    EXAMPLES
        .iter()
        .find(|(n, _)| *n == name)
        .map_or("", |(_, e)| e)
}

/// What to say when `arg` was given without its value; `ex` is an example value.
fn needs_value(arg: &Arg, ex: &str) -> String {
    let name = arg.get_long().unwrap_or_default();
    let flag = spelled(name);
    let what = arg
        .get_value_names()
        .and_then(|v| v.first().map(ToString::to_string))
        .unwrap_or_else(|| "value".into());
    match ex {
        "" => format!("`{flag}` needs a {what}"),
        ex => format!("`{flag}` needs a {what}, e.g. `{flag} {ex}`"),
    }
}

/// ivme's words for what clap refused.
fn refusal(
    command: &str,
    cmd: &Command,
    e: &clap::Error,
    examples: fn(&str) -> &'static str,
) -> Error {
    let context = |kind| match e.get(kind) {
        Some(ContextValue::String(s)) => s.as_str(),
        _ => "",
    };
    if let Some(ContextValue::String(ours)) = e.get(ContextKind::Custom) {
        return Error::Usage(ours.clone());
    }
    // clap writes the flag with its value's name (`--num_processes <count>`).
    let typed = context(ContextKind::InvalidArg);
    let flag = typed.split([' ', '[', '=']).next().unwrap_or(typed);
    let name = flag.trim_start_matches('-');
    let message = match e.kind() {
        ErrorKind::UnknownArgument if flag.starts_with('-') => {
            let longs = cmd.get_arguments().filter_map(Arg::get_long);
            let hint = closest(&name.replace('-', "_"), longs)
                .map(|s| format!("did you mean `{}`? ", spelled(s)))
                .unwrap_or_default();
            let takes_a_program = cmd.get_arguments().any(Arg::is_trailing_var_arg_set);
            let program = match takes_a_program {
                true => " (flags for your program go after the program's name)",
                false => "",
            };
            format!(
                "unknown flag `{flag}` for `ivme {command}`; {hint}run `ivme {command} --help` \
                 for the flags it takes{program}"
            )
        }
        ErrorKind::UnknownArgument => {
            format!("`ivme {command}` takes no `{flag}`; run `ivme {command} --help`")
        }
        ErrorKind::ArgumentConflict if context(ContextKind::PriorArg) == typed => {
            format!("`{flag}` is given twice; keep one")
        }
        ErrorKind::InvalidValue if context(ContextKind::InvalidValue).is_empty() => {
            match cmd.get_arguments().find(|a| a.get_long() == Some(name)) {
                Some(arg) => needs_value(arg, examples(name)),
                None => format!("`{flag}` needs a value"),
            }
        }
        _ => format!("{}; run `ivme {command} --help`", in_clap_words(e)),
    };
    Error::Usage(message)
}

/// Anything else in clap's own words, without its `error: ` and usage lines.
pub fn in_clap_words(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let first = text.lines().next().unwrap_or_default();
    first.trim_start_matches("error: ").to_string()
}

/// The candidate nearest to `word` when it is close enough to be a likely typo (the settings
/// table's one suggester, which the attribute uses too).
pub fn closest<'a>(word: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    ivme_settings::spelling::closest(word, candidates)
}

/// A flag's value parser: `check(flag, raw, example)` reads the value or says what to write.
#[derive(Clone, Copy)]
pub struct Checked<T> {
    check: fn(&str, &str, &str) -> std::result::Result<T, String>,
    /// The flag's example value; `None` looks it up in [`EXAMPLES`].
    example: Option<&'static str>,
}

impl<T> Checked<T> {
    /// A parser whose example value is the flag's in [`EXAMPLES`].
    pub fn new(check: fn(&str, &str, &str) -> std::result::Result<T, String>) -> Checked<T> {
        Checked {
            check,
            example: None,
        }
    }

    /// A parser with its own example value.
    pub fn with_example(
        check: fn(&str, &str, &str) -> std::result::Result<T, String>,
        example: &'static str,
    ) -> Checked<T> {
        Checked {
            check,
            example: Some(example),
        }
    }
}

impl<T: Clone + Send + Sync + 'static> TypedValueParser for Checked<T> {
    type Value = T;

    fn parse_ref(
        &self,
        _cmd: &Command,
        arg: Option<&Arg>,
        value: &OsStr,
    ) -> std::result::Result<T, clap::Error> {
        let name = arg.and_then(Arg::get_long).unwrap_or_default();
        let ex = self.example.unwrap_or_else(|| example(name));
        let raw = value.to_string_lossy();
        let checked = match (raw.starts_with("--"), arg) {
            (true, Some(arg)) => Err(needs_value(arg, ex)),
            _ => (self.check)(&spelled(name), &raw, ex),
        };
        checked.map_err(|message| {
            let mut e = clap::Error::new(ErrorKind::ValueValidation);
            e.insert(ContextKind::Custom, ContextValue::String(message));
            e
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::values::{duration, positive, restarts};
    use clap::Parser;
    use ivme::{BufferSync, Precision};
    use std::time::Duration;

    #[derive(Parser, Debug, PartialEq)]
    #[command(rename_all = "snake_case")]
    struct Flags {
        #[arg(long, value_name = "count", value_parser = Checked::new(positive))]
        num_processes: Option<usize>,
        #[arg(long, value_name = SWITCH)]
        cpu: Option<bool>,
        #[arg(long, value_name = "count", value_parser = Checked::new(restarts))]
        max_restarts: Option<usize>,
        #[arg(long, value_name = "duration", value_parser = Checked::new(duration))]
        collective_timeout: Option<Duration>,
        #[arg(trailing_var_arg = true)]
        command: Vec<String>,
    }

    /// The examples of this test's flags (the launcher's come from their rows).
    fn examples(name: &str) -> &'static str {
        match name {
            "num_processes" => "2",
            "max_restarts" => "3",
            "collective_timeout" => "10m",
            _ => "",
        }
    }

    fn read(words: &[&str]) -> Result<Flags> {
        let words: Vec<String> = words.iter().map(|w| w.to_string()).collect();
        let read = |m: &ArgMatches| Flags::from_arg_matches(m);
        match parse_with("launch", Flags::command(), &words, examples, read)? {
            Parsed::Args(flags) => Ok(flags),
            Parsed::Help(text) => panic!("help for {words:?}: {text}"),
        }
    }

    fn refused(words: &[&str]) -> String {
        read(words).unwrap_err().to_string()
    }

    fn strings(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn dashes_underscores_and_equals_are_one_flag() {
        for words in [
            &["--num_processes", "2", "prog"][..],
            &["--num-processes", "2", "prog"],
            &["--num-processes=2", "prog"],
        ] {
            let f = read(words).unwrap();
            assert_eq!(f.num_processes, Some(2), "{words:?}");
            assert_eq!(f.command, strings(&["prog"]));
        }
    }

    #[test]
    fn everything_after_the_program_is_left_alone() {
        let f = read(&["--cpu", "prog", "--cpu", "--x=1"]).unwrap();
        assert_eq!(f.cpu, Some(true));
        assert_eq!(f.command, strings(&["prog", "--cpu", "--x=1"]));
        let f = read(&["--", "--weird-name"]).unwrap();
        assert_eq!(f.command, strings(&["--weird-name"]));
    }

    #[test]
    fn unknown_flags_suggest_the_nearest_one() {
        let msg = refused(&["--num_proceses", "2"]);
        assert!(msg.contains("unknown flag `--num_proceses`"), "{msg}");
        assert!(msg.contains("did you mean `--num_processes`"), "{msg}");
        let msg = refused(&["--num"]);
        assert!(msg.contains("did you mean `--num_processes`"), "{msg}");
        let msg = refused(&["--zzz"]);
        assert!(!msg.contains("did you mean"), "{msg}");
        assert!(msg.contains("ivme launch --help"), "{msg}");
    }

    #[test]
    fn a_value_flag_without_a_value_says_what_to_write() {
        let msg = refused(&["--num_processes"]);
        assert!(msg.contains("`--num_processes 2`"), "{msg}");
        let msg = refused(&["--num_processes", "--cpu"]);
        assert!(msg.contains("needs a count"), "{msg}");
        let msg = refused(&["--collective_timeout"]);
        assert!(
            msg.contains("needs a duration, e.g. `--collective_timeout 10m`"),
            "{msg}"
        );
    }

    #[test]
    fn repeated_flags_are_rejected() {
        let msg = refused(&["--cpu", "--cpu"]);
        assert!(msg.contains("given twice"), "{msg}");
    }

    #[test]
    fn switches_and_numbers_are_read() {
        assert_eq!(read(&["--cpu=no", "prog"]).unwrap().cpu, Some(false));
        assert_eq!(read(&["prog"]).unwrap().cpu, None);
        let msg = refused(&["--num_processes", "0"]);
        assert!(msg.contains("at least 1"), "{msg}");
        let msg = refused(&["--num_processes", "two"]);
        assert!(msg.contains("not a whole number"), "{msg}");
        let msg = refused(&["--cpu=maybe"]);
        assert!(msg.contains("is not on or off"), "{msg}");
    }

    #[test]
    fn bad_fault_settings_say_what_to_write() {
        let msg = refused(&["--collective-timeout", "0"]);
        assert!(
            msg.contains("`--collective_timeout 0` is not a duration")
                && msg.contains("90, 90s, 10m, 1h, 500ms"),
            "{msg}"
        );
        let msg = refused(&["--max-restarts", "-1"]);
        assert!(
            msg.contains("`--max_restarts -1` is not a whole number"),
            "{msg}"
        );
        assert_eq!(read(&["--max_restarts=0"]).unwrap().max_restarts, Some(0));
        assert_eq!(read(&[]).unwrap().max_restarts, None);
    }

    #[test]
    fn the_library_and_the_attribute_spell_precisions_and_buffer_modes_alike() {
        assert_eq!(Precision::VALID, ivme_macros_core::PRECISIONS);
        assert_eq!(BufferSync::VALID, ivme_macros_core::BUFFER_MODES);
    }
}
