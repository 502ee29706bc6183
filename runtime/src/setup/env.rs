//! The launcher contract: every environment variable that `ivme launch` sets for the processes
//! it starts (or that a user sets for it), what it means, and how it is read.
//!
//! The library and the `ivme` command both name and parse these variables through this module
//! only, so each is spelled, parsed and documented once; [`VARS`] is the table that
//! `docs/launch.md` shows (a test keeps the two equal). The MPI launcher's own variables, from
//! which each process learns its rank, are listed in [`RANK_FAMILIES`].

use std::time::Duration;

/// Who sets a variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetBy {
    /// `ivme launch` sets it for every rank (from its flags, config file or own environment).
    Launcher,
    /// A user sets it, for the launcher or a program; `ivme launch` passes `IVME_*` on.
    User,
}

/// One variable of the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Var {
    /// Its name.
    pub name: &'static str,
    /// Who sets it.
    pub set_by: SetBy,
    /// What a valid value looks like.
    pub values: &'static str,
    /// What it does.
    pub meaning: &'static str,
}

impl Var {
    /// Its value in this process's environment, trimmed; `None` when unset or blank.
    pub fn get(&self) -> Option<String> {
        lookup(self.name, |k| std::env::var(k).ok())
    }
}

/// `name`'s value through `get` (the process environment, or a launcher's list), trimmed;
/// `None` when unset or blank.
pub fn lookup(name: &str, get: impl Fn(&str) -> Option<String>) -> Option<String> {
    get(name)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// Run on the CPU even where a GPU is present.
pub const CPU: Var = Var {
    name: "IVME_CPU",
    set_by: SetBy::Launcher,
    values: "1 or 0 (also true/false)",
    meaning: "compute on the CPU even where a GPU is present (`--cpu`, `cpu = true`)",
};
/// The compute precision.
pub const PRECISION: Var = Var {
    name: "IVME_PRECISION",
    set_by: SetBy::Launcher,
    values: "no, fp16 or bf16",
    meaning: "mixed precision (`--mixed_precision`, `mixed_precision = ..`)",
};
/// The sharding stage.
pub const SHARDING: Var = Var {
    name: "IVME_SHARDING",
    set_by: SetBy::Launcher,
    values: "no, optimizer or gradients (or 0, 1, 2)",
    meaning: "ZeRO sharding stage (`--sharding`, `sharding = ..`)",
};
/// How model buffers agree across processes.
pub const BUFFERS: Var = Var {
    name: "IVME_BUFFERS",
    set_by: SetBy::Launcher,
    values: "broadcast, average or local",
    meaning: "how buffers such as BatchNorm statistics agree across processes (`--buffers`, `buffers = ..`)",
};
/// Micro-batches per optimizer step.
pub const GRAD_ACCUM: Var = Var {
    name: "IVME_GRAD_ACCUM",
    set_by: SetBy::Launcher,
    values: "a whole number of at least 1",
    meaning: "micro-batches per optimizer step (`--gradient_accumulation_steps`)",
};
/// The deadline of each collective.
pub const COLLECTIVE_TIMEOUT: Var = Var {
    name: "IVME_COLLECTIVE_TIMEOUT",
    set_by: SetBy::Launcher,
    values: "seconds (90, 0.5) or with a unit: 90s, 10m, 1h, 500ms",
    meaning: "deadline of each collective, after which every rank stops naming the late one (`--collective_timeout`)",
};
/// The cross-rank check of every collective.
pub const DEBUG_SYNC: Var = Var {
    name: "IVME_DEBUG_SYNC",
    set_by: SetBy::Launcher,
    values: "1 or 0 (also true/false)",
    meaning: "check that the ranks call the same collectives in the same order (`--debug_sync`)",
};
/// How many times the job was restarted.
pub const RESTART_COUNT: Var = Var {
    name: "IVME_RESTART_COUNT",
    set_by: SetBy::Launcher,
    values: "0 on the first run, then 1, 2, ...",
    meaning: "how many times `--max_restarts` relaunched the job",
};
/// The number of processes of the job.
pub const NUM_PROCESSES: Var = Var {
    name: "IVME_NUM_PROCESSES",
    set_by: SetBy::Launcher,
    values: "a whole number",
    meaning: "processes in the job, over all machines",
};
/// Marks a process started by `ivme launch`.
pub const LAUNCHER: Var = Var {
    name: "IVME_LAUNCHER",
    set_by: SetBy::Launcher,
    values: "ivme",
    meaning: "set on every process `ivme launch` starts",
};
/// The number of machines of the job.
pub const NUM_MACHINES: Var = Var {
    name: "IVME_NUM_MACHINES",
    set_by: SetBy::Launcher,
    values: "a whole number (only with more than one machine)",
    meaning: "machines in the job",
};
/// The main machine's address.
pub const MAIN_PROCESS_IP: Var = Var {
    name: "IVME_MAIN_PROCESS_IP",
    set_by: SetBy::Launcher,
    values: "an address",
    meaning: "the main machine's address (`--main_process_ip`), for backends that rendezvous there",
};
/// The rendezvous port on the main machine.
pub const MAIN_PROCESS_PORT: Var = Var {
    name: "IVME_MAIN_PROCESS_PORT",
    set_by: SetBy::Launcher,
    values: "a port number",
    meaning: "the rendezvous port on the main machine (`--main_process_port`)",
};
/// The config file the command reads.
pub const CONFIG: Var = Var {
    name: "IVME_CONFIG",
    set_by: SetBy::User,
    values: "a path",
    meaning: "the config file `ivme launch` and `ivme config` read (default ~/.config/ivme/default_config.toml)",
};
/// The mpirun the launcher runs.
pub const MPIRUN: Var = Var {
    name: "IVME_MPIRUN",
    set_by: SetBy::User,
    values: "a path",
    meaning: "the mpirun `ivme launch` runs (default: the one on PATH)",
};
/// Turns off the allocator tuning (the Accelerator's `mallopt` and the launcher's variables).
pub const MALLOC_TUNING: Var = Var {
    name: "IVME_MALLOC_TUNING",
    set_by: SetBy::User,
    values: "0 to turn off",
    meaning: "building an Accelerator tunes glibc's allocator (mallopt), and `ivme launch` sets MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ for its ranks, unless this is 0",
};
/// The log level of `logging::init`.
pub const LOG_LEVEL: Var = Var {
    name: "IVME_LOG_LEVEL",
    set_by: SetBy::User,
    values: "error, warn, info, debug or trace",
    meaning: "the level of `ivme::logging` (RUST_LOG is read too)",
};
/// Turns progress bars off.
pub const PROGRESS: Var = Var {
    name: "IVME_PROGRESS",
    set_by: SetBy::User,
    values: "0 to turn off",
    meaning: "progress bars of `accelerator.progress(..)` (drawn only on a terminal)",
};
/// The signals taken as a preemption.
pub const PREEMPT_SIGNALS: Var = Var {
    name: "IVME_PREEMPT_SIGNALS",
    set_by: SetBy::User,
    values: "signal names: TERM,USR1 (the default), USR2, HUP, INT, or none",
    meaning: "signals that make the launcher and every rank stop at the next optimizer step, save and exit for a requeue (docs/faults.md)",
};
/// How long a preempted rank may take to stop.
pub const PREEMPT_GRACE: Var = Var {
    name: "IVME_PREEMPT_GRACE",
    set_by: SetBy::User,
    values: "a duration (default 25s)",
    meaning: "after a preemption signal a rank still running this long exits; set it below the scheduler's own grace",
};
/// The launcher's exit code after a preemption.
pub const REQUEUE_EXIT_CODE: Var = Var {
    name: "IVME_REQUEUE_EXIT_CODE",
    set_by: SetBy::User,
    values: "1 to 255 (default 75)",
    meaning: "the exit code of `ivme launch` when the job stopped for a preemption, for a scheduler to requeue on",
};
/// The interval of in-memory snapshots.
pub const SNAPSHOT_EVERY: Var = Var {
    name: "IVME_SNAPSHOT_EVERY",
    set_by: SetBy::User,
    values: "a whole number of optimizer steps (0, the default: off)",
    meaning: "keep a snapshot of the training state in memory every N optimizer steps (`--snapshot_every`); a restart by `ivme launch --max_restarts` resumes from it when it is newer than the newest checkpoint (docs/faults.md)",
};
/// Where in-memory snapshots go.
pub const SNAPSHOT_DIR: Var = Var {
    name: "IVME_SNAPSHOT_DIR",
    set_by: SetBy::Launcher,
    values: "a path, in /dev/shm where there is one",
    meaning: "the folder in which the ranks of one `ivme launch` keep their in-memory snapshots across restarts; removed when the launcher ends",
};
/// How often the step-time report is printed.
pub const STEP_TIMES: Var = Var {
    name: "IVME_STEP_TIMES",
    set_by: SetBy::User,
    values: "a whole number of optimizer steps (0 or unset: never)",
    meaning: "print where each rank's step time goes (data, forward, backward, sync, optimizer, checkpoints) every N optimizer steps, at the loop's preemption point (`print_step_times`)",
};
/// Where a profile of the run goes.
pub const PROFILE: Var = Var {
    name: "IVME_PROFILE",
    set_by: SetBy::User,
    values: "a folder (unset: no profile)",
    meaning: "record every rank's phases per step (data, backward, sync and its collectives, optimizer, checkpoint stalls) and write a Chrome trace and record per rank into the folder, with a summary at `end_training` (`--profile`, `.profile(dir)`; docs/profiling.md)",
};
/// The overlapped gradient sync.
pub const OVERLAP: Var = Var {
    name: "IVME_OVERLAP",
    set_by: SetBy::Launcher,
    values: "1 or 0 (also true/false)",
    meaning: "step the optimizer inside `backward`, each bucket's part while later buckets are still being averaged (`--overlap`, `overlap = true`; docs/performance.md)",
};
/// The model's FLOPs per sample, for a profile's FLOP rate.
pub const FLOPS_PER_SAMPLE: Var = Var {
    name: "IVME_FLOPS_PER_SAMPLE",
    set_by: SetBy::User,
    values: "a positive number, e.g. 6e9",
    meaning: "the model's FLOPs per sample (forward and backward): a profile's summary then gives the model FLOP/s (`.flops_per_sample(f)`)",
};
/// The device's peak FLOP/s, for a profile's model FLOP utilisation.
pub const PEAK_FLOPS: Var = Var {
    name: "IVME_PEAK_FLOPS",
    set_by: SetBy::User,
    values: "a positive number of FLOP/s per process, e.g. 989e12",
    meaning: "each process's peak FLOP/s: with the FLOPs per sample, a profile's summary gives the model FLOP utilisation (`.peak_flops(f)`)",
};

/// Every variable of the contract, in the order docs/launch.md lists them.
pub const VARS: &[Var] = &[
    CPU,
    PRECISION,
    SHARDING,
    BUFFERS,
    GRAD_ACCUM,
    COLLECTIVE_TIMEOUT,
    DEBUG_SYNC,
    RESTART_COUNT,
    NUM_PROCESSES,
    LAUNCHER,
    NUM_MACHINES,
    MAIN_PROCESS_IP,
    MAIN_PROCESS_PORT,
    CONFIG,
    MPIRUN,
    MALLOC_TUNING,
    LOG_LEVEL,
    PROGRESS,
    PREEMPT_SIGNALS,
    PREEMPT_GRACE,
    REQUEUE_EXIT_CODE,
    SNAPSHOT_EVERY,
    SNAPSHOT_DIR,
    STEP_TIMES,
    PROFILE,
    OVERLAP,
    FLOPS_PER_SAMPLE,
    PEAK_FLOPS,
];

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
