//! One error type for the whole runtime: every message names the cause and the fix.

use std::path::PathBuf;

/// The result type used throughout ivme.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong in ivme, raised on every rank that sees it.
///
/// Its `Debug` form is its message, so `fn main() -> ivme::Result<()>` prints what went wrong
/// and what to do (`Error: checkpoint ...: ...`) rather than the enum's fields.
#[derive(thiserror::Error)]
pub enum Error {
    /// A tensor operation failed inside candle.
    #[error(transparent)]
    Candle(candle_core::Error),

    /// A file or folder could not be read or written.
    #[error("{context}: {source}")]
    Io {
        /// What ivme was doing.
        context: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// A setting has a value ivme cannot use.
    #[error("invalid setting `{key}` = {value:?}: {fix}")]
    Config {
        /// The setting's name.
        key: String,
        /// The value that was given.
        value: String,
        /// What to write instead.
        fix: String,
    },

    /// The environment describes a distributed run this build or machine cannot do.
    #[error("distributed setup: {0}")]
    Setup(String),

    /// A collective operation failed or the ranks disagreed.
    #[error("communication: {0}")]
    Comm(String),

    /// An object was handed to `prepare` twice, or in an order that cannot work.
    #[error("prepare: {0}")]
    Prepare(String),

    /// A precision mode the build or the hardware cannot run.
    #[error("precision: {0}")]
    Precision(String),

    /// A checkpoint or model file is missing, corrupt or does not match.
    #[error("checkpoint {path}: {msg}")]
    Checkpoint {
        /// The file or folder concerned.
        path: PathBuf,
        /// What is wrong and what to do.
        msg: String,
        /// Which kind of problem it is, for callers that branch on it.
        kind: CheckpointErrorKind,
    },

    /// A JSON document could not be read or written.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),

    /// Misuse of an API, with the fix in the message.
    #[error("{0}")]
    Usage(String),

    /// The run stopped for a preemption signal after an optimizer step every rank agreed on:
    /// not a failure. `ivme launch` exits with its requeue code (docs/faults.md).
    #[error("{}", preempted_message(*step, checkpoint.as_deref()))]
    Preempted {
        /// The optimizer steps taken when the run stopped.
        step: u64,
        /// The checkpoint written at that step, if one could be.
        checkpoint: Option<PathBuf>,
    },
}

fn preempted_message(step: u64, checkpoint: Option<&std::path::Path>) -> String {
    match checkpoint {
        Some(dir) => format!(
            "preempted: every rank stopped after optimizer step {step} and saved {}; a \
             restarted run continues from it (`load_state_if_any`)",
            dir.display()
        ),
        None => format!(
            "preempted: every rank stopped after optimizer step {step}; no checkpoint was \
             written at it (set a project folder with automatic checkpoint naming, and call \
             `accelerator.preemption_point()` after the optimizer step, as `#[accelerate]` does)"
        ),
    }
}

/// The kind of an [`Error::Checkpoint`]: what a caller can do about it.
///
/// ```no_run
/// use ivme::CheckpointErrorKind;
/// # fn main() -> ivme::Result<()> {
/// # let mut accelerator = ivme::Accelerator::new()?;
/// # accelerator.set_project_configuration(ivme::checkpoint::ProjectConfiguration::new("run"))?;
/// match accelerator.load_state(None) {
///     Ok(dir) => accelerator.print(format!("resumed from {}", dir.display())),
///     // No checkpoint yet: start fresh. A damaged or unfit one stays an error.
///     Err(e) if e.checkpoint_kind() == Some(CheckpointErrorKind::Missing) => {}
///     Err(e) => return Err(e),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CheckpointErrorKind {
    /// There is no checkpoint where one was asked for: no such folder, or a project folder
    /// without a complete checkpoint.
    Missing,
    /// A checkpoint is there but cannot be trusted: a file is missing, truncated, not a
    /// regular file or fails its checksum, or the manifest cannot be read. An older
    /// checkpoint may stand in for it.
    Damaged,
    /// A sound checkpoint that does not fit this run: other models, optimizers, shapes,
    /// dtypes or settings. Loading it would be wrong whichever checkpoint it is.
    Unfit,
    /// Another job holds the project folder's lock.
    Locked,
    /// Writing, copying or committing a checkpoint failed.
    Failed,
}

// `From<candle_core::Error>` is in precision/model_dtype.rs, beside the explanations of the
// dtype errors that 16-bit weights cause.

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl Error {
    /// Wraps an I/O error with what ivme was doing when it happened.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// Builds a checkpoint error of `kind` about `path`.
    pub fn checkpoint(
        path: impl Into<PathBuf>,
        kind: CheckpointErrorKind,
        msg: impl Into<String>,
    ) -> Self {
        Error::Checkpoint {
            path: path.into(),
            msg: msg.into(),
            kind,
        }
    }

    /// The kind of a checkpoint error (`None` for every other error).
    pub fn checkpoint_kind(&self) -> Option<CheckpointErrorKind> {
        match self {
            Error::Checkpoint { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// Whether a restart of the job would fail the same way: the program, its settings or its
    /// files must change first (a bad setting or argument, a model or optimizer that cannot be
    /// prepared, a precision the model cannot run in, a checkpoint that does not fit this run or
    /// that another job holds). `ivme launch --max_restarts` does not restart after one.
    pub fn recurs_on_restart(&self) -> bool {
        match self {
            Error::Config { .. } | Error::Prepare(_) | Error::Precision(_) | Error::Usage(_) => {
                true
            }
            Error::Checkpoint { kind, .. } => matches!(
                kind,
                CheckpointErrorKind::Unfit | CheckpointErrorKind::Locked
            ),
            _ => false,
        }
    }

    /// Whether this is the stop of a preemption ([`Error::Preempted`]), which a program ends
    /// on without treating it as a failure.
    pub fn is_preempted(&self) -> bool {
        matches!(self, Error::Preempted { .. })
    }

    /// Builds a configuration error naming the key, the bad value and the fix.
    pub fn config(key: impl Into<String>, value: impl ToString, fix: impl Into<String>) -> Self {
        Error::Config {
            key: key.into(),
            value: value.to_string(),
            fix: fix.into(),
        }
    }
}

/// Lets a candle training function that returns `candle_core::Result` use `?` on ivme calls.
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(inner) => inner,
            other => candle_core::Error::wrap(other),
        }
    }
}

/// Turns an I/O error into ivme's, saying what was being done to which path (for
/// `map_err(io_at("reading", path))`).
pub(crate) fn io_at(what: &str, path: &std::path::Path) -> impl FnOnce(std::io::Error) -> Error {
    let context = format!("{what} {}", path.display());
    move |e| Error::io(context, e)
}
