//! Helpers shared by the multi-process integration tests: where the built binaries are, and how
//! to start a program on several processes through `ivme launch`.
//!
//! These tests run real binaries that `cargo test` does not build for this package: run
//! `cargo build --workspace --bins --examples` first.

pub mod job;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The build folder the running test binary lives in (`target/debug` for `target/debug/deps/x`).
#[allow(dead_code)]
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary knows its own path");
    let deps = exe.parent().expect("the test binary lives in a folder");
    // Integration tests live in target/<profile>/deps; step out of `deps`.
    if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().expect("deps has a parent").to_path_buf()
    } else {
        deps.to_path_buf()
    }
}

fn built(path: PathBuf, what: &str) -> PathBuf {
    assert!(
        path.is_file(),
        "{what} is not built at {}: run `cargo build --workspace --bins --examples` first",
        path.display()
    );
    path
}

/// The `ivme` command-line binary.
#[allow(dead_code)]
pub fn ivme_bin() -> PathBuf {
    built(
        target_dir().join(format!("ivme{}", std::env::consts::EXE_SUFFIX)),
        "the `ivme` binary",
    )
}

/// A built example program, `target/<profile>/examples/<name>`.
#[allow(dead_code)]
pub fn example_bin(name: &str) -> PathBuf {
    let file = format!("{name}{}", std::env::consts::EXE_SUFFIX);
    built(
        target_dir().join("examples").join(file),
        &format!("the example `{name}`"),
    )
}

/// Runs `ivme launch --num_processes n --cpu program args...` with extra environment variables
/// and returns what it printed and how it ended.
#[allow(dead_code)]
pub fn launch(n: usize, program: &Path, args: &[&str], envs: &[(&str, &str)]) -> Output {
    let n = n.to_string();
    let mut cmd = Command::new(ivme_bin());
    cmd.args(["launch", "--num_processes", &n, "--cpu"])
        .arg(program)
        .args(args)
        .envs(envs.iter().copied());
    cmd.output()
        .unwrap_or_else(|e| panic!("could not run `{cmd:?}`: {e}"))
}

/// The process's stdout and stderr as text, for assertions and failure messages.
#[allow(dead_code)]
pub fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A fresh, empty path under the temp folder for one test's files.
#[allow(dead_code)]
pub fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ivme-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Runs the example `name` on `n` processes with `args` plus `out=DIR`, checks it succeeded,
/// and returns the JSON report each rank wrote to `DIR/rank{R}.json`, in rank order (ranks that
/// wrote none are left out).
#[allow(dead_code)]
pub fn run_reports(n: usize, name: &str, args: &[&str], out: &Path) -> Vec<serde_json::Value> {
    let out_arg = format!("out={}", out.display());
    let mut all: Vec<&str> = args.to_vec();
    all.push(&out_arg);
    let o = launch(n, &example_bin(name), &all, &[]);
    let (so, se) = text(&o);
    assert!(
        o.status.success(),
        "{name} {args:?} failed\nstdout:\n{so}\nstderr:\n{se}"
    );
    (0..n)
        .filter_map(|r| std::fs::read(out.join(format!("rank{r}.json"))).ok())
        .map(|b| serde_json::from_slice(&b).expect("a rank's report is JSON"))
        .collect()
}

/// Like [`run_reports`] in a scratch folder that is removed afterwards; every rank must report.
#[allow(dead_code)]
pub fn reports(n: usize, name: &str, args: &[&str], tag: &str) -> Vec<serde_json::Value> {
    let out = scratch(tag);
    let r = run_reports(n, name, args, &out);
    let _ = std::fs::remove_dir_all(&out);
    assert_eq!(
        r.len(),
        n,
        "{name} {args:?}: only {} of {n} ranks reported",
        r.len()
    );
    r
}

/// The `params` of a report: variable name → flattened values.
#[allow(dead_code)]
pub fn params(report: &serde_json::Value) -> std::collections::BTreeMap<String, Vec<f32>> {
    serde_json::from_value(report["params"].clone()).expect("a report has params")
}

/// Every variable of `varmap`, flattened and concatenated in name order.
#[allow(dead_code)]
pub fn flat_weights(varmap: &candle_nn::VarMap) -> Vec<f32> {
    let data = varmap.data().lock().expect("varmap lock");
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    names
        .iter()
        .flat_map(|n| {
            data[*n]
                .as_tensor()
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("f32 weights")
        })
        .collect()
}

/// A fresh folder under the temp dir, removed when dropped.
#[allow(dead_code)]
pub struct Scratch(pub PathBuf);

#[allow(dead_code)]
impl Scratch {
    /// Creates `ivme-{tag}-{pid}` empty.
    pub fn new(tag: &str) -> Scratch {
        let p = scratch(tag);
        std::fs::create_dir_all(&p).expect("creating a scratch folder");
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Asserts the command succeeded and returns its stdout.
#[allow(dead_code)]
pub fn ok(out: &Output) -> String {
    let (stdout, stderr) = text(out);
    assert!(
        out.status.success(),
        "ivme failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    stdout
}

/// Asserts the command failed and returns its stderr.
#[allow(dead_code)]
pub fn refused(out: &Output) -> String {
    let (stdout, stderr) = text(out);
    assert!(
        !out.status.success(),
        "ivme should have failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    stderr
}

/// Copies a folder tree (regular files and folders only).
#[allow(dead_code)]
pub fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if e.file_type().unwrap().is_dir() {
            copy_tree(&src, &dst);
        } else {
            std::fs::copy(&src, &dst).unwrap();
        }
    }
}
