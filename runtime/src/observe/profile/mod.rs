//! Profiles of a run: where each rank's steps went, phase by phase, over time.
//!
//! With profiling on (`ivme launch --profile DIR`, [`AcceleratorBuilder::profile`], the
//! attribute's `profile = "DIR"` or `IVME_PROFILE=DIR`) every process records its phases as
//! spans: waiting for a prepared loader's batch, candle's backward, the end of each
//! accumulation window (and, inside it, every collective), the prepared optimizers' step and
//! checkpoint stalls. At [`end_training`](crate::Accelerator::end_training), or when the
//! Accelerator is dropped, each process writes into `DIR`:
//!
//! - `rank-R.json`: its [`RankRecord`] (the spans; what `ivme profile DIR` reads);
//! - `rank-R.trace.json`: a Chrome / Perfetto trace of its spans (open it at ui.perfetto.dev).
//!
//! `end_training` also prints a [`Summary`] on the main process (phase shares, the rank the
//! others wait for, steps/s, samples/s, model FLOP/s when given FLOPs per sample), writes it to
//! `DIR/summary.txt` and `summary.json`, and logs it to the trackers. `ivme launch --profile`
//! prints the summary after the job when the program did not call `end_training`, and
//! `ivme profile DIR` draws every rank's phases over time and the loss curve.
//!
//! [`AcceleratorBuilder::profile`]: crate::AcceleratorBuilder::profile

mod chrome;
mod steps;
mod summary;
pub(crate) mod trace;

pub use chrome::chrome_trace;
pub use steps::{steps_of, StepRow};
pub use summary::{RankSteps, RankSummary, Summary};

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// What a span of a profile measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpanKind {
    /// Waiting for a prepared data loader's batch.
    Data,
    /// candle's backward and adding the gradients to the window's sums.
    Backward,
    /// The end of an accumulation window: gradient collectives, unscaling, clipping (and under
    /// sharding the slice's optimizer step).
    Sync,
    /// One collective (inside `Sync`, a checkpoint or the user's own calls).
    Collective,
    /// The prepared optimizers' step.
    Optimizer,
    /// A checkpoint save or load holding the loop.
    Checkpoint,
    /// A checkpointed segment's forward run again during backward (inside `Backward`).
    Recompute,
}

impl SpanKind {
    /// The name traces and tables use.
    pub fn name(self) -> &'static str {
        match self {
            SpanKind::Data => "data",
            SpanKind::Backward => "backward",
            SpanKind::Sync => "sync",
            SpanKind::Collective => "collective",
            SpanKind::Optimizer => "optimizer",
            SpanKind::Checkpoint => "checkpoint",
            SpanKind::Recompute => "recompute",
        }
    }
}

/// One measured stretch of time, in nanoseconds from the start of recording.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "(SpanKind, u64, u64)", into = "(SpanKind, u64, u64)")]
pub struct Span {
    /// What ran.
    pub kind: SpanKind,
    /// When it started.
    pub start_ns: u64,
    /// How long it took.
    pub dur_ns: u64,
}

impl Span {
    /// When it ended.
    pub fn end_ns(&self) -> u64 {
        self.start_ns.saturating_add(self.dur_ns)
    }
}

impl From<(SpanKind, u64, u64)> for Span {
    fn from((kind, start_ns, dur_ns): (SpanKind, u64, u64)) -> Self {
        Span {
            kind,
            start_ns,
            dur_ns,
        }
    }
}

impl From<Span> for (SpanKind, u64, u64) {
    fn from(s: Span) -> Self {
        (s.kind, s.start_ns, s.dur_ns)
    }
}

/// One process's profile: who it was, what it handled and its spans.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankRecord {
    /// The process's global rank.
    pub rank: usize,
    /// The number of processes in the run.
    pub world_size: usize,
    /// The machine it ran on.
    pub host: String,
    /// When recording started, in nanoseconds since the Unix epoch (to line ranks up).
    pub origin_unix_ns: u64,
    /// Samples the prepared loaders handed this process.
    pub samples: u64,
    /// The model's FLOPs per sample (forward and backward), when the program gave them.
    pub flops_per_sample: Option<f64>,
    /// The device's peak FLOP/s, when the program gave it (for model FLOP utilisation).
    pub peak_flops: Option<f64>,
    /// Spans not kept because the record was full.
    pub dropped: u64,
    /// The spans, in the order they ended.
    pub spans: Vec<Span>,
}

impl RankRecord {
    /// The file of rank `rank`'s record in a profile folder.
    pub fn path(dir: &Path, rank: usize) -> PathBuf {
        dir.join(format!("rank-{rank}.json"))
    }

    /// The optimizer steps this record holds, with their phases ([`steps_of`]).
    pub fn steps(&self) -> Vec<StepRow> {
        steps_of(&self.spans)
    }

    /// Writes the record and its Chrome trace into `dir` (each through a temporary file, so a
    /// reader never sees half a file).
    pub fn write(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating the profile folder {}", dir.display()), e))?;
        write_atomic(&Self::path(dir, self.rank), &serde_json::to_vec(self)?)?;
        let trace = chrome_trace(std::slice::from_ref(self));
        write_atomic(
            &dir.join(format!("rank-{}.trace.json", self.rank)),
            &serde_json::to_vec(&trace)?,
        )
    }
}

/// Reads every rank's record in a profile folder, in rank order; fails naming the folder when
/// it holds none, and a file that is not a record.
pub fn read_dir(dir: &Path) -> Result<Vec<RankRecord>> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| Error::io(format!("reading the profile folder {}", dir.display()), e))?;
    let mut records = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_record = name
            .strip_prefix("rank-")
            .and_then(|r| r.strip_suffix(".json"))
            .is_some_and(|r| r.parse::<usize>().is_ok());
        if !is_record {
            continue;
        }
        let bytes = std::fs::read(entry.path())
            .map_err(|e| Error::io(format!("reading {}", entry.path().display()), e))?;
        let record: RankRecord = serde_json::from_slice(&bytes).map_err(|e| {
            Error::Usage(format!(
                "{} is not an ivme profile record: {e}",
                entry.path().display()
            ))
        })?;
        records.push(record);
    }
    if records.is_empty() {
        return Err(Error::Usage(format!(
            "{} holds no profile (no rank-R.json): run the job with `ivme launch --profile {}` \
             or IVME_PROFILE={} first",
            dir.display(),
            dir.display(),
            dir.display()
        )));
    }
    records.sort_by_key(|r| r.rank);
    Ok(records)
}

/// Writes `bytes` to `path` through a temporary file beside it.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(
            format!("renaming {} to {}", tmp.display(), path.display()),
            e,
        )
    })
}
