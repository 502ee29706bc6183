//! `ivme __rank`: the thin wrapper every rank runs under when mpirun starts the program.
//!
//! mpirun reports only that *some* process failed; the wrapper records which rank failed, with
//! what code and when, in a status folder the launcher reads after mpirun ends.

use crate::process::{self, Outcome};
use ivme::state::EnvLayout;
use ivme::{Error, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

/// The hidden subcommand's name.
pub const COMMAND: &str = "__rank";

/// The flag that names the status folder.
pub const STATUS_DIR_FLAG: &str = "--status-dir";

/// The variable that names the status folder to the rank's runtime.
const STATUS_DIR_VAR: &str = "IVME_STATUS_DIR";

/// The status file in which a rank's runtime names the peer it stopped for: `cause-R`.
const CAUSE_PREFIX: &str = "cause-";

/// The status files in which a rank's runtime says its failure would recur on a restart:
/// `final-R`, holding the error's message.
const FINAL_PREFIX: &str = "final-";

/// The failures that would recur on a restart, as ranks noted them in `dir` (rank, message),
/// in rank order; a missing folder means none.
pub fn recurring(dir: &Path) -> Vec<(usize, String)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut notes: Vec<(usize, String)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let rank = name.strip_prefix(FINAL_PREFIX)?.parse().ok()?;
            let text = std::fs::read_to_string(e.path()).ok()?;
            Some((rank, text.trim().to_string()))
        })
        .collect();
    notes.sort();
    notes
}

/// The code recorded when the program could not be started at all (the shell's convention).
const CANNOT_START: i32 = 127;

/// What starts a status file relayed on stderr: `ivme-status NAME HEX`, the file's name and its
/// bytes in hexadecimal, on one line.
const RELAY_MARK: &str = "ivme-status ";

/// The status files of `rank`: its failure, the peer it stopped for, a failure that would
/// recur, a preemption it stopped for.
fn status_files(rank: usize) -> [String; 4] {
    [
        Failure::file_name(rank),
        format!("{CAUSE_PREFIX}{rank}"),
        format!("{FINAL_PREFIX}{rank}"),
        format!("{}{rank}", ivme::preempt::MARKER_PREFIX),
    ]
}

