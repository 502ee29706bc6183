//! The launcher's fault-tolerance settings: `--max_restarts`, `--collective_timeout` and
//! `--debug_sync`, how their values are read, the variables that carry them to the ranks, and
//! the lines the launcher prints when it restarts a failed job.

use crate::args::{self, Flag, Kind, Scanned};
use ivme::{Error, Result};
use std::time::Duration;

// The variables that carry these settings to the ranks are in `ivme::env` (the launcher
// contract), with the duration parser both sides use.
use ivme::env::{parse_duration, DURATION_FORMS};

/// `--max_restarts`.
pub const MAX_RESTARTS: Flag = Flag {
    name: "max_restarts",
    kind: Kind::Value("count"),
    help: "relaunch a failed job up to this many times (default 0); ranks see IVME_RESTART_COUNT",
    example: "3",
};
/// `--collective_timeout`.
pub const COLLECTIVE_TIMEOUT: Flag = Flag {
    name: "collective_timeout",
    kind: Kind::Value("duration"),
    help:
        "deadline of each collective (90, 90s, 10m, 1h, 500ms), as IVME_COLLECTIVE_TIMEOUT seconds",
    example: "10m",
};
/// `--debug_sync`.
pub const DEBUG_SYNC: Flag = Flag {
    name: "debug_sync",
    kind: Kind::Switch,
    help: "check that the ranks call the same collectives in the same order (IVME_DEBUG_SYNC=1)",
    example: "",
};

/// Reads `--collective_timeout`, refusing what is not a positive duration.
pub fn collective_timeout(s: &Scanned) -> Result<Option<Duration>> {
    let Some(raw) = s.value(COLLECTIVE_TIMEOUT.name) else {
        return Ok(None);
    };
    let flag = args::spelled(COLLECTIVE_TIMEOUT.name);
    parse_duration(raw).map(Some).ok_or_else(|| {
        Error::Usage(format!(
            "`{flag} {raw}` is not a duration; write {DURATION_FORMS}, e.g. `{flag} {}`",
            COLLECTIVE_TIMEOUT.example
        ))
    })
}

/// Reads `--max_restarts`: a whole number, 0 included (0 turns restarts off).
pub fn max_restarts(s: &Scanned) -> Result<Option<usize>> {
    let Some(raw) = s.value(MAX_RESTARTS.name) else {
        return Ok(None);
    };
    let flag = args::spelled(MAX_RESTARTS.name);
    raw.trim().parse::<usize>().map(Some).map_err(|_| {
        Error::Usage(format!(
            "`{flag} {raw}` is not a whole number; write how many times to relaunch a failed \
             job, e.g. `{flag} {}` (0 never relaunches)",
            MAX_RESTARTS.example
        ))
    })
}

/// The line printed before relaunching: `ivme: restart 1 of 3 after rank 1 failed with ...`.
pub fn restart_line(restart: usize, max: usize, cause: &str) -> String {
    format!("ivme: restart {restart} of {max} after {cause}")
}

/// The line printed when the last allowed attempt failed too.
pub fn exhausted_line(max: usize, cause: &str) -> String {
    let attempts = max + 1;
    format!(
        "ivme: restarts exhausted: the job failed {attempts} times (the first run and \
         {max} restart{}); the last failure: {cause}",
        if max == 1 { "" } else { "s" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_flag_values_say_what_to_write() {
        let scan = |w: &[&str]| {
            let words: Vec<String> = w.iter().map(|s| s.to_string()).collect();
            args::scan(
                "launch",
                &[MAX_RESTARTS, COLLECTIVE_TIMEOUT, DEBUG_SYNC],
                &words,
            )
            .unwrap()
        };
        let msg = collective_timeout(&scan(&["--collective-timeout", "0"]))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("`--collective_timeout 0` is not a duration")
                && msg.contains("90, 90s, 10m, 1h, 500ms"),
            "{msg}"
        );
        let msg = max_restarts(&scan(&["--max-restarts", "-1"]))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("`--max_restarts -1` is not a whole number"),
            "{msg}"
        );
        assert_eq!(max_restarts(&scan(&["--max_restarts=0"])).unwrap(), Some(0));
        assert_eq!(max_restarts(&scan(&[])).unwrap(), None);
    }

    #[test]
    fn restart_messages_count_from_one() {
        assert_eq!(
            restart_line(
                1,
                3,
                "rank 1 failed with exit code 137 (killed by signal 9)"
            ),
            "ivme: restart 1 of 3 after rank 1 failed with exit code 137 (killed by signal 9)"
        );
        let line = exhausted_line(2, "rank 0 failed with exit code 3");
        assert!(
            line.contains("restarts exhausted") && line.contains("failed 3 times"),
            "{line}"
        );
        assert!(exhausted_line(1, "x").contains("1 restart)"));
    }
}
