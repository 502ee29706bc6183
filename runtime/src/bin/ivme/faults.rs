//! The launcher's fault-tolerance settings: `--max_restarts`, `--collective_timeout` and
//! `--debug_sync`, how their values are read, the variables that carry them to the ranks, and
//! the lines the launcher prints when it restarts a failed job.

use crate::args::{self, Flag, Kind, Scanned};
use ivme::{Error, Result};
use std::time::Duration;

/// The variable each rank reads to learn how many times the job was restarted (0 at first).
pub const RESTART_COUNT_VAR: &str = "IVME_RESTART_COUNT";
/// The variable that carries `--collective_timeout`, in seconds.
pub const COLLECTIVE_TIMEOUT_VAR: &str = "IVME_COLLECTIVE_TIMEOUT";
/// The variable that carries `--debug_sync`.
pub const DEBUG_SYNC_VAR: &str = "IVME_DEBUG_SYNC";

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

const DURATION_FORMS: &str =
    "a positive number of seconds, or one with a unit: 90, 90s, 10m, 1h, 500ms";

/// Reads a duration: a positive number with an optional unit (`ms`, `s`, `m`, `h`; seconds
/// without one). `None` when the text is not one.
pub fn parse_duration(raw: &str) -> Option<Duration> {
    let text = raw.trim().to_ascii_lowercase();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale = match unit.trim() {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "m" => 60.0,
        "h" => 3600.0,
        _ => return None,
    };
    // Digits and at most one point: no signs, exponents, `inf` or `nan` get this far.
    if number.is_empty() || number == "." || number.matches('.').count() > 1 {
        return None;
    }
    let seconds = number.parse::<f64>().ok()? * scale;
    (seconds > 0.0)
        .then(|| Duration::try_from_secs_f64(seconds).ok())
        .flatten()
        .filter(|d| !d.is_zero())
}

/// Writes a duration as the decimal number of seconds the ranks read: `90`, `0.5`.
pub fn seconds_text(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        return d.as_secs().to_string();
    }
    let fraction = format!("{:09}", d.subsec_nanos());
    format!("{}.{}", d.as_secs(), fraction.trim_end_matches('0'))
}

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

/// What [`crate::sources`] says a valid `IVME_COLLECTIVE_TIMEOUT` looks like.
pub const DURATION_VALID: &str = DURATION_FORMS;

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
    fn durations_take_seconds_or_a_unit() {
        let secs = |raw: &str| parse_duration(raw).map(seconds_text);
        assert_eq!(secs("90").as_deref(), Some("90"));
        assert_eq!(secs("90s").as_deref(), Some("90"));
        assert_eq!(secs(" 10m ").as_deref(), Some("600"));
        assert_eq!(secs("1h").as_deref(), Some("3600"));
        assert_eq!(secs("1.5H").as_deref(), Some("5400"));
        assert_eq!(secs("500ms").as_deref(), Some("0.5"));
        assert_eq!(secs("0.25").as_deref(), Some("0.25"));
        assert_eq!(secs("1ms").as_deref(), Some("0.001"));
        for bad in [
            "",
            "0",
            "0s",
            "-5",
            "+5",
            "s",
            ".",
            "1.2.3",
            "5x",
            "5 m s",
            "1e3",
            "inf",
            "nan",
            "0.0000000001ms",
            "ten",
        ] {
            assert_eq!(parse_duration(bad), None, "{bad:?} was accepted");
        }
    }

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
