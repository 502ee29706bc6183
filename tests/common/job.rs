//! A launch of `ivme launch` as the fault tests drive it: in a process group of its own, with
//! its output collected, bounded in time and killed (with everything it started) on overrun or
//! when the test panics; and the `restartable` example's runs and reports.
#![allow(dead_code)]

use super::{example_bin, ivme_bin};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long any one launch may take before the test kills it.
pub const LIMIT: Duration = Duration::from_secs(180);

/// A launch running in a process group of its own, with its output collected in the background.
pub struct Job {
    child: Child,
    readers: Vec<std::thread::JoinHandle<String>>,
}

/// What a finished launch printed and how it ended.
pub struct Ended {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Ended {
    pub fn show(&self) -> String {
        format!(
            "status {:?}\nstdout:\n{}\nstderr:\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

pub fn drain(mut from: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = from.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

impl Job {
    /// Starts `ivme launch ARGS...` with extra environment variables.
    pub fn start(args: &[String], envs: &[(&str, &str)]) -> Job {
        let mut cmd = Command::new(ivme_bin());
        cmd.arg("launch")
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        let readers = vec![
            drain(child.stdout.take().unwrap()),
            drain(child.stderr.take().unwrap()),
        ];
        Job { child, readers }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the job's whole process group and reaps the launcher.
    pub fn kill(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the launcher to end, killing everything it started past `LIMIT`.
    pub fn wait(mut self) -> Ended {
        let deadline = Instant::now() + LIMIT;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("waiting for the launcher") {
                break Some(status);
            }
            if Instant::now() > deadline {
                self.kill();
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut texts = std::mem::take(&mut self.readers)
            .into_iter()
            .map(|r| r.join().unwrap_or_default());
        let (stdout, stderr) = (texts.next().unwrap(), texts.next().unwrap());
        match status {
            Some(status) => Ended {
                status,
                stdout,
                stderr,
            },
            None => panic!("the launch ran past {LIMIT:?} and was killed\nstdout:\n{stdout}\nstderr:\n{stderr}"),
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // A test that panicked while the job ran must not leave it behind.
        if matches!(self.child.try_wait(), Ok(None)) {
            self.kill();
        }
    }
}

pub fn words(w: &[&str]) -> Vec<String> {
    w.iter().map(|s| s.to_string()).collect()
}

/// `ivme launch --num_processes 2 --cpu LAUNCH_ARGS... restartable PROJECT OUT PROGRAM_ARGS...`.
pub fn restartable(
    launch_args: &[&str],
    project: &Path,
    out: &Path,
    program_args: &[&str],
    envs: &[(&str, &str)],
) -> Job {
    let mut args = words(&["--num_processes", "2", "--cpu"]);
    args.extend(words(launch_args));
    args.push(example_bin("restartable").display().to_string());
    args.push(project.display().to_string());
    args.push(out.display().to_string());
    args.extend(words(program_args));
    Job::start(&args, envs)
}

/// The report rank 0 wrote at the end of a run.
pub fn report(out: &Path) -> Value {
    let path = out.join("params.json");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).expect("the report is JSON")
}

/// The final weights as bit patterns, so that equality means bit for bit.
pub fn weight_bits(report: &Value) -> BTreeMap<String, Vec<u32>> {
    let params: BTreeMap<String, Vec<f32>> =
        serde_json::from_value(report["params"].clone()).expect("a report has params");
    assert!(!params.is_empty(), "no weights in {report}");
    params
        .into_iter()
        .map(|(k, v)| (k, v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

/// `restartable` uninterrupted, then again with `program_args` and `envs` under
/// `--max_restarts 1` with rank 1 killed right after optimizer step 10: the first run's
/// report, the second's, and how the second ended (both must have succeeded).
pub fn uninterrupted_then_crashed(
    dir: &Path,
    program_args: &[&str],
    envs: &[(&str, &str)],
) -> (Value, Value, Ended) {
    let (a_project, a_out) = (dir.join("a-project"), dir.join("a-out"));
    let a = restartable(&[], &a_project, &a_out, &[], &[]).wait();
    assert!(
        a.status.success(),
        "the uninterrupted run failed\n{}",
        a.show()
    );
    let (b_project, b_out) = (dir.join("b-project"), dir.join("b-out"));
    let mut envs = envs.to_vec();
    envs.push(("IVME_TEST_DIE_AT", "10"));
    let b = restartable(
        &["--max_restarts", "1"],
        &b_project,
        &b_out,
        program_args,
        &envs,
    )
    .wait();
    assert!(b.status.success(), "the restarted run failed\n{}", b.show());
    (report(&a_out), report(&b_out), b)
}
