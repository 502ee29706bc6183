//! Flag scanning shared by the `ivme` subcommands.
//!
//! Flags come before the first positional argument; everything from that argument on belongs
//! to the program being launched, so `ivme launch train --lr 3` hands `--lr 3` to `train`.
//! `--num_processes`, `--num-processes` and `--num_processes=2` are the same flag.

use ivme::{Error, Result};
use ivme_macros_core::edit_distance;

/// Whether a flag stands alone or takes a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A switch such as `--cpu` (optionally `--cpu=false`).
    Switch,
    /// A flag followed by a value; the text names the value in help and errors.
    Value(&'static str),
}

/// One flag a subcommand accepts.
#[derive(Debug, Clone, Copy)]
pub struct Flag {
    /// The canonical name, with underscores and without the leading dashes.
    pub name: &'static str,
    /// Whether it takes a value.
    pub kind: Kind,
    /// One line for `--help`.
    pub help: &'static str,
    /// An example value used in error messages.
    pub example: &'static str,
}

/// What a command line held: the flags in the order given, then the positional arguments.
#[derive(Debug, Default, PartialEq)]
pub struct Scanned {
    /// Each flag's canonical name with its value (`None` for a bare switch).
    pub flags: Vec<(&'static str, Option<String>)>,
    /// The first positional argument and everything after it, untouched.
    pub rest: Vec<String>,
    /// Whether `--help` or `-h` was given.
    pub help: bool,
}

impl Scanned {
    /// The value given for `name`, if the flag was present.
    pub fn value(&self, name: &str) -> Option<&str> {
        self.flags
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| v.as_deref())
    }

    /// Whether the flag `name` was present at all.
    pub fn has(&self, name: &str) -> bool {
        self.flags.iter().any(|(n, _)| *n == name)
    }
}

/// Spells a flag the way users type it in errors and help.
pub fn spelled(name: &str) -> String {
    format!("--{name}")
}

/// Splits `args` into known flags and the positional rest; `command` names the subcommand in
/// error messages.
pub fn scan(command: &str, specs: &[Flag], args: &[String]) -> Result<Scanned> {
    let mut out = Scanned::default();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        if arg == "--" {
            out.rest.extend(args[i..].iter().cloned());
            break;
        }
        if arg == "-h" || arg == "--help" {
            out.help = true;
            continue;
        }
        if !arg.starts_with('-') || arg == "-" {
            out.rest.extend(args[i - 1..].iter().cloned());
            break;
        }
        let body = arg.trim_start_matches('-');
        let (raw_name, inline) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (body, None),
        };
        let name = raw_name.replace('-', "_");
        let Some(spec) = specs.iter().find(|s| s.name == name) else {
            return Err(unknown_flag(command, arg, &name, specs));
        };
        if out.has(spec.name) {
            return Err(Error::Usage(format!(
                "`{}` is given twice; keep one",
                spelled(spec.name)
            )));
        }
        let value = match (spec.kind, inline) {
            (Kind::Switch, v) => v,
            (Kind::Value(_), Some(v)) => Some(v),
            (Kind::Value(what), None) => match args.get(i) {
                Some(v) if !v.starts_with("--") => {
                    i += 1;
                    Some(v.clone())
                }
                _ => {
                    return Err(Error::Usage(format!(
                        "`{}` needs a {what}, e.g. `{} {}`",
                        spelled(spec.name),
                        spelled(spec.name),
                        spec.example
                    )))
                }
            },
        };
        out.flags.push((spec.name, value));
    }
    Ok(out)
}

/// Reads a switch: present without a value means on; `=true/false/1/0/yes/no` says explicitly.
pub fn switch(scanned: &Scanned, name: &str) -> Result<Option<bool>> {
    if !scanned.has(name) {
        return Ok(None);
    }
    match scanned.value(name).map(|v| v.trim().to_ascii_lowercase()) {
        None => Ok(Some(true)),
        Some(v) if ["1", "true", "yes", "on"].contains(&v.as_str()) => Ok(Some(true)),
        Some(v) if ["0", "false", "no", "off"].contains(&v.as_str()) => Ok(Some(false)),
        Some(v) => Err(Error::Usage(format!(
            "`{}={v}` is not on or off; write `{}` alone, or `{}=false`",
            spelled(name),
            spelled(name),
            spelled(name)
        ))),
    }
}

/// Reads a whole number of at least 1 for `name`.
pub fn positive(scanned: &Scanned, spec: &Flag) -> Result<Option<usize>> {
    let Some(raw) = scanned.value(spec.name) else {
        return Ok(None);
    };
    let flag = spelled(spec.name);
    match raw.trim().parse::<usize>() {
        Ok(0) => Err(Error::Usage(format!(
            "`{flag} 0` is not allowed: it must be at least 1, e.g. `{flag} {}`",
            spec.example
        ))),
        Ok(n) => Ok(Some(n)),
        Err(_) => Err(Error::Usage(format!(
            "`{flag} {raw}` is not a whole number; write e.g. `{flag} {}`",
            spec.example
        ))),
    }
}

