//! Asking questions: arrow-key menus (`dialoguer`) on a terminal, plain numbered prompts read
//! line by line otherwise, so a script can pipe the answers in. Both check answers the same way.

use ivme::{Error, Result};
use std::io::{BufRead, Write};

/// Turns an answer into a value or says what is wrong with it.
pub type Check<'a> = &'a dyn Fn(&str) -> std::result::Result<(), String>;

/// One way of asking questions.
pub trait Prompter {
    /// Asks to pick one of `options`; returns its index.
    fn select(&mut self, question: &str, options: &[&str], default: usize) -> Result<usize>;
    /// Asks a yes/no question.
    fn confirm(&mut self, question: &str, default: bool) -> Result<bool>;
    /// Asks for text that `check` accepts; an empty answer takes `default` when there is one.
    fn text(&mut self, question: &str, default: Option<&str>, check: Check<'_>) -> Result<String>;
    /// Tells the user something without asking.
    fn say(&mut self, line: &str);
}

/// Bad answers in a row after which a piped script is assumed to be wrong rather than slow.
const MAX_TRIES: usize = 5;

/// Prompts written to `out` with answers read one per line from `input`.
pub struct Lines<R, W> {
    input: R,
    out: W,
    echo: bool,
}

impl<R: BufRead, W: Write> Lines<R, W> {
    /// Asks on `out`, reads from `input`; with `echo`, each answer is repeated after its
    /// question, so that a transcript of piped answers reads like a conversation.
    pub fn new(input: R, out: W, echo: bool) -> Self {
        Lines { input, out, echo }
    }

    /// Asks until `parse` accepts an answer; the empty answer is passed as `""`.
    fn ask<T>(
        &mut self,
        prompt: &str,
        mut parse: impl FnMut(&str) -> std::result::Result<T, String>,
    ) -> Result<T> {
        let mut last_complaint = String::new();
        for _ in 0..MAX_TRIES {
            let _ = write!(self.out, "{prompt}: ");
            let _ = self.out.flush();
            let mut line = String::new();
            let n = self
                .input
                .read_line(&mut line)
                .map_err(|e| Error::io("reading an answer from standard input", e))?;
            if n == 0 {
                let _ = writeln!(self.out);
                return Err(Error::Usage(format!(
                    "the answers ended before the question `{prompt}` was answered{last_complaint}; \
                     give one answer per line (an empty line takes the default)"
                )));
            }
            if self.echo {
                let _ = writeln!(self.out, "{}", line.trim());
            }
            match parse(line.trim()) {
                Ok(v) => return Ok(v),
                Err(why) => {
                    let _ = writeln!(self.out, "  {why}; try again");
                    last_complaint = format!(" (the last answer was refused: {why})");
                }
            }
        }
        Err(Error::Usage(format!(
            "{MAX_TRIES} answers in a row were refused for `{prompt}`{last_complaint}"
        )))
    }
}

impl<R: BufRead, W: Write> Prompter for Lines<R, W> {
    fn select(&mut self, question: &str, options: &[&str], default: usize) -> Result<usize> {
        let _ = writeln!(self.out, "{question}");
        for (i, o) in options.iter().enumerate() {
            let _ = writeln!(self.out, "  {}) {o}", i + 1);
        }
        let prompt = format!(
            "choose 1-{} or a name [{}]",
            options.len(),
            options[default]
        );
        let names = options.join(", ");
        self.ask(&prompt, |a| {
            if a.is_empty() {
                return Ok(default);
            }
            let norm = |s: &str| s.to_ascii_lowercase().replace(['-', ' '], "_");
            if let Some(i) = a
                .parse::<usize>()
                .ok()
                .filter(|i| (1..=options.len()).contains(i))
            {
                return Ok(i - 1);
            }
            options
                .iter()
                .position(|o| {
                    norm(o) == norm(a) || norm(o).split('_').next() == Some(norm(a).as_str())
                })
                .ok_or_else(|| {
                    format!(
                        "`{a}` is not one of the choices: {names} (or 1-{})",
                        options.len()
                    )
                })
        })
    }

    fn confirm(&mut self, question: &str, default: bool) -> Result<bool> {
        let shown = if default { "Y/n" } else { "y/N" };
        self.ask(&format!("{question} [{shown}]"), |a| {
            match a.to_ascii_lowercase().as_str() {
                "" => Ok(default),
                "y" | "yes" | "true" | "1" => Ok(true),
                "n" | "no" | "false" | "0" => Ok(false),
                _ => Err(format!("`{a}` is not yes or no; answer yes, no, y or n")),
            }
        })
    }