/// Prints the status files `rank` left in `dir` on stderr, one relay line each. On another
/// machine the launcher's status folder is a folder of that machine: mpirun carries this
/// rank's stderr to the launcher, which writes the files into its own folder ([`receive`]).
fn relay(dir: &Path, rank: usize) {
    for name in status_files(rank) {
        if let Ok(bytes) = std::fs::read(dir.join(&name)) {
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            // One write, so that mpirun forwards the line whole.
            let line = format!("{RELAY_MARK}{name} {hex}\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        }
    }
}

/// Whether `line` (from mpirun's stderr) is a rank's relayed status file; if so, writes it into
/// `dir` (the launcher's status folder) unless a file of that name is there already. Only the
/// names of [`status_files`] are accepted.
pub fn receive(line: &str, dir: &Path) -> bool {
    let Some(at) = line.find(RELAY_MARK) else {
        return false;
    };
    let mut words = line[at + RELAY_MARK.len()..].split_whitespace();
    let (Some(name), hex) = (words.next(), words.next().unwrap_or("")) else {
        return false;
    };
    // Every status file's name ends in `-RANK`.
    let rank = name
        .rsplit_once('-')
        .and_then(|(_, r)| r.parse::<usize>().ok());
    let known = rank.is_some_and(|r| status_files(r).iter().any(|n| n == name));
    let bytes: Option<Vec<u8>> = (hex.len() % 2 == 0)
        .then(|| {
            (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
                .collect()
        })
        .flatten();
    let (true, Some(bytes)) = (known, bytes) else {
        return false;
    };
    let path = dir.join(name);
    if !path.exists() {
        let _ = std::fs::create_dir_all(dir);
        let _ = std::fs::write(path, bytes);
    }
    true
}

/// Whether this rank's launcher may be on another machine (`IVME_NUM_MACHINES` above 1).
fn on_several_machines() -> bool {
    std::env::var(ivme::env::NUM_MACHINES.name)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .is_some_and(|n| n > 1)
}

/// One rank's failure as recorded in the status folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The global rank that failed.
    pub rank: usize,
    /// Its shell-style exit code.
    pub code: i32,
    /// When it failed, in nanoseconds since the Unix epoch, to tell which rank failed first.
    pub at_nanos: u128,
    /// The signal that killed the program, if one did.
    pub signal: Option<i32>,
    /// The peer whose failure made this rank stop, as the rank's runtime recorded it
    /// (`cause-R` in the status folder): such a failure is a consequence, not a cause.
    pub because_of: Option<usize>,
}

impl Failure {
    fn file_name(rank: usize) -> String {
        format!("rank-{rank}")
    }

    /// Writes this failure into `dir`, creating the folder if needed.
    pub fn record(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let signal = self.signal.unwrap_or(0);
        let text = format!("{} {} {signal}\n", self.code, self.at_nanos);
        std::fs::write(dir.join(Self::file_name(self.rank)), text)
    }

    /// Reads every failure recorded in `dir`, earliest first; a missing folder means none.
    pub fn read_all(dir: &Path) -> Result<Vec<Failure>> {
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::io(format!("reading {}", dir.display()), e)),
        };
        let mut failures = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rank) = name.strip_prefix("rank-").and_then(|r| r.parse().ok()) else {
                continue;
            };
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let mut words = text.split_whitespace();
            let code = words.next().and_then(|w| w.parse().ok()).unwrap_or(1);
            let at_nanos = words
                .next()
                .and_then(|w| w.parse().ok())
                .unwrap_or(u128::MAX);
            let signal = words
                .next()
                .and_then(|w| w.parse().ok())
                .filter(|&s: &i32| s > 0);
            // The rank's runtime names the peer it stopped for, when it stopped for one.
            let because_of = std::fs::read_to_string(dir.join(format!("{CAUSE_PREFIX}{rank}")))
                .ok()
                .and_then(|t| t.trim().parse().ok());
            failures.push(Failure {
                rank,
                code,
                at_nanos,
                signal,
                because_of,
            });
        }
        // Ranks that failed on their own come first: a rank that only stopped because a peer
        // failed often exits before that peer has finished printing its error.
        failures.sort_by_key(|f| (f.because_of.is_some(), f.at_nanos, f.rank));
        Ok(failures)
    }

    /// How the rank's program ended.
    pub fn outcome(&self) -> Outcome {
        Outcome {
            code: self.code,
            signal: self.signal,
        }
    }

    /// Says how the rank ended: "rank 1 failed with exit code 137 (killed by signal 9)".
    pub fn describe(&self) -> String {
        format!(
            "rank {} failed with {}",
            self.rank,
            self.outcome().describe()
        )
    }
}

/// Says which rank failed first (and which others failed) and picks the launcher's exit code.
pub fn summarize(failures: &[Failure]) -> Option<(String, i32)> {
    let first = failures.first()?;
    let mut msg = format!(
        "ivme: rank {} failed first, with {}",
        first.rank,
        first.outcome().describe()
    );
    if failures.len() > 1 {
        let others: Vec<String> = failures[1..]
            .iter()
            .map(|f| {
                let why = f
                    .because_of
                    .map(|p| format!(" (it stopped because rank {p} failed)"))
                    .unwrap_or_default();
                format!("rank {} with {}{why}", f.rank, f.outcome().describe())
            })
            .collect();
        msg.push_str(&format!("; after it: {}", others.join(", ")));
    }
    msg.push_str("; its own messages are above");
    Some((msg, first.code))
}

/// The argument list that runs `program` under the wrapper (after the ivme executable).
pub fn wrapper_args(status_dir: &Path, program: &Path, args: &[String]) -> Vec<String> {
    let mut out = vec![
        COMMAND.to_string(),
        STATUS_DIR_FLAG.to_string(),
        status_dir.display().to_string(),
        "--".to_string(),
        program.display().to_string(),
    ];
    out.extend(args.iter().cloned());
    out
}

