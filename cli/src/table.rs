//! The table of launch settings: each setting declared once, as one row, from which the
//! [`Settings`] struct, the flags of `ivme launch`, the layer of the launcher's environment, the
//! config file's keys, the variables every rank gets, `--dry_run`'s list and the settings table
//! of docs/launch.md are all made (row.rs says how). A new setting is one row here.

use crate::cli;
use crate::row::{Env, Flag, Row, Setting};
use crate::values;
use ivme::env;
use ivme::{BufferSync, Precision, Sharding};
use ivme_settings::{self as table, Bound};
use std::path::PathBuf;
use std::time::Duration;

/// Declares the settings: the [`Settings`] struct (one optional field per row, documented by
/// the row's doc line) and [`ROWS`], in the order `--dry_run` and the config file list them.
macro_rules! settings {
    ($(
        $key:ident = $row:ident: $ty:ty { $($field:ident: $value:expr),* $(,)? }
    )*) => {
        /// Every launch setting, each optional: one layer of them (the flags, the launcher's
        /// environment or the config file; sources.rs stacks the layers). `None` leaves the
        /// setting to a weaker layer, or the default. Each field is named as its row's
        /// `launch` name in the settings table, which says what it is.
        #[derive(Debug, Clone, Default, PartialEq)]
        pub struct Settings {
            $(#[doc = concat!("The `", stringify!($key), "` setting.")] pub $key: Option<$ty>,)*
        }

        /// Every setting, in the order `--dry_run`, the config file and docs/launch.md list them.
        pub const ROWS: &[&dyn Setting<Settings>] = &[$(
            &Row::<Settings, $ty> {
                key: launch_name(&table::$row),
                doc: table::$row.doc,
                attribute: match table::$row.attribute {
                    Some(key) => key,
                    None => "",
                },
                var: table::$row.var,
                get: |s| &s.$key,
                set: |s| &mut s.$key,
                $($field: $value,)*
            },
        )*];

        /// Each row's field name and its row in the settings table, for the test that keeps
        /// the two equal.
        #[cfg(test)]
        const FIELDS: &[(&str, &table::Setting)] = &[$((stringify!($key), &table::$row)),*];
    };
}

/// A row's name in `ivme launch` (its flag and config key); every row of the command has one.
const fn launch_name(row: &table::Setting) -> &'static str {
    match row.launch {
        Some(name) => name,
        None => panic!("a row of `ivme launch` without a launch name in the settings table"),
    }
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
    num_processes = NUM_PROCESSES: usize {
        label: "processes", code: "", flag: Some(Flag {
            value_name: "count",
            help: "how many processes to start (default 1; more than 1 goes through mpirun)",
        }),
        example: "2", parse: values::positive, want: Bound::AtLeastOne.wording(),
        env: None, file: true, show: text, default: || Some(1),
    }
    cpu = CPU: bool {
        label: "CPU only", code: "`.cpu(true)` / `cpu = true`", flag: Some(Flag {
            value_name: cli::SWITCH,
            help: "compute on the CPU even where a GPU is present (IVME_CPU=1)",
        }),
        example: "", parse: values::switch, want: "true or false (or 1 or 0)",
        env: Some(Env { read: true, to_ranks: |on| on.then(|| "1".into()) }),
        file: true, show: text, default: || Some(false),
    }
    mixed_precision = PRECISION: Precision {
        label: table::PRECISION.name, code: "`.precision(..)` / `precision = \"..\"`",
        flag: Some(Flag {
            value_name: "no|fp16|bf16",
            help: "compute precision, passed as IVME_PRECISION",
        }),
        example: "bf16", parse: values::precision, want: "one of no, fp16, bf16",
        env: Some(Env { read: true, to_ranks: passed }),
        file: true, show: text, default: || Some(Precision::No),
    }
    sharding = SHARDING: Sharding {
        label: "sharding (ZeRO)", code: "`.sharding(..)` / `zero = 1 \\| 2 \\| 3`", flag: Some(Flag {
            value_name: "no|optimizer|gradients|parameters",
            help: "ZeRO sharding stage (or 0|1|2|3), passed as IVME_SHARDING",
        }),
        example: "gradients", parse: values::sharding,
        want: "one of no, optimizer, gradients, parameters",
        env: Some(Env { read: true, to_ranks: passed }),
        file: true, show: text, default: || Some(Sharding::No),
    }
    buffers = BUFFERS: BufferSync {
        label: table::BUFFERS.name, code: "`.buffers(..)` / `buffers = \"..\"`", flag: Some(Flag {
            value_name: "broadcast|average|local",
            help: "how buffers (BatchNorm statistics) agree across processes, passed as IVME_BUFFERS",
        }),
        example: "average", parse: values::buffers, want: "one of broadcast, average, local",
        env: Some(Env { read: true, to_ranks: passed }),
        file: true, show: text, default: || Some(BufferSync::default()),
    }
    gradient_accumulation_steps = GRAD_ACCUM: usize {
        label: "accumulation", code: "`.grad_accum(n)` / `grad_accum = n`",
        flag: Some(Flag {
            value_name: "steps",
            help: "micro-batches per optimizer step, passed as IVME_GRAD_ACCUM",
        }),
        example: "4", parse: values::positive, want: Bound::AtLeastOne.wording(),
        env: Some(Env { read: true, to_ranks: passed }),
        file: true, show: text, default: || Some(1),
    }
    backend = BACKEND: String {
        label: "how the processes talk", code: "", flag: None,
        example: "mpi", parse: backend, want: "one of mpi",
        env: None, file: true, show: text, default: || Some(BACKENDS[0].into()),
    }
    num_machines = NUM_MACHINES: usize {
        label: "machines", code: "", flag: Some(Flag {
            value_name: "count",
            help: "machines in the run (more than 1 needs the config's `hosts` or --hostfile)",
        }),
        example: "2", parse: values::positive, want: Bound::AtLeastOne.wording(),
        env: Some(Env {
            read: false,
            to_ranks: |&n| (n > 1).then(|| n.to_string()),
        }),
        file: true, show: text, default: || Some(1),
    }
    machine_rank = MACHINE_RANK: usize {
        label: "this machine's rank", code: "", flag: Some(Flag {
            value_name: "rank",
            help: "this machine's rank; only rank 0 starts anything (it starts every machine's ranks)",
        }),
        example: "0", parse: values::machine_rank, want: Bound::AtLeastZero.wording(),
        env: None, file: true, show: text, default: || Some(0),
    }
    main_process_ip = MAIN_PROCESS_IP: String {
        label: "the main machine's address", code: "", flag: Some(Flag {
            value_name: "address",
            help: "the main machine's address (the first of the machines), as IVME_MAIN_PROCESS_IP",
        }),
        example: "10.0.0.1", parse: values::text,
        want: "a non-empty string without spaces, in quotes",
        env: Some(Env { read: false, to_ranks: passed }),
        file: true, show: text, default: none,
    }
    main_process_port = MAIN_PROCESS_PORT: u16 {
        label: "rendezvous port", code: "", flag: Some(Flag {
            value_name: "port",
            help: "rendezvous port on the main machine, passed as IVME_MAIN_PROCESS_PORT",
        }),
        example: "29500", parse: values::port, want: "a whole number from 1 to 65535",
        env: Some(Env { read: false, to_ranks: passed }),
        file: true, show: text, default: none,
    }
    hostfile = HOSTFILE: PathBuf {
        label: "machines from a hostfile", code: "", flag: Some(Flag {
            value_name: "file",
            help: "machines to run on, one per line (`node1 slots=4`), handed to mpirun",
        }),
        example: "hosts.txt", parse: values::path, want: "the hostfile's path, in quotes",
        env: None, file: true, show: |p| p.display().to_string(), default: none,
    }
    hosts = HOSTS: Vec<String> {
        label: "machines by address", code: "", flag: None,
        example: "node1,node2", parse: values::names,
        want: "a list of machine addresses, e.g. [\"node1\", \"node2\"]",
        env: None, file: true, show: |h| format!("[{}]", h.join(", ")), default: none,
    }
    max_restarts = MAX_RESTARTS: usize {
        label: "restarts", code: "", flag: Some(Flag {
            value_name: "count",
            help: "relaunch a failed job up to this many times (default 0); ranks see IVME_RESTART_COUNT",
        }),
        example: "3", parse: values::restarts, want: Bound::AtLeastZero.wording(),
        env: None, file: true, show: text, default: || Some(0),
    }
    min_machines = MIN_MACHINES: usize {
        label: "elastic restarts", code: "", flag: Some(Flag {
            value_name: "count",
            help: "a restart leaves out machines that no longer answer over ssh and runs on the rest (their ranks only) if at least this many remain; without it a restart needs every machine",
        }),
        example: "2", parse: values::positive, want: Bound::AtLeastOne.wording(),
        env: None, file: true, show: text, default: none,
    }
    collective_timeout = COLLECTIVE_TIMEOUT: Duration {
        label: "collective deadline", code: "`.collective_timeout(..)` / `collective_timeout = s`",
        flag: Some(Flag {
            value_name: "duration",
            help: "deadline of each collective (90, 90s, 10m, 1h, 500ms), as IVME_COLLECTIVE_TIMEOUT seconds",
        }),
        example: "10m", parse: values::duration, want: env::DURATION_FORMS,
        env: Some(Env {
            read: true,
            to_ranks: |&t| Some(env::seconds_text(t)),
        }),
        file: false, show: seconds, default: none,
    }
    debug_sync = DEBUG_SYNC: bool {
        label: "collective order check", code: "`.debug_sync(true)` / `debug_sync = true`",
        flag: Some(Flag {
            value_name: cli::SWITCH,
            help: "check that the ranks call the same collectives in the same order (IVME_DEBUG_SYNC=1)",
        }),
        example: "", parse: values::switch, want: "1 or 0 (also true/false)",
        env: Some(Env { read: true, to_ranks: |on| on.then(|| "1".into()) }),
        file: false, show: text, default: || Some(false),
    }
    overlap = OVERLAP: bool {
        label: "optimizer overlapped with the sync", code: "`.overlap(true)` / `overlap = true`",
        flag: Some(Flag {
            value_name: cli::SWITCH,
            help: "step the optimizer inside backward, each bucket's part while later buckets are averaged (IVME_OVERLAP=1)",
        }),
        example: "", parse: values::switch, want: "1 or 0 (also true/false)",
        env: Some(Env { read: true, to_ranks: |on| on.then(|| "1".into()) }),
        file: false, show: text, default: || Some(false),
    }
    activation_checkpointing = ACTIVATION_CHECKPOINTING: bool {
        label: "activation checkpointing",
        code: "`.activation_checkpointing(true)` / `activation_checkpointing = true`",
        flag: Some(Flag {
            value_name: cli::SWITCH,
            help: "drop each checkpointed block's activations after its forward and run it again in backward (IVME_ACTIVATION_CHECKPOINTING=1)",
        }),
        example: "", parse: values::switch, want: "1 or 0 (also true/false)",
        env: Some(Env { read: true, to_ranks: |on| on.then(|| "1".into()) }),
        file: false, show: text, default: || Some(false),
    }
    preempt_signals = PREEMPT_SIGNALS: String {
        label: "preemption signals", code: "", flag: Some(Flag {
            value_name: "list",
            help: "signals that stop the job for a preemption (default TERM,USR1; none), IVME_PREEMPT_SIGNALS",
        }),
        example: "TERM,USR1", parse: values::signals, want: env::PREEMPT_SIGNALS.values,
        env: Some(Env { read: true, to_ranks: passed }),
        file: false, show: text, default: || Some(ivme::preempt::DEFAULT_SIGNALS.into()),
    }
    preempt_grace = PREEMPT_GRACE: Duration {
        label: "preemption grace period", code: "", flag: Some(Flag {
            value_name: "duration",
            help: "how long a preempted rank may take to stop and save (default 25s), IVME_PREEMPT_GRACE",
        }),
        example: "60s", parse: values::duration, want: env::DURATION_FORMS,
        env: Some(Env {
            read: true,
            to_ranks: |&t| Some(env::seconds_text(t)),
        }),
        file: false, show: seconds, default: || Some(ivme::preempt::DEFAULT_GRACE),
    }
    requeue_exit_code = REQUEUE_EXIT_CODE: u8 {
        label: "exit code after a preemption", code: "", flag: Some(Flag {
            value_name: "code",
            help: "the launcher's exit code after a preemption, for a scheduler to requeue on (default 75)",
        }),
        example: "75", parse: values::exit_code, want: env::REQUEUE_EXIT_CODE.values,
        env: Some(Env { read: true, to_ranks: not_passed }),
        file: false, show: text,
        default: || Some(ivme::preempt::DEFAULT_REQUEUE_EXIT_CODE as u8),
    }
    snapshot_every = SNAPSHOT_EVERY: u64 {
        label: "in-memory snapshots", code: "`.snapshot_every(k)` / `snapshot_every = k`",
        flag: Some(Flag {
            value_name: "steps",
            help: "keep the training state in memory every N optimizer steps, for restarts (0: off), IVME_SNAPSHOT_EVERY",
        }),
        example: "100", parse: values::steps, want: env::SNAPSHOT_EVERY.values,
        env: Some(Env { read: true, to_ranks: passed }),
        file: true, show: text, default: || Some(0),
    }
    profile = PROFILE: PathBuf {
        label: table::PROFILE.name, code: "`.profile(dir)` / `profile = \"dir\"`",
        flag: Some(Flag {
            value_name: "dir",
            help: "record each rank's phases per step into DIR (Chrome traces, a summary at the end; `ivme profile DIR` draws it), IVME_PROFILE",
        }),
        example: "runs/profile", parse: values::path, want: env::PROFILE.values,
        env: Some(Env {
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
            one_of(&Sharding::VALID[..4]),
            "{:?}",
            Sharding::VALID
        );
        assert_eq!(want("backend"), one_of(BACKENDS));
    }

    #[test]
    fn each_rows_field_is_its_launch_name_and_its_variable_the_tables() {
        for (field, setting) in FIELDS {
            assert_eq!(Some(*field), setting.launch);
            let row = row(field).unwrap();
            assert_eq!(row.var(), setting.var.map(|v| v.name), "{field}");
        }
        assert_eq!(FIELDS.len(), ROWS.len());
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
