//! The launcher contract: every `IVME_*` environment variable that `ivme launch` sets for the
//! processes it starts (or that a user sets for it), what it means, and how it is read.
//!
//! The library (`ivme::env` re-exports this module) and the `ivme` command both name these
//! variables through this module only, so each is spelled and documented once; [`VARS`] is the
//! table that `docs/launch.md` shows (a test of `ivme` keeps the two equal). A setting's row in
//! [`crate::SETTINGS`] points at its variable here.

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
    values: "no, optimizer, gradients or parameters (or 0, 1, 2, 3)",
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
/// Activation checkpointing.
pub const ACTIVATION_CHECKPOINTING: Var = Var {
    name: "IVME_ACTIVATION_CHECKPOINTING",
    set_by: SetBy::Launcher,
    values: "1 or 0 (also true/false)",
    meaning: "drop each checkpointed segment's activations after its forward and run it again in `backward` (`--activation_checkpointing`, `activation_checkpointing = true`; docs/sharding.md)",
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
/// Turns the optimizers' fused kernels off, to compare them with the op-by-op path.
pub const FUSED_OPTIMIZER: Var = Var {
    name: "IVME_FUSED_OPTIMIZER",
    set_by: SetBy::User,
    values: "0 to turn off",
    meaning: "the optimizers' fused step over each parameter (on by default); 0 runs the op-by-op path instead, to compare",
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
    ACTIVATION_CHECKPOINTING,
    FLOPS_PER_SAMPLE,
    PEAK_FLOPS,
    FUSED_OPTIMIZER,
];
