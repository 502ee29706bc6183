//! Experiment tracking: a small [`Tracker`] trait, built-in JSONL, CSV and TensorBoard
//! trackers, and the Accelerator's `init_trackers` / `log` / `end_training`, which write on the
//! main process only.
//!
//! ```no_run
//! use ivme::tracking::{CsvTracker, JsonlTracker, TensorBoardTracker, Tracker};
//! # fn main() -> ivme::Result<()> {
//! let accelerator = ivme::Accelerator::new()?;
//! let trackers: Vec<Box<dyn Tracker>> = vec![
//!     Box::new(JsonlTracker::new("runs")),
//!     Box::new(CsvTracker::new("runs")),
//!     Box::new(TensorBoardTracker::new("runs")),
//! ];
//! let config = serde_json::json!({ "lr": 1e-3, "batch_size": 32 });
//! accelerator.init_trackers("my-project", &config, trackers)?;
//! for step in 0..10u64 {
//!     accelerator.log([("loss", 1.0 / (step + 1) as f64)], step)?;
//! }
//! accelerator.end_training()?;
//! # Ok(()) }
//! ```

mod csv;
mod jsonl;
mod tensorboard;

pub use self::csv::CsvTracker;
pub use self::jsonl::JsonlTracker;
pub use self::tensorboard::TensorBoardTracker;

use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Somewhere metrics go: a file format, a service. Implement it to add your own.
///
/// Only the main process calls these methods; see [`Accelerator::init_trackers`](crate::Accelerator::init_trackers).
pub trait Tracker: Send {
    /// A short name for error messages (`"jsonl"`, `"tensorboard"`).
    fn name(&self) -> &str;
    /// Opens the run: creates files, records the run's configuration.
    fn init(&mut self, project: &str, config: &serde_json::Value) -> Result<()>;
    /// Records `values` for training step `step`.
    fn log(&mut self, values: &BTreeMap<String, f64>, step: u64) -> Result<()>;
    /// Flushes and closes; called once, by `end_training`.
    fn finish(&mut self) -> Result<()>;
}

/// A set of trackers opened for one run; inactive (every call a no-op) off the main process.
///
/// The Accelerator's tracking methods hold one of these; use it directly to manage trackers
/// yourself.
pub struct Trackers {
    trackers: Vec<Box<dyn Tracker>>,
    pub(crate) finished: bool,
}

impl std::fmt::Debug for Trackers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.trackers.iter().map(|t| t.name()).collect();
        f.debug_struct("Trackers")
            .field("trackers", &names)
            .field("finished", &self.finished)
            .finish()
    }
}

impl Trackers {
    /// Checks `project` and, when `active`, opens every tracker; an inactive set drops the
    /// trackers unopened, so nothing is created.
    pub fn open(
        project: &str,
        config: &serde_json::Value,
        trackers: Vec<Box<dyn Tracker>>,
        active: bool,
    ) -> Result<Self> {
        check_project(project)?;
        let mut set = Trackers {
            trackers: if active { trackers } else { Vec::new() },
            finished: false,
        };
        for t in &mut set.trackers {
            t.init(project, config)
                .map_err(|e| context(t.name(), "init", e))?;
        }
        Ok(set)
    }

    /// Sends `values` for `step` to every tracker.
    pub fn log(&mut self, values: &BTreeMap<String, f64>, step: u64) -> Result<()> {
        if self.finished {
            return Err(Error::Usage(
                "log after end_training: call init_trackers again to start a new run".into(),
            ));
        }
        for t in &mut self.trackers {
            t.log(values, step)
                .map_err(|e| context(t.name(), "log", e))?;
        }
        Ok(())
    }

    /// Finishes every tracker once; later calls do nothing.
    pub fn finish(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.finished, true) {
            return Ok(());
        }
        let mut first_err = None;
        // Every tracker gets the chance to close its files, even after another failed.
        for t in &mut self.trackers {
            if let Err(e) = t.finish() {
                first_err.get_or_insert(context(t.name(), "finish", e));
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for Trackers {
    fn drop(&mut self) {
        // Closing files on the way out (an error or early return) loses less than not closing.
        let _ = self.finish();
    }
}

fn context(name: &str, what: &str, e: Error) -> Error {
    Error::Usage(format!("tracker `{name}` failed in {what}: {e}"))
}

/// A project names a folder, so it must be one plain path component.
fn check_project(project: &str) -> Result<()> {
    let bad = project.trim().is_empty()
        || project == "."
        || project == ".."
        || project.contains(['/', '\\'])
        || project.contains('\0');
    if bad {
        return Err(Error::config(
            "project",
            project,
            "use a non-empty name without path separators, such as \"my-run\"",
        ));
    }
    Ok(())
}

/// The folder a file-based tracker writes a project into, created if missing.
pub(crate) fn project_dir(base: &Path, project: &str) -> Result<PathBuf> {
    let dir = base.join(project);
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("creating tracking folder {}", dir.display()), e))?;
    Ok(dir)
}

/// Seconds since the Unix epoch, as TensorBoard and the JSONL lines record time.
pub(crate) fn wall_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex as StdMutex};

    /// Records what it was told, to check what `Trackers` passes on.
    struct Recorder(Arc<StdMutex<Vec<String>>>);

    impl Tracker for Recorder {
        fn name(&self) -> &str {
            "recorder"
        }
        fn init(&mut self, project: &str, config: &serde_json::Value) -> Result<()> {
            self.0
                .lock()
                .unwrap()
                .push(format!("init {project} {config}"));
            Ok(())
        }
        fn log(&mut self, values: &BTreeMap<String, f64>, step: u64) -> Result<()> {
            self.0
                .lock()
                .unwrap()
                .push(format!("log {step} {values:?}"));
            Ok(())
        }
        fn finish(&mut self) -> Result<()> {
            self.0.lock().unwrap().push("finish".into());
            Ok(())
        }
    }

    #[test]
    fn an_active_set_forwards_every_call_and_finishes_once() {
        let seen = Arc::new(StdMutex::new(Vec::new()));
        let config = serde_json::json!({"lr": 0.5});
        let mut set =
            Trackers::open("p", &config, vec![Box::new(Recorder(seen.clone()))], true).unwrap();
        set.log(&BTreeMap::from([("loss".to_string(), 1.5)]), 3)
            .unwrap();
        set.finish().unwrap();
        set.finish().unwrap();
        drop(set);
        assert_eq!(
            *seen.lock().unwrap(),
            ["init p {\"lr\":0.5}", "log 3 {\"loss\": 1.5}", "finish"]
        );
    }

    #[test]
    fn an_inactive_set_never_calls_its_trackers() {
        let seen = Arc::new(StdMutex::new(Vec::new()));
        let mut set = Trackers::open(
            "p",
            &serde_json::Value::Null,
            vec![Box::new(Recorder(seen.clone()))],
            false,
        )
        .unwrap();
        set.log(&BTreeMap::new(), 0).unwrap();
        set.finish().unwrap();
        assert!(seen.lock().unwrap().is_empty());
        assert!(set.log(&BTreeMap::new(), 1).is_err(), "log after finish");
    }

    #[test]
    fn project_names_must_be_one_path_component() {
        for bad in ["", " ", "..", "a/b", "a\\b"] {
            let e = Trackers::open(bad, &serde_json::Value::Null, Vec::new(), true).unwrap_err();
            assert!(e.to_string().contains("project"), "{bad:?}: {e}");
        }
        assert!(Trackers::open("run-1", &serde_json::Value::Null, Vec::new(), true).is_ok());
    }
}