/// Parses `--status-dir DIR -- program args...`.
fn parse(args: &[String]) -> Result<(PathBuf, String, Vec<String>)> {
    let usage = || {
        Error::Usage(format!(
            "`ivme {COMMAND}` is started by `ivme launch`; run your program with \
             `ivme launch [flags] PROGRAM [ARGS...]` instead"
        ))
    };
    match args {
        [flag, dir, sep, program, rest @ ..] if flag == STATUS_DIR_FLAG && sep == "--" => {
            Ok((PathBuf::from(dir), program.clone(), rest.to_vec()))
        }
        _ => Err(usage()),
    }
}

/// This process's global rank from the MPI launcher's variables; a lone process is rank 0.
fn own_rank() -> usize {
    EnvLayout::from_env().ok().flatten().map_or(0, |l| l.rank)
}

/// Runs the wrapped program and returns the code this wrapper should exit with.
pub fn main(args: &[String]) -> Result<i32> {
    let (status_dir, program, program_args) = parse(args)?;
    let rank = own_rank();
    let mut cmd = Command::new(&program);
    // The runtime records there which peer's failure made this rank stop.
    cmd.args(&program_args).env(STATUS_DIR_VAR, &status_dir);
    // The launcher's relay (and a scheduler's own signal) reaches the program as a preemption;
    // the launcher bounds the stop by the grace period. SIGTERM keeps its meaning here, a stop
    // passed on as SIGTERM: it is how mpirun ends a job whose rank failed.
    let preempt = process::Preempt {
        signals: ivme::preempt::PreemptSettings::read(|k| std::env::var(k).ok())
            .map(|s| s.signals)
            .unwrap_or_default()
            .into_iter()
            .filter(|&s| s != libc::SIGTERM)
            .collect(),
        grace: None,
    };
    let outcome = match process::supervise(&mut cmd, &preempt) {
        Ok(outcome) => outcome,
        Err(e) => {
            eprintln!("ivme: rank {rank} could not start `{program}`: {e}");
            Outcome {
                code: CANNOT_START,
                signal: None,
            }
        }
    };
    // A rank mpirun told to stop (because another failed, or on Ctrl-C) did not fail itself.
    // A program that stopped for a preemption noted it: its error exit is not a failure, and
    // ending with 0 spares mpirun's second of tearing down a failed job.
    let code = ended(&status_dir, rank, &outcome);
    if on_several_machines() {
        relay(&status_dir, rank);
    }
    Ok(code)
}

