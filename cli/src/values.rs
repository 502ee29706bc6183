//! What each flag's value may be: the parsers behind [`Checked`](crate::cli::Checked), each
//! reading `(flag, raw, example)` into a value or saying, with the flag as typed and an
//! example, what to write instead.

use ivme::{BufferSync, Precision, Sharding};
use ivme_settings::Bound;
use std::time::Duration;

/// Any text: a file name, an address.
pub fn text(_: &str, raw: &str, _: &str) -> std::result::Result<String, String> {
    Ok(raw.to_string())
}

/// A switch's value (see [`SWITCH`]).
pub fn switch(flag: &str, raw: &str, _: &str) -> std::result::Result<bool, String> {
    match raw.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(format!(
            "`{flag}={raw}` is not on or off; write `{flag}` alone, or `{flag}=false`"
        )),
    }
}

/// A path.
pub fn path(_: &str, raw: &str, _: &str) -> std::result::Result<std::path::PathBuf, String> {
    Ok(raw.into())
}

/// Names separated by commas (machine addresses).
pub fn names(flag: &str, raw: &str, ex: &str) -> std::result::Result<Vec<String>, String> {
    let names: Vec<String> = raw.split(',').map(|n| n.trim().to_string()).collect();
    match names.iter().any(String::is_empty) {
        true => Err(format!(
            "`{flag} {raw}` has an empty name; write e.g. `{flag} {ex}`"
        )),
        false => Ok(names),
    }
}

/// A number of optimizer steps, 0 included.
pub fn steps(flag: &str, raw: &str, ex: &str) -> std::result::Result<u64, String> {
    raw.trim().parse().map_err(|_| {
        format!("`{flag} {raw}` is not a whole number of steps; write e.g. `{flag} {ex}` (0: off)")
    })
}

/// A whole number of at least 1 (the settings table's [`Bound::AtLeastOne`]).
pub fn positive(flag: &str, raw: &str, ex: &str) -> std::result::Result<usize, String> {
    let bound = Bound::AtLeastOne;
    match raw.trim().parse::<usize>() {
        Ok(n) if !bound.admits(n as f64) => Err(format!(
            "`{flag} {n}` is not allowed: use {}, e.g. `{flag} {ex}`",
            bound.wording()
        )),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "`{flag} {raw}` is not a whole number; write e.g. `{flag} {ex}`"
        )),
    }
}

/// A machine's rank, counted from 0.
pub fn machine_rank(flag: &str, raw: &str, ex: &str) -> std::result::Result<usize, String> {
    raw.trim().parse().map_err(|_| {
        format!(
            "`{flag} {raw}` is not a whole number; machine ranks count from 0, e.g. `{flag} {ex}`"
        )
    })
}

/// A TCP port, 1 to 65535.
pub fn port(flag: &str, raw: &str, ex: &str) -> std::result::Result<u16, String> {
    let n = positive(flag, raw, ex)?;
    u16::try_from(n)
        .map_err(|_| format!("`{flag} {n}` is not a port; use 1 to 65535, e.g. `{flag} {ex}`"))
}

/// How many times to relaunch a failed job: a whole number, 0 included (0 never relaunches).
pub fn restarts(flag: &str, raw: &str, ex: &str) -> std::result::Result<usize, String> {
    raw.trim().parse().map_err(|_| {
        format!(
            "`{flag} {raw}` is not a whole number; write how many times to relaunch a failed \
             job, e.g. `{flag} {ex}` (0 never relaunches)"
        )
    })
}

/// A positive duration (`90`, `90s`, `10m`, `1h`, `500ms`).
pub fn duration(flag: &str, raw: &str, ex: &str) -> std::result::Result<Duration, String> {
    ivme::env::parse_duration(raw).ok_or_else(|| {
        format!(
            "`{flag} {raw}` is not a duration; write {}, e.g. `{flag} {ex}`",
            ivme::env::DURATION_FORMS
        )
    })
}

/// Signals taken as a preemption (`TERM,USR1`, `none`), as the ranks read them.
pub fn signals(flag: &str, raw: &str, ex: &str) -> std::result::Result<String, String> {
    ivme::preempt::parse_signals(raw)
        .map(|_| raw.trim().to_string())
        .map_err(|_| {
            format!(
                "`{flag} {raw}` is not a list of signals; use names from TERM, USR1, USR2, HUP \
                 and INT separated by commas, e.g. `{flag} {ex}`, or `{flag} none`"
            )
        })
}

/// A process exit code from 1 to 255.
pub fn exit_code(flag: &str, raw: &str, ex: &str) -> std::result::Result<u8, String> {
    match raw.trim().parse::<u8>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "`{flag} {raw}` is not an exit code; use 1 to 255, e.g. `{flag} {ex}`"
        )),
    }
}

/// A compute precision (`no`, `fp16`, `bf16`).
pub fn precision(flag: &str, raw: &str, _: &str) -> std::result::Result<Precision, String> {
    raw.parse().map_err(|_| {
        format!(
            "`{flag} {raw}` is not a precision; use one of {}",
            Precision::VALID.join(", ")
        )
    })
}

/// How buffers agree across processes.
pub fn buffers(flag: &str, raw: &str, _: &str) -> std::result::Result<BufferSync, String> {
    raw.parse().map_err(|_| {
        format!(
            "`{flag} {raw}` is not a way for buffers to agree; use one of {}",
            BufferSync::VALID.join(", ")
        )
    })
}

/// A ZeRO sharding stage.
pub fn sharding(flag: &str, raw: &str, _: &str) -> std::result::Result<Sharding, String> {
    raw.parse().map_err(|_| {
        format!(
            "`{flag} {raw}` is not a sharding stage; use one of {}",
            Sharding::VALID.join(", ")
        )
    })
}
