//! A tracker writing one JSON object per `log` call, one per line.

use super::{project_dir, wall_time, Tracker};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::PathBuf;

/// Writes `<dir>/<project>/metrics.jsonl`, one line per `log` call:
/// `{"step": 3, "wall_time": 1712345678.25, "values": {"loss": 0.5}}`, and the run's config to
/// `<dir>/<project>/config.json`.
///
/// An existing `metrics.jsonl` is appended to, so a resumed run continues the same file.
/// JSON has no NaN or infinity: such values are written as `null`.
#[derive(Debug)]
pub struct JsonlTracker {
    dir: PathBuf,
    path: Option<PathBuf>,
    out: Option<BufWriter<File>>,
}

impl JsonlTracker {
    /// A tracker writing under `dir` (one folder per project).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        JsonlTracker {
            dir: dir.into(),
            path: None,
            out: None,
        }
    }

    /// The metrics file, once `init` has run.
    pub fn path(&self) -> Option<&PathBuf> {
        self.path.as_ref()
    }

    fn io(&self, what: &str, e: std::io::Error) -> Error {
        let path = self.path.as_ref().unwrap_or(&self.dir);
        Error::io(format!("{what} {}", path.display()), e)
    }
}

impl Tracker for JsonlTracker {
    fn name(&self) -> &str {
        "jsonl"
    }

    fn init(&mut self, project: &str, config: &serde_json::Value) -> Result<()> {
        let dir = project_dir(&self.dir, project)?;
        let config_path = dir.join("config.json");
        let text = serde_json::to_string_pretty(config)?;
        std::fs::write(&config_path, text + "\n")
            .map_err(|e| Error::io(format!("writing {}", config_path.display()), e))?;
        let path = dir.join("metrics.jsonl");
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        self.path = Some(path);
        self.out = Some(BufWriter::new(file));
        Ok(())
    }

    fn log(&mut self, values: &BTreeMap<String, f64>, step: u64) -> Result<()> {
        let line = serde_json::json!({
            "step": step,
            "wall_time": wall_time(),
            "values": values,
        });
        let mut text = serde_json::to_string(&line)?;
        text.push('\n');
        let Some(out) = self.out.as_mut() else {
            return Err(Error::Usage("jsonl: log before init".into()));
        };
        // One flush per call keeps the file readable by a live viewer and loses at most the
        // line being written in a crash.
        let written = out.write_all(text.as_bytes()).and_then(|_| out.flush());
        written.map_err(|e| self.io("writing", e))
    }

    fn finish(&mut self) -> Result<()> {
        if let Some(mut out) = self.out.take() {
            out.flush().map_err(|e| self.io("flushing", e))?;
            out.get_ref()
                .sync_all()
                .map_err(|e| self.io("syncing", e))?;
        }
        Ok(())
    }
}