fn unknown_flag(command: &str, arg: &str, name: &str, specs: &[Flag]) -> Error {
    let hint = closest(name, specs.iter().map(|s| s.name))
        .map(|s| format!("did you mean `{}`? ", spelled(s)))
        .unwrap_or_default();
    Error::Usage(format!(
        "unknown flag `{arg}` for `ivme {command}`; {hint}run `ivme {command} --help` for the \
         flags it takes (flags for your program go after the program's name)"
    ))
}

/// The candidate nearest to `word` when it is close enough to be a likely typo.
pub fn closest<'a>(word: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .map(|c| (edit_distance(word, c), c))
        // About one edit in three letters still reads as a typo; more is a different word.
        .filter(|(d, c)| {
            (*d <= (c.len() / 3).max(1) && *d < word.len())
                || (c.starts_with(word) && word.len() >= 3)
        })
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// Formats the flag table for `--help`.
pub fn help_table(specs: &[Flag]) -> String {
    let lines: Vec<(String, &str)> = specs
        .iter()
        .map(|s| match s.kind {
            Kind::Switch => (spelled(s.name), s.help),
            Kind::Value(what) => (format!("{} <{what}>", spelled(s.name)), s.help),
        })
        .collect();
    let width = lines.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    lines
        .iter()
        .map(|(l, h)| format!("  {l:width$}  {h}\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPECS: &[Flag] = &[
        Flag {
            name: "num_processes",
            kind: Kind::Value("count"),
            help: "",
            example: "2",
        },
        Flag {
            name: "cpu",
            kind: Kind::Switch,
            help: "",
            example: "",
        },
    ];

    fn args(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn dashes_underscores_and_equals_are_one_flag() {
        for words in [
            &["--num_processes", "2", "prog"][..],
            &["--num-processes", "2", "prog"],
            &["--num-processes=2", "prog"],
        ] {
            let s = scan("launch", SPECS, &args(words)).unwrap();
            assert_eq!(s.value("num_processes"), Some("2"), "{words:?}");
            assert_eq!(s.rest, args(&["prog"]));
        }
    }

    #[test]
    fn everything_after_the_program_is_left_alone() {
        let s = scan("launch", SPECS, &args(&["--cpu", "prog", "--cpu", "--x=1"])).unwrap();
        assert_eq!(s.flags, vec![("cpu", None)]);
        assert_eq!(s.rest, args(&["prog", "--cpu", "--x=1"]));
        let s = scan("launch", SPECS, &args(&["--", "--weird-name"])).unwrap();
        assert_eq!(s.rest, args(&["--weird-name"]));
    }

    #[test]
    fn unknown_flags_suggest_the_nearest_one() {
        let e = scan("launch", SPECS, &args(&["--num_proceses", "2"])).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("unknown flag `--num_proceses`"), "{msg}");
        assert!(msg.contains("did you mean `--num_processes`"), "{msg}");
        let msg = scan("launch", SPECS, &args(&["--num"]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("did you mean `--num_processes`"), "{msg}");
        let msg = scan("launch", SPECS, &args(&["--zzz"]))
            .unwrap_err()
            .to_string();
        assert!(!msg.contains("did you mean"), "{msg}");
        assert!(msg.contains("ivme launch --help"), "{msg}");
    }

    #[test]
    fn a_value_flag_without_a_value_says_what_to_write() {
        let msg = scan("launch", SPECS, &args(&["--num_processes"]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("`--num_processes 2`"), "{msg}");
        let msg = scan("launch", SPECS, &args(&["--num_processes", "--cpu"]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("needs a count"), "{msg}");
    }

    #[test]
    fn repeated_flags_are_rejected() {
        let msg = scan("launch", SPECS, &args(&["--cpu", "--cpu"]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("given twice"), "{msg}");
    }

    #[test]
    fn switches_and_numbers_are_read() {
        let s = scan(
            "launch",
            SPECS,
            &args(&["--cpu=no", "--num_processes", "0"]),
        )
        .unwrap();
        assert_eq!(switch(&s, "cpu").unwrap(), Some(false));
        let msg = positive(&s, &SPECS[0]).unwrap_err().to_string();
        assert!(msg.contains("at least 1"), "{msg}");
        let s = scan("launch", SPECS, &args(&["--num_processes", "two"])).unwrap();
        let msg = positive(&s, &SPECS[0]).unwrap_err().to_string();
        assert!(msg.contains("not a whole number"), "{msg}");
        let s = scan("launch", SPECS, &args(&["--cpu=maybe"])).unwrap();
        assert!(switch(&s, "cpu").is_err());
    }
}