/// Records how the program ended in `status_dir` and returns the wrapper's exit code.
fn ended(status_dir: &Path, rank: usize, outcome: &Outcome) -> i32 {
    let marker = status_dir.join(format!("{}{rank}", ivme::preempt::MARKER_PREFIX));
    if outcome.code != 0 && marker.is_file() {
        return 0;
    }
    if outcome.code != 0 && process::stopped_by().is_none() {
        eprintln!("ivme: rank {rank} failed with {}", outcome.describe());
        let at_nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let failure = Failure {
            rank,
            code: outcome.code,
            at_nanos,
            signal: outcome.signal,
            because_of: None,
        };
        if let Err(e) = failure.record(status_dir) {
            eprintln!(
                "ivme: rank {rank} could not record its failure in {}: {e}",
                status_dir.display()
            );
        }
    }
    outcome.code
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        std::env::temp_dir().join(format!("ivme-rank-test-{tag}-{}", std::process::id()))
    }

    #[test]
    fn a_rank_that_stopped_for_a_peer_is_not_named_first() {
        let dir = temp_dir("cause");
        let _ = std::fs::remove_dir_all(&dir);
        for (rank, at_nanos) in [(0, 100), (1, 900)] {
            Failure {
                rank,
                code: 1,
                at_nanos,
                signal: None,
                because_of: None,
            }
            .record(&dir)
            .unwrap();
        }
        // Rank 0 exited first, but only because rank 1 failed.
        std::fs::write(dir.join("cause-0"), "1\n").unwrap();
        let got = Failure::read_all(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(got.iter().map(|f| f.rank).collect::<Vec<_>>(), [1, 0]);
        let (msg, _) = summarize(&got).unwrap();
        assert!(msg.contains("rank 1 failed first"), "{msg}");
        assert!(
            msg.contains("rank 0 with exit code 1 (it stopped because rank 1 failed)"),
            "{msg}"
        );
    }

    #[test]
    fn failures_are_read_back_earliest_first() {
        let dir = temp_dir("order");
        let _ = std::fs::remove_dir_all(&dir);
        Failure {
            rank: 2,
            code: 143,
            at_nanos: 500,
            signal: Some(15),
            because_of: None,
        }
        .record(&dir)
        .unwrap();
        Failure {
            rank: 1,
            code: 3,
            at_nanos: 100,
            signal: None,
            because_of: None,
        }
        .record(&dir)
        .unwrap();
        std::fs::write(dir.join("unrelated"), "x").unwrap();
        let got = Failure::read_all(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            got.iter().map(|f| (f.rank, f.code)).collect::<Vec<_>>(),
            [(1, 3), (2, 143)]
        );
        let (msg, code) = summarize(&got).unwrap();
        assert_eq!(code, 3);
        assert!(
            msg.contains("rank 1 failed first, with exit code 3"),
            "{msg}"
        );
        assert!(
            msg.contains("after it: rank 2 with exit code 143 (killed by signal 15)"),
            "{msg}"
        );
        assert_eq!(got[0].describe(), "rank 1 failed with exit code 3");
        assert_eq!(
            got[1].describe(),
            "rank 2 failed with exit code 143 (killed by signal 15)"
        );
    }

    #[test]
    fn a_relayed_status_file_is_written_once_and_nothing_else_is_accepted() {
        let dir = temp_dir("relay");
        let _ = std::fs::remove_dir_all(&dir);
        // As mpirun passes it on, possibly after a prefix of its own.
        assert!(receive(
            "[1,3]<stderr>:ivme-status rank-3 3320313030300a\n",
            &dir
        ));
        assert_eq!(
            std::fs::read_to_string(dir.join("rank-3")).unwrap(),
            "3 1000\n"
        );
        // A file already there (written on this machine) is kept.
        assert!(receive("ivme-status rank-3 390a", &dir));
        assert_eq!(
            std::fs::read_to_string(dir.join("rank-3")).unwrap(),
            "3 1000\n"
        );
        assert!(receive("ivme-status cause-2 310a", &dir));
        assert_eq!(std::fs::read_to_string(dir.join("cause-2")).unwrap(), "1\n");
        for bad in [
            "an ordinary line",
            "ivme-status ../../etc/passwd 31",
            "ivme-status rank-x 31",
            "ivme-status other-3 31",
            "ivme-status final-1 3",
            "ivme-status final-1 zz",
        ] {
            assert!(!receive(bad, &dir), "{bad}");
        }
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn no_folder_and_no_failures_mean_success() {
        assert!(Failure::read_all(&temp_dir("missing")).unwrap().is_empty());
        assert!(summarize(&[]).is_none());
    }

    #[test]
    fn wrapper_arguments_parse_back() {
        let args = wrapper_args(Path::new("/tmp/s"), Path::new("/bin/prog"), &["--x".into()]);
        assert_eq!(args[0], COMMAND);
        let (dir, prog, rest) = parse(&args[1..]).unwrap();
        assert_eq!(dir, PathBuf::from("/tmp/s"));
        assert_eq!(prog, "/bin/prog");
        assert_eq!(rest, vec!["--x".to_string()]);
        assert!(parse(&["prog".to_string()]).is_err());
    }

    #[test]
    fn a_failing_program_is_recorded_with_its_code() {
        let dir = temp_dir("run");
        let _ = std::fs::remove_dir_all(&dir);
        let args: Vec<String> = [
            STATUS_DIR_FLAG,
            dir.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            "exit 5",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(main(&args).unwrap(), 5);
        let got = Failure::read_all(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].code, 5);
    }
}
