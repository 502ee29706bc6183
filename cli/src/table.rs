//! The table of launch settings: each setting declared once, as one row, from which the
//! [`Settings`] struct, the flags of `ivme launch`, the layer of the launcher's environment, the
//! config file's keys, the variables every rank gets, `--dry_run`'s list and the settings table
//! of docs/launch.md are all made (row.rs says how). A new setting is one row here.

use crate::cli;
use crate::row::{Env, Flag, Row, Setting};
use crate::values;
use ivme::env;
use ivme::{BufferSync, Precision, Sharding};
use std::path::PathBuf;
use std::time::Duration;

/// Declares the settings: the [`Settings`] struct (one optional field per row, documented by
/// the row's doc line) and [`ROWS`], in the order `--dry_run` and the config file list them.
macro_rules! settings {
    ($(
        #[doc = $doc:literal]
        $key:ident: $ty:ty { $($field:ident: $value:expr),* $(,)? }
    )*) => {
        /// Every launch setting, each optional: one layer of them (the flags, the launcher's
        /// environment or the config file; sources.rs stacks the layers). `None` leaves the
        /// setting to a weaker layer, or the default.
        #[derive(Debug, Clone, Default, PartialEq)]
        pub struct Settings {
            $(#[doc = $doc] pub $key: Option<$ty>,)*
        }

        /// Every setting, in the order `--dry_run`, the config file and docs/launch.md list them.
        pub const ROWS: &[&dyn Setting<Settings>] = &[$(
            &Row::<Settings, $ty> {
                key: stringify!($key),
                doc: $doc,
                get: |s| &s.$key,
                set: |s| &mut s.$key,
                $($field: $value,)*
            },
        )*];
    };
}

/// The ways ranks can talk that this build launches.
pub const BACKENDS: &[&str] = &["mpi"];

/// One of the ways ranks talk that this build launches.
fn backend(flag: &str, raw: &str, _: &str) -> std::result::Result<String, String> {
    match BACKENDS.contains(&raw) {
        true => Ok(raw.to_string()),
        false => Err(format!(
            "`{flag} {raw}` is not a backend; use one of {}",
            BACKENDS.join(", ")
        )),
    }
}

fn none<T>() -> Option<T> {
    None
}

fn passed<T: ToString>(v: &T) -> Option<String> {
    Some(v.to_string())
}

fn not_passed<T>(_: &T) -> Option<String> {
    None
}

fn text<T: ToString>(v: &T) -> String {
    v.to_string()
}

fn seconds(d: &Duration) -> String {
    format!("{}s", env::seconds_text(*d))
}

settings! {
    /// Processes in total, over all machines.
    num_processes: usize {
        label: "processes", code: "", attribute: "",
        flag: Some(Flag {
            value_name: "count",
            help: "how many processes to start (default 1; more than 1 goes through mpirun)",
        }),
        example: "2", parse: values::positive, want: "a whole number of at least 1",
        env: None, file: true, show: text, default: || Some(1),
    }
    /// Compute on the CPU even where a GPU is present.
    cpu: bool {
        label: "CPU only", code: "`.cpu(true)` / `cpu = true`", attribute: "cpu",
        flag: Some(Flag {
            value_name: cli::SWITCH,
            help: "compute on the CPU even where a GPU is present (IVME_CPU=1)",
        }),
        example: "", parse: values::switch, want: "true or false (or 1 or 0)",
        env: Some(Env { var: env::CPU, read: true, to_ranks: |on| on.then(|| "1".into()) }),
        file: true, show: text, default: || Some(false),
    }
    /// Compute precision: no, fp16 or bf16.
    mixed_precision: Precision {
        label: "precision", code: "`.precision(..)` / `precision = \"..\"`",
        attribute: "precision",
        flag: Some(Flag {
            value_name: "no|fp16|bf16",
            help: "compute precision, passed as IVME_PRECISION",
        }),
        example: "bf16", parse: values::precision, want: "one of no, fp16, bf16",
        env: Some(Env { var: env::PRECISION, read: true, to_ranks: passed }),
        file: true, show: text, default: || Some(Precision::No),
    }
    /// ZeRO sharding: no, optimizer (stage 1) or gradients (stage 2); docs/sharding.md.
    sharding: Sharding {
        label: "sharding (ZeRO)", code: "`.sharding(..)` / `zero = 1 \\| 2`", attribute: "zero",
        flag: Some(Flag {
            value_name: "no|optimizer|gradients",
            help: "ZeRO sharding stage (or 0|1|2), passed as IVME_SHARDING",
        }),
        example: "gradients", parse: values::sharding, want: "one of no, optimizer, gradients",
        env: Some(Env { var: env::SHARDING, read: true, to_ranks: passed }),
        file: true, show: text, default: || Some(Sharding::No),
    }
    /// Buffers (BatchNorm statistics): broadcast, average or local; docs/buffers.md.
    buffers: BufferSync {
        label: "buffers", code: "`.buffers(..)` / `buffers = \"..\"`", attribute: "buffers",
        flag: Some(Flag {
            value_name: "broadcast|average|local",
            help: "how buffers (BatchNorm statistics) agree across processes, passed as IVME_BUFFERS",
        }),
        example: "average", parse: values::buffers, want: "one of broadcast, average, local",
        env: Some(Env { var: env::BUFFERS, read: true, to_ranks: passed }),
        file: true, show: text, default: || Some(BufferSync::default()),
    }
    /// Micro-batches per optimizer step.
    gradient_accumulation_steps: usize {
        label: "accumulation", code: "`.grad_accum(n)` / `grad_accum = n`",
        attribute: "grad_accum",
        flag: Some(Flag {
            value_name: "steps",
            help: "micro-batches per optimizer step, passed as IVME_GRAD_ACCUM",
        }),
        example: "4", parse: values::positive, want: "a whole number of at least 1",
        env: Some(Env { var: env::GRAD_ACCUM, read: true, to_ranks: passed }),
        file: true, show: text, default: || Some(1),
    }
    /// How the processes talk: mpi.
    backend: String {
        label: "how the processes talk", code: "", attribute: "",
        flag: None,
        example: "mpi", parse: backend, want: "one of mpi",
        env: None, file: true, show: text, default: || Some(BACKENDS[0].into()),
    }
    /// Machines in the run.
    num_machines: usize {
        label: "machines", code: "", attribute: "",
        flag: Some(Flag {
            value_name: "count",
            help: "machines in the run (more than 1 needs the config's `hosts` or --hostfile)",
        }),
        example: "2", parse: values::positive, want: "a whole number of at least 1",
        env: Some(Env {
            var: env::NUM_MACHINES,
            read: false,
            to_ranks: |&n| (n > 1).then(|| n.to_string()),
        }),
        file: true, show: text, default: || Some(1),
    }
    /// This machine's rank; only rank 0 runs `ivme launch`, which starts every machine's ranks.
    machine_rank: usize {
        label: "this machine's rank", code: "", attribute: "",
        flag: Some(Flag {
            value_name: "rank",
            help: "this machine's rank; only rank 0 starts anything (it starts every machine's ranks)",
        }),
        example: "0", parse: values::machine_rank, want: "a whole number of at least 0",
        env: None, file: true, show: text, default: || Some(0),
    }
    /// The main machine's (rank 0's) address.
    main_process_ip: String {
        label: "the main machine's address", code: "", attribute: "",
        flag: Some(Flag {
            value_name: "address",
            help: "the main machine's address (the first of the machines), as IVME_MAIN_PROCESS_IP",
        }),
        example: "10.0.0.1", parse: values::text,
        want: "a non-empty string without spaces, in quotes",
        env: Some(Env { var: env::MAIN_PROCESS_IP, read: false, to_ranks: passed }),
        file: true, show: text, default: none,
    }
    /// The rendezvous port on the main machine.
    main_process_port: u16 {
        label: "rendezvous port", code: "", attribute: "",
        flag: Some(Flag {
            value_name: "port",
            help: "rendezvous port on the main machine, passed as IVME_MAIN_PROCESS_PORT",
        }),
        example: "29500", parse: values::port, want: "a whole number from 1 to 65535",
        env: Some(Env { var: env::MAIN_PROCESS_PORT, read: false, to_ranks: passed }),
        file: true, show: text, default: none,
    }
    /// MPI hostfile listing the machines (`host slots=N` per line).
    hostfile: PathBuf {
        label: "machines from a hostfile", code: "", attribute: "",
        flag: Some(Flag {
            value_name: "file",
            help: "machines to run on, one per line (`node1 slots=4`), handed to mpirun",
        }),
        example: "hosts.txt", parse: values::path, want: "the hostfile's path, in quotes",
        env: None, file: true, show: |p| p.display().to_string(), default: none,
    }
    /// Every machine's address, the main one first.
    hosts: Vec<String> {
        label: "machines by address", code: "", attribute: "",
        flag: None,
        example: "node1,node2", parse: values::names,
        want: "a list of machine addresses, e.g. [\"node1\", \"node2\"]",
        env: None, file: true, show: |h| format!("[{}]", h.join(", ")), default: none,
    }
    /// Start a failed job again up to this many times (from its newest checkpoint).
    max_restarts: usize {
        label: "restarts", code: "", attribute: "",
        flag: Some(Flag {
            value_name: "count",
            help: "relaunch a failed job up to this many times (default 0); ranks see IVME_RESTART_COUNT",
        }),
        example: "3", parse: values::restarts, want: "a whole number of at least 0",
        env: None, file: true, show: text, default: || Some(0),
    }
    /// After a lost machine, restart on the machines that still answer, if at least this many.
    min_machines: usize {
        label: "elastic restarts", code: "", attribute: "",
        flag: Some(Flag {
            value_name: "count",
            help: "a restart leaves out machines that no longer answer over ssh and runs on the rest (their ranks only) if at least this many remain; without it a restart needs every machine",
        }),
        example: "2", parse: values::positive, want: "a whole number of at least 1",
        env: None, file: true, show: text, default: none,
    }
    /// The deadline of every collective.
    collective_timeout: Duration {
        label: "collective deadline", code: "`.collective_timeout(..)` / `collective_timeout = s`",
        attribute: "collective_timeout",
        flag: Some(Flag {
            value_name: "duration",
            help: "deadline of each collective (90, 90s, 10m, 1h, 500ms), as IVME_COLLECTIVE_TIMEOUT seconds",
        }),
        example: "10m", parse: values::duration, want: env::DURATION_FORMS,
        env: Some(Env {
            var: env::COLLECTIVE_TIMEOUT,
            read: true,
            to_ranks: |&t| Some(env::seconds_text(t)),
        }),
        file: false, show: seconds, default: none,
    }
    /// Whether the ranks check that they call the same collectives in the same order.
    debug_sync: bool {
        label: "collective order check", code: "`.debug_sync(true)` / `debug_sync = true`",
        attribute: "debug_sync",
        flag: Some(Flag {
            value_name: cli::SWITCH,
            help: "check that the ranks call the same collectives in the same order (IVME_DEBUG_SYNC=1)",
        }),
        example: "", parse: values::switch, want: "1 or 0 (also true/false)",
        env: Some(Env { var: env::DEBUG_SYNC, read: true, to_ranks: |on| on.then(|| "1".into()) }),
        file: false, show: text, default: || Some(false),
    }
    /// Whether the optimizer steps during the gradient sync, bucket by bucket.
    overlap: bool {
        label: "optimizer overlapped with the sync", code: "`.overlap(true)` / `overlap = true`",
        attribute: "overlap",
        flag: Some(Flag {
            value_name: cli::SWITCH,
            help: "step the optimizer inside backward, each bucket's part while later buckets are averaged (IVME_OVERLAP=1)",
        }),
        example: "", parse: values::switch, want: "1 or 0 (also true/false)",
        env: Some(Env { var: env::OVERLAP, read: true, to_ranks: |on| on.then(|| "1".into()) }),
        file: false, show: text, default: || Some(false),
    }
    /// The signals taken as a preemption.
    preempt_signals: String {
        label: "preemption signals", code: "", attribute: "",
        flag: Some(Flag {
            value_name: "list",
            help: "signals that stop the job for a preemption (default TERM,USR1; none), IVME_PREEMPT_SIGNALS",
        }),
        example: "TERM,USR1", parse: values::signals, want: env::PREEMPT_SIGNALS.values,
        env: Some(Env { var: env::PREEMPT_SIGNALS, read: true, to_ranks: passed }),
        file: false, show: text, default: || Some(ivme::preempt::DEFAULT_SIGNALS.into()),
    }
    /// How long a preempted rank may take to stop and save.
    preempt_grace: Duration {
        label: "preemption grace period", code: "", attribute: "",
        flag: Some(Flag {
            value_name: "duration",
            help: "how long a preempted rank may take to stop and save (default 25s), IVME_PREEMPT_GRACE",
        }),
        example: "60s", parse: values::duration, want: env::DURATION_FORMS,
        env: Some(Env {
            var: env::PREEMPT_GRACE,
            read: true,
            to_ranks: |&t| Some(env::seconds_text(t)),
        }),
        file: false, show: seconds, default: || Some(ivme::preempt::DEFAULT_GRACE),
    }
    /// The launcher's exit code after a preemption, for a scheduler to requeue on.
    requeue_exit_code: u8 {
        label: "exit code after a preemption", code: "", attribute: "",
        flag: Some(Flag {
            value_name: "code",
            help: "the launcher's exit code after a preemption, for a scheduler to requeue on (default 75)",
        }),
        example: "75", parse: values::exit_code, want: env::REQUEUE_EXIT_CODE.values,
        env: Some(Env { var: env::REQUEUE_EXIT_CODE, read: true, to_ranks: not_passed }),
        file: false, show: text,
        default: || Some(ivme::preempt::DEFAULT_REQUEUE_EXIT_CODE as u8),
    }
    /// Keep a snapshot of the training state in memory every this many optimizer steps.
    snapshot_every: u64 {
        label: "in-memory snapshots", code: "`.snapshot_every(k)` / `snapshot_every = k`",
        attribute: "snapshot_every",
        flag: Some(Flag {
            value_name: "steps",
            help: "keep the training state in memory every N optimizer steps, for restarts (0: off), IVME_SNAPSHOT_EVERY",
        }),
        example: "100", parse: values::steps, want: env::SNAPSHOT_EVERY.values,
        env: Some(Env { var: env::SNAPSHOT_EVERY, read: true, to_ranks: passed }),
        file: true, show: text, default: || Some(0),
    }
    /// Profile the run into this folder: each rank's phases per step, traces and a summary.
    profile: PathBuf {
        label: "profile", code: "`.profile(dir)` / `profile = \"dir\"`",
        attribute: "profile",
        flag: Some(Flag {
            value_name: "dir",
            help: "record each rank's phases per step into DIR (Chrome traces, a summary at the end; `ivme profile DIR` draws it), IVME_PROFILE",
        }),
        example: "runs/profile", parse: values::path, want: env::PROFILE.values,
        env: Some(Env {
            var: env::PROFILE,
            read: true,
            to_ranks: |p| Some(std::path::absolute(p).unwrap_or_else(|_| p.clone()).display().to_string()),
        }),
        file: true, show: |p| p.display().to_string(), default: none,
    }
}

/// The row of the setting with this key.
pub fn row(key: &str) -> Option<&'static dyn Setting<Settings>> {
    ROWS.iter().copied().find(|r| r.key() == key)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The settings table of docs/launch.md, header included.
    fn docs_table() -> Vec<String> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/launch.md");
        let text = std::fs::read_to_string(path).unwrap();
        text.lines()
            .skip_while(|l| !l.starts_with("| setting | in code |"))
            .take_while(|l| l.starts_with('|'))
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn the_docs_show_every_row_as_it_is() {
        let mut want = vec![
            "| setting | in code | launcher flag | environment | config file |".to_string(),
            "|---|---|---|---|---|".to_string(),
        ];
        want.extend(ROWS.iter().map(|r| r.docs_line()));
        assert_eq!(
            docs_table(),
            want,
            "docs/launch.md's settings table differs from the rows in cli/src/table.rs; \
             write the rows' lines there:\n{}",
            want.join("\n")
        );
    }

    #[test]
    fn the_attribute_has_each_rows_key_and_takes_the_settings_name_for_it() {
        for row in ROWS.iter().filter(|r| !r.attribute().is_empty()) {
            let (key, attribute) = (row.key(), row.attribute());
            assert!(
                ivme_macros_core::KEYS.contains(&attribute),
                "`{key}`: the attribute has no key `{attribute}`"
            );
            assert!(
                key == attribute || ivme_macros_core::ALIASES.contains(&(key, attribute)),
                "`{key}` written in the attribute should point to `{attribute}`"
            );
        }
    }

    #[test]
    fn the_words_a_row_wants_are_the_librarys_own() {
        let one_of = |valid: &[&str]| format!("one of {}", valid.join(", "));
        let want = |key| row(key).map(|r| r.want()).unwrap();
        assert_eq!(want("mixed_precision"), one_of(Precision::VALID));
        assert_eq!(want("buffers"), one_of(BufferSync::VALID));
        assert_eq!(
            want("sharding"),
            one_of(&Sharding::VALID[..3]),
            "{:?}",
            Sharding::VALID
        );
        assert_eq!(want("backend"), one_of(BACKENDS));
    }

    #[test]
    fn every_rows_variable_is_in_the_launcher_contract() {
        for row in ROWS {
            if let Some(var) = row.env_layer() {
                assert!(env::VARS.iter().any(|v| v.name == var), "{var}");
            }
        }
        let keys: Vec<&str> = ROWS.iter().map(|r| r.key()).collect();
        let mut unique = keys.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), keys.len(), "a key twice: {keys:?}");
    }
}
