//! The command a launch plan runs: program, arguments and environment, and how `--dry_run`
//! prints it.

use crate::process;
use std::path::PathBuf;

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
    ///
    /// Every line but the variables and the command starts with `#`, so the report reads as a
    /// shell script.
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
