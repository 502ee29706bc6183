//! How the builder's collective settings become the communicator's options: the deadline
//! and the order check (the builder's, else the launcher's variables).

use super::AcceleratorBuilder;
use crate::comm::{self, CommOptions};
use crate::error::{Error, Result};
use crate::setup::env;
use std::time::Duration;

impl AcceleratorBuilder {
    /// The collective deadline and debug mode: the builder's, else the launcher's variables.
    pub(super) fn comm_options(&self) -> Result<CommOptions> {
        let timeout = match self.collective_timeout {
            Some(t) => t,
            None => match env::COLLECTIVE_TIMEOUT.get() {
                Some(raw) => parse_timeout(&raw)?,
                None => comm::DEFAULT_TIMEOUT,
            },
        };
        if timeout.is_zero() {
            return Err(Error::config(
                ivme_settings::COLLECTIVE_TIMEOUT.name,
                "0 s",
                "use a positive duration, e.g. 600 seconds",
            ));
        }
        let debug_sync = match self.debug_sync {
            Some(on) => on,
            None => match env::DEBUG_SYNC.get() {
                None => false,
                Some(raw) => env::parse_bool(&raw).ok_or_else(|| {
                    Error::config(
                        env::DEBUG_SYNC.name,
                        &raw,
                        "use 1 to check every collective across ranks, or 0",
                    )
                })?,
            },
        };
        Ok(CommOptions {
            timeout,
            debug_sync,
            threads: false,
        })
    }
}

/// Reads the launcher's collective deadline: seconds, or a number with a unit (`90`, `0.5`,
/// `10m`), as `ivme launch --collective_timeout` takes it.
fn parse_timeout(raw: &str) -> Result<Duration> {
    env::parse_duration(raw).ok_or_else(|| {
        Error::config(
            env::COLLECTIVE_TIMEOUT.name,
            raw,
            format!("use {}, e.g. 600", env::DURATION_FORMS),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collective_timeouts_are_positive_seconds() {
        assert_eq!(parse_timeout(" 90 ").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_timeout("0.5").unwrap(), Duration::from_millis(500));
        // The launcher's forms with a unit are read the same way here.
        assert_eq!(parse_timeout("10m").unwrap(), Duration::from_secs(600));
        for bad in ["0", "-3", "soon", "inf", "NaN", ""] {
            let msg = parse_timeout(bad).unwrap_err().to_string();
            assert!(
                msg.contains("IVME_COLLECTIVE_TIMEOUT")
                    && msg.contains("positive number of seconds"),
                "{bad}: {msg}"
            );
        }
    }

    #[test]
    fn the_builder_wins_over_the_defaults() {
        let b = AcceleratorBuilder::default()
            .collective_timeout(Duration::from_secs(7))
            .debug_sync(true);
        let o = b.comm_options().unwrap();
        assert_eq!((o.timeout, o.debug_sync), (Duration::from_secs(7), true));
        let zero = AcceleratorBuilder::default().collective_timeout(Duration::ZERO);
        assert!(zero
            .comm_options()
            .unwrap_err()
            .to_string()
            .contains("positive"));
    }
}
