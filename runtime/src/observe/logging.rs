//! Once-only output: a `tracing` setup that logs on the main process by default, and helpers
//! that run code on one process, or on the main process before the others.
//!
//! ```no_run
//! use ivme::logging::{self, tracing, LogConfig};
//! # fn main() -> ivme::Result<()> {
//! let accelerator = ivme::Accelerator::new()?;
//! accelerator.init_logging(LogConfig::new())?; // rank 0 only, level from the environment
//! tracing::info!("starting on {} processes", accelerator.num_processes());
//! // Rank 0 downloads or builds a cache first; the others then find it ready.
//! accelerator.main_process_first(|| std::fs::create_dir_all("cache"))?
//!     .map_err(|e| ivme::Error::io("creating cache", e))?;
//! # Ok(()) }
//! ```

use crate::setup::state::EnvLayout;
use crate::{Error, Result};
use std::fmt;
use std::io::IsTerminal;
use tracing::{Event, Subscriber};
use tracing_subscriber::filter::{EnvFilter, LevelFilter};
use tracing_subscriber::fmt::format::{self, FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::registry::LookupSpan;

/// The `tracing` crate, re-exported so programs can log through ivme without a dependency of
/// their own (`ivme::logging::tracing::info!(...)`).
pub use tracing;

/// Reports one of ivme's own warnings or notices: through `tracing` (target `ivme`, level
/// warn) when the program's subscriber (set with [`init`] or its own) takes such a line, so
/// it lands in the program's log in its format; on stderr with the `ivme: ` prefix otherwise,
/// so a program that never set up logging, or whose subscriber silences this rank (as
/// [`init`] does off the main process), still sees it. Use it through `warn_user!`.
pub(crate) fn warn(msg: fmt::Arguments<'_>) {
    if tracing::enabled!(target: "ivme", tracing::Level::WARN) {
        tracing::warn!(target: "ivme", "{msg}");
    } else {
        eprintln!("ivme: {msg}");
    }
}

/// The level names `IVME_LOG_LEVEL` accepts.
const LEVELS: &str = "trace, debug, info, warn, error, off";

/// How [`init`] sets up logging.
///
/// The level comes from `RUST_LOG` (full `tracing` directives such as `info,ivme=debug`), else
/// from `IVME_LOG_LEVEL` (one level name), else from [`default_level`](Self::default_level),
/// else `info`. Unlike other settings, the environment wins over code here: verbosity is a
/// choice made when running, typically to debug one run.
#[derive(Debug, Clone, Default)]
pub struct LogConfig {
    all_ranks: bool,
    default_level: Option<LevelFilter>,
    rank: Option<usize>,
}

impl LogConfig {
    /// Logs on the main process only, at the level the environment asks for (`info` if none).
    pub fn new() -> Self {
        Self::default()
    }

    /// Logs on every rank, each line prefixed with `[rank R]`, instead of on rank 0 only.
    pub fn all_ranks(mut self, all: bool) -> Self {
        self.all_ranks = all;
        self
    }

    /// The level used when neither `RUST_LOG` nor `IVME_LOG_LEVEL` is set.
    pub fn default_level(mut self, level: tracing::Level) -> Self {
        self.default_level = Some(LevelFilter::from_level(level));
        self
    }

    /// This process's rank; without it [`init`] reads the launcher's environment (rank 0 when
    /// no launcher started the program). [`Accelerator::init_logging`](crate::Accelerator::init_logging) sets it for you.
    pub fn rank(mut self, rank: usize) -> Self {
        self.rank = Some(rank);
        self
    }
}

/// Installs the global `tracing` subscriber, writing to stderr; returns `false` and changes
/// nothing when a subscriber is already installed (by an earlier call or by the program).
///
/// Invalid `RUST_LOG` or `IVME_LOG_LEVEL` values are errors naming the variable.
pub fn init(config: LogConfig) -> Result<bool> {
    let rank = match config.rank {
        Some(r) => r,
        None => EnvLayout::from_env()?.map_or(0, |l| l.rank),
    };
    // Checked on every rank, so a bad setting fails the whole run alike.
    let wanted = level_filter(
        std::env::var("RUST_LOG").ok(),
        std::env::var(crate::setup::env::LOG_LEVEL.name).ok(),
        config.default_level.unwrap_or(LevelFilter::INFO),
    )?;
    let filter = if rank == 0 || config.all_ranks {
        wanted
    } else {
        EnvFilter::default().add_directive(LevelFilter::OFF.into())
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let installed = if config.all_ranks {
        builder
            .event_format(RankPrefix {
                rank,
                inner: format::Format::default(),
            })
            .try_init()
    } else {
        builder.try_init()
    };
    Ok(installed.is_ok())
}

/// Builds the filter from `RUST_LOG`, then `IVME_LOG_LEVEL`, then the default.
fn level_filter(
    rust_log: Option<String>,
    ivme_level: Option<String>,
    default: LevelFilter,
) -> Result<EnvFilter> {
    if let Some(directives) = rust_log.filter(|s| !s.trim().is_empty()) {
        return EnvFilter::try_new(&directives).map_err(|e| {
            Error::config(
                "RUST_LOG",
                &directives,
                format!("{e}; use tracing directives such as `info` or `info,ivme=debug`"),
            )
        });
    }
    let level = match ivme_level.filter(|s| !s.trim().is_empty()) {
        Some(name) => name.trim().parse::<LevelFilter>().map_err(|_| {
            Error::config(
                crate::env::LOG_LEVEL.name,
                &name,
                format!("use one of: {LEVELS}"),
            )
        })?,
        None => default,
    };
    Ok(EnvFilter::default().add_directive(level.into()))
}

/// Puts `[rank R] ` before every line the inner format writes.
struct RankPrefix<F> {
    rank: usize,
    inner: F,
}

impl<S, N, F> FormatEvent<S, N> for RankPrefix<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        write!(writer, "[rank {}] ", self.rank)?;
        self.inner.format_event(ctx, writer, event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Accelerator;

    fn shown(filter: &EnvFilter) -> String {
        filter.to_string()
    }

    #[test]
    fn rust_log_wins_then_ivme_log_level_then_the_default() {
        let f = level_filter(
            Some("debug".into()),
            Some("error".into()),
            LevelFilter::INFO,
        );
        assert_eq!(shown(&f.unwrap()), "debug");
        let f = level_filter(None, Some(" warn ".into()), LevelFilter::INFO);
        assert_eq!(shown(&f.unwrap()), "warn");
        let f = level_filter(Some("".into()), None, LevelFilter::TRACE);
        assert_eq!(shown(&f.unwrap()), "trace");
    }

    #[test]
    fn bad_levels_name_the_variable_and_the_choices() {
        let e = level_filter(None, Some("loud".into()), LevelFilter::INFO).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("IVME_LOG_LEVEL") && msg.contains("loud"),
            "{msg}"
        );
        assert!(
            msg.contains("trace, debug, info, warn, error, off"),
            "{msg}"
        );
        let e = level_filter(Some("ivme=notalevel".into()), None, LevelFilter::INFO).unwrap_err();
        assert!(e.to_string().contains("RUST_LOG"), "{e}");
    }

    #[test]
    fn a_second_init_is_a_no_op() {
        // The first call may lose to another test's; either way, the later one must not fail.
        let _ = init(LogConfig::new().rank(0));
        assert!(!init(LogConfig::new().rank(0).all_ranks(true)).unwrap());
    }

    #[test]
    fn once_only_helpers_run_on_the_right_process() -> Result<()> {
        let acc = Accelerator::builder().cpu(true).build()?;
        assert_eq!(acc.on_main_process(|| 1), Some(1));
        assert_eq!(acc.on_local_main_process(|| 2), Some(2));
        assert_eq!(acc.on_process(1, || 3), None);
        assert_eq!(acc.on_last_process(|| 4), Some(4));
        assert_eq!(acc.main_process_first(|| 5)?, 5);
        assert_eq!(acc.local_main_process_first(|| 6)?, 6);
        Ok(())
    }
}