    fn text(&mut self, question: &str, default: Option<&str>, check: Check<'_>) -> Result<String> {
        let prompt = match default {
            Some(d) if !d.is_empty() => format!("{question} [{d}]"),
            _ => question.to_string(),
        };
        self.ask(&prompt, |a| {
            let a = if a.is_empty() {
                default.unwrap_or("")
            } else {
                a
            };
            check(a).map(|()| a.to_string())
        })
    }

    fn say(&mut self, line: &str) {
        let _ = writeln!(self.out, "{line}");
    }
}

/// Menus and line editing on a terminal, through `dialoguer`.
pub struct Terminal {
    theme: dialoguer::theme::ColorfulTheme,
}

impl Terminal {
    /// A prompter for an interactive terminal.
    pub fn new() -> Self {
        Terminal {
            theme: dialoguer::theme::ColorfulTheme::default(),
        }
    }
}

fn failed(e: dialoguer::Error) -> Error {
    Error::Usage(format!(
        "the question could not be asked on this terminal ({e}); pipe the answers in instead"
    ))
}

impl Prompter for Terminal {
    fn select(&mut self, question: &str, options: &[&str], default: usize) -> Result<usize> {
        dialoguer::Select::with_theme(&self.theme)
            .with_prompt(question)
            .items(options)
            .default(default)
            .interact()
            .map_err(failed)
    }

    fn confirm(&mut self, question: &str, default: bool) -> Result<bool> {
        dialoguer::Confirm::with_theme(&self.theme)
            .with_prompt(question)
            .default(default)
            .interact()
            .map_err(failed)
    }

    fn text(&mut self, question: &str, default: Option<&str>, check: Check<'_>) -> Result<String> {
        let mut input = dialoguer::Input::<String>::with_theme(&self.theme)
            .with_prompt(question)
            .allow_empty(true)
            .validate_with(|a: &String| check(a.trim()));
        if let Some(d) = default {
            input = input.default(d.to_string());
        }
        input
            .interact_text()
            .map(|a| a.trim().to_string())
            .map_err(failed)
    }

    fn say(&mut self, line: &str) {
        eprintln!("{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(answers: &str) -> Lines<&[u8], Vec<u8>> {
        Lines::new(answers.as_bytes(), Vec::new(), false)
    }

    #[test]
    fn choices_by_number_name_or_default() {
        let mut p = lines("2\nBF16\n\nfp8\nno\n");
        let opts = ["no", "fp16", "bf16"];
        assert_eq!(p.select("precision?", &opts, 0).unwrap(), 1);
        assert_eq!(p.select("precision?", &opts, 0).unwrap(), 2);
        assert_eq!(p.select("precision?", &opts, 2).unwrap(), 2);
        assert_eq!(p.select("precision?", &opts, 1).unwrap(), 0);
        let shown = String::from_utf8(p.out).unwrap();
        assert!(
            shown.contains("`fp8` is not one of the choices: no, fp16, bf16"),
            "{shown}"
        );
    }

    #[test]
    fn text_is_checked_and_reasked() {
        let mut p = lines("zero\n3\n\n");
        let check = |a: &str| {
            a.parse::<u32>()
                .map(|_| ())
                .map_err(|_| format!("`{a}` is not a number"))
        };
        assert_eq!(p.text("count?", Some("1"), &check).unwrap(), "3");
        assert_eq!(p.text("count?", Some("1"), &check).unwrap(), "1");
        assert!(String::from_utf8(p.out)
            .unwrap()
            .contains("`zero` is not a number; try again"));
    }

    #[test]
    fn running_out_of_answers_or_patience_is_an_error() {
        let mut p = lines("maybe\n");
        let e = p.confirm("cpu?", true).unwrap_err().to_string();
        assert!(
            e.contains("answers ended") && e.contains("`maybe` is not yes or no"),
            "{e}"
        );
        let mut p = lines("x\nx\nx\nx\nx\nx\n");
        let e = p.select("q", &["a", "b"], 0).unwrap_err().to_string();
        assert!(e.contains("5 answers in a row were refused"), "{e}");
    }
}
