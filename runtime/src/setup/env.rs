//! The launcher contract: every environment variable that `ivme launch` sets for the processes
//! it starts (or that a user sets for it), what it means, and how it is read.
//!
//! The variables themselves are declared once, in the settings table's crate
//! ([`ivme_settings::vars`], re-exported here), so that each is spelled once; this module adds
//! how their values are parsed. [`VARS`] is the table that `docs/launch.md` shows (a test keeps
//! the two equal). The MPI launcher's own variables, from which each process learns its rank,
//! are listed in [`RANK_FAMILIES`].

use std::time::Duration;

pub use ivme_settings::vars::*;

/// The MPI launchers' variables a process reads its place from: rank, world size, local rank
/// and local world size, per launcher family (Open MPI, MPICH/Hydra, PMIx); the first family
/// present wins.
pub const RANK_FAMILIES: &[[&str; 4]] = &[
    [
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ],
    ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
    [
        "PMIX_RANK",
        "PMIX_SIZE",
        "PMIX_LOCAL_RANK",
        "PMIX_LOCAL_SIZE",
    ],
];

/// SLURM's variables for a task `srun` started, read when no MPI family above is present
/// (setup/state.rs): the task's rank, the step's task count, the rank on this node, this
/// node's index and the step's tasks per node (`2(x3),1`).
pub const SLURM_PROCID: &str = "SLURM_PROCID";
/// See [`SLURM_PROCID`].
pub const SLURM_STEP_NUM_TASKS: &str = "SLURM_STEP_NUM_TASKS";
/// See [`SLURM_PROCID`].
pub const SLURM_LOCALID: &str = "SLURM_LOCALID";
/// See [`SLURM_PROCID`].
pub const SLURM_NODEID: &str = "SLURM_NODEID";
/// See [`SLURM_PROCID`].
pub const SLURM_STEP_TASKS_PER_NODE: &str = "SLURM_STEP_TASKS_PER_NODE";

/// candle's variable for how many times the idle worker of its CPU pool spins before it sleeps
/// (candle's default: 25 000). The Accelerator's build and `ivme launch` set it to
/// [`CANDLE_SPIN_LIMIT`] where the environment does not have it (the reason is in
/// docs/performance.md).
pub const CANDLE_SPIN_VAR: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";

/// The spin limit ivme gives candle's pool: enough to catch an op that follows at once.
pub const CANDLE_SPIN_LIMIT: &str = "1000";

/// Reads an on/off value: `1`, `true`, `on`, `yes` or `0`, `false`, `off`, `no` (any case).
pub fn parse_bool(raw: &str) -> Option<bool> {
    match raw.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

/// The forms [`parse_duration`] reads, for error messages.
pub const DURATION_FORMS: &str =
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
    fn on_off_values_in_any_spelling_and_nothing_else() {
        for on in ["1", "true", "ON", " yes "] {
            assert_eq!(parse_bool(on), Some(true), "{on}");
        }
        for off in ["0", "False", "off", "no"] {
            assert_eq!(parse_bool(off), Some(false), "{off}");
        }
        assert_eq!(parse_bool("maybe"), None);
        assert_eq!(parse_bool(""), None);
    }

    #[test]
    fn docs_launch_md_lists_exactly_these_variables() {
        let doc = include_str!("../../../docs/launch.md");
        let rows: Vec<&str> = doc.lines().filter(|l| l.starts_with("| `IVME_")).collect();
        for v in VARS {
            let row = rows
                .iter()
                .find(|r| r.starts_with(&format!("| `{}` |", v.name)));
            let row = row.unwrap_or_else(|| panic!("docs/launch.md has no row for {}", v.name));
            let values = v.values.replace('|', "\\|");
            assert!(row.contains(&values), "{}: {row}", v.name);
        }
        assert_eq!(rows.len(), VARS.len(), "{rows:#?}");
    }

    #[test]
    fn every_variable_is_named_once() {
        let mut names: Vec<&str> = VARS.iter().map(|v| v.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), VARS.len());
        assert!(names.iter().all(|n| n.starts_with("IVME_")));
    }
}
