//! The rows of the table: one per setting, each with every name it goes by. A new setting is
//! one row here (and, where it is one, a builder method, an attribute parser and a command row
//! that name it by its [`Id`] or constant).

use crate::vars::{self, Var};
use crate::{Bound, Setting};

/// Fields most rows leave as they are.
const ROW: Setting = Setting {
    id: Id::GradAccum,
    name: "",
    ty: "",
    default: "",
    bound: Bound::Any,
    builder: None,
    attribute: None,
    aliases: &[],
    example: "",
    launch: None,
    var: None,
    doc: "",
};

/// Declares [`Id`], one constant per row and [`SETTINGS`], in one order. (A row that sets every
/// field leaves nothing to [`ROW`].)
macro_rules! table {
    ($(
        #[doc = $doc:literal]
        $id:ident $konst:ident { $($field:ident: $value:expr),* $(,)? }
    )*) => {
        /// Which setting a row is: its place in [`SETTINGS`].
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Id {
            $(#[doc = $doc] $id,)*
        }

        $(
            #[doc = $doc]
            #[allow(clippy::needless_update)]
            pub const $konst: Setting = Setting { id: Id::$id, doc: $doc, $($field: $value,)* ..ROW };
        )*

        /// Every setting: the attribute's keys first, in the order its errors list them.
        pub const SETTINGS: &[Setting] = &[$($konst),*];
    };
}

impl Id {
    /// The setting's row.
    pub const fn setting(self) -> &'static Setting {
        &SETTINGS[self as usize]
    }
}

/// A variable, for a row.
const fn var(v: Var) -> Option<Var> {
    Some(v)
}

table! {
    /// Micro-batches per optimizer step.
    GradAccum GRAD_ACCUM {
        name: "grad_accum", ty: "usize", default: "1", bound: Bound::AtLeastOne,
        builder: Some("grad_accum"), attribute: Some("grad_accum"),
        aliases: &["gradient_accumulation_steps"], example: "2",
        launch: Some("gradient_accumulation_steps"), var: var(vars::GRAD_ACCUM),
    }
    /// Compute precision: no, fp16 or bf16.
    Precision PRECISION {
        name: "precision", ty: "Precision", default: "no",
        builder: Some("precision"), attribute: Some("precision"),
        aliases: &["mixed_precision"], example: "\"bf16\"",
        launch: Some("mixed_precision"), var: var(vars::PRECISION),
    }
    /// Clip the synced gradients to this global L2 norm before every real step.
    ClipGradNorm CLIP_GRAD_NORM {
        name: "clip_grad_norm", ty: "f64", bound: Bound::PositiveFinite,
        builder: Some("clip_grad_norm"), attribute: Some("clip_grad_norm"),
        aliases: &["max_grad_norm"], example: "1.0",
    }
    /// Clamp the synced gradients to `[-v, v]` before every real step.
    ClipGradValue CLIP_GRAD_VALUE {
        name: "clip_grad_value", ty: "f64", bound: Bound::PositiveFinite,
        builder: Some("clip_grad_value"), attribute: Some("clip_grad_value"), example: "0.5",
    }
    /// Compute on the CPU even where a GPU is present.
    Cpu CPU {
        name: "cpu", ty: "bool", default: "false", builder: Some("cpu"), attribute: Some("cpu"),
        example: "true", launch: Some("cpu"), var: var(vars::CPU),
    }
    /// The seed of ivme's generators and of the initial weights.
    Seed SEED {
        name: "seed", ty: "u64", default: "0", builder: Some("seed"), attribute: Some("seed"),
        example: "42",
    }
    /// The folder automatically named checkpoints go under.
    ProjectDir PROJECT_DIR {
        name: "project_dir", ty: "PathBuf", builder: Some("project_dir"),
        attribute: Some("project_dir"), example: "\"runs/demo\"",
    }
    /// Keep only the newest this many automatically named checkpoints.
    TotalLimit TOTAL_LIMIT {
        name: "total_limit", ty: "usize", bound: Bound::AtLeastOne, builder: Some("total_limit"),
        attribute: Some("total_limit"), example: "3",
    }
    /// The deadline of every collective.
    CollectiveTimeout COLLECTIVE_TIMEOUT {
        name: "collective_timeout", ty: "Duration", default: "600", bound: Bound::PositiveFinite,
        builder: Some("collective_timeout"), attribute: Some("collective_timeout"),
        example: "600", launch: Some("collective_timeout"), var: var(vars::COLLECTIVE_TIMEOUT),
    }
    /// Whether the ranks check that they call the same collectives in the same order.
    DebugSync DEBUG_SYNC {
        name: "debug_sync", ty: "bool", default: "false", builder: Some("debug_sync"),
        attribute: Some("debug_sync"), example: "true", launch: Some("debug_sync"),
        var: var(vars::DEBUG_SYNC),
    }
    /// Whether checkpoints are written in the background.
    AsyncCheckpoints ASYNC_CHECKPOINTS {
        name: "async_checkpoints", ty: "bool", default: "false",
        builder: Some("async_checkpoints"), attribute: Some("async_checkpoints"),
        example: "true",
    }
    /// Keep a snapshot of the training state in memory every this many optimizer steps.
    SnapshotEvery SNAPSHOT_EVERY {
        name: "snapshot_every", ty: "u64", default: "0", bound: Bound::AtLeastZero,
        builder: Some("snapshot_every"), attribute: Some("snapshot_every"), example: "10",
        launch: Some("snapshot_every"), var: var(vars::SNAPSHOT_EVERY),
    }
    /// ZeRO sharding: no, optimizer (1), gradients (2) or parameters (3); docs/sharding.md.
    Sharding SHARDING {
        name: "sharding", ty: "Sharding", default: "no", builder: Some("sharding"),
        attribute: Some("zero"), aliases: &["zero_stage", "sharding"], example: "2",
        launch: Some("sharding"), var: var(vars::SHARDING),
    }
    /// Buffers (BatchNorm statistics): broadcast, average or local; docs/buffers.md.
    Buffers BUFFERS {
        name: "buffers", ty: "BufferSync", default: "broadcast", builder: Some("buffers"),
        attribute: Some("buffers"), aliases: &["broadcast_buffers"], example: "\"average\"",
        launch: Some("buffers"), var: var(vars::BUFFERS),
    }
    /// Profile the run into this folder: each rank's phases per step, traces and a summary.
    Profile PROFILE {
        name: "profile", ty: "PathBuf", builder: Some("profile"), attribute: Some("profile"),
        aliases: &["profile_dir"], example: "\"runs/profile\"", launch: Some("profile"),
        var: var(vars::PROFILE),
    }
    /// The model's FLOPs per sample, forward and backward, for a profile's FLOP rate.
    FlopsPerSample FLOPS_PER_SAMPLE {
        name: "flops_per_sample", ty: "f64", bound: Bound::PositiveFinite,
        builder: Some("flops_per_sample"), attribute: Some("flops_per_sample"), example: "6e9",
        var: var(vars::FLOPS_PER_SAMPLE),
    }
    /// Whether the optimizer steps during the gradient sync, bucket by bucket.
    Overlap OVERLAP {
        name: "overlap", ty: "bool", default: "false", builder: Some("overlap"),
        attribute: Some("overlap"), example: "true", launch: Some("overlap"),
        var: var(vars::OVERLAP),
    }
    /// Whether checkpointed segments drop their activations and run again in `backward`.
    ActivationCheckpointing ACTIVATION_CHECKPOINTING {
        name: "activation_checkpointing", ty: "bool", default: "false",
        builder: Some("activation_checkpointing"), attribute: Some("activation_checkpointing"),
        example: "true", launch: Some("activation_checkpointing"),
        var: var(vars::ACTIVATION_CHECKPOINTING),
    }
    /// The size of the buffers gradients are flattened into for averaging, in MiB.
    BucketSizeMb BUCKET_SIZE_MB {
        name: "bucket_size_mb", ty: "usize", default: "25", bound: Bound::AtLeastOne,
        builder: Some("bucket_size_mb"),
    }
    /// The fp16 loss scale to start from; it adapts while training.
    InitialLossScale INITIAL_LOSS_SCALE {
        name: "initial_loss_scale", ty: "f64", default: "65536", bound: Bound::PositiveFinite,
        builder: Some("initial_loss_scale"),
    }
    /// Whether building the Accelerator tunes glibc's allocator for candle.
    MallocTuning MALLOC_TUNING {
        name: "malloc_tuning", ty: "bool", default: "true", builder: Some("malloc_tuning"),
        var: var(vars::MALLOC_TUNING),
    }
    /// Each process's peak FLOP/s, for a profile's model FLOP utilisation.
    PeakFlops PEAK_FLOPS {
        name: "peak_flops", ty: "f64", bound: Bound::PositiveFinite, builder: Some("peak_flops"),
        var: var(vars::PEAK_FLOPS),
    }
    /// Processes in total, over all machines.
    NumProcesses NUM_PROCESSES {
        name: "num_processes", ty: "usize", default: "1", bound: Bound::AtLeastOne,
        launch: Some("num_processes"),
    }
    /// How the processes talk: mpi.
    Backend BACKEND {
        name: "backend", ty: "String", default: "mpi", launch: Some("backend"),
    }
    /// Machines in the run.
    NumMachines NUM_MACHINES {
        name: "num_machines", ty: "usize", default: "1", bound: Bound::AtLeastOne,
        launch: Some("num_machines"), var: var(vars::NUM_MACHINES),
    }
    /// This machine's rank; only rank 0 runs `ivme launch`, which starts every machine's ranks.
    MachineRank MACHINE_RANK {
        name: "machine_rank", ty: "usize", default: "0", bound: Bound::AtLeastZero,
        launch: Some("machine_rank"),
    }
    /// The main machine's (rank 0's) address.
    MainProcessIp MAIN_PROCESS_IP {
        name: "main_process_ip", ty: "String", launch: Some("main_process_ip"),
        var: var(vars::MAIN_PROCESS_IP),
    }
    /// The rendezvous port on the main machine.
    MainProcessPort MAIN_PROCESS_PORT {
        name: "main_process_port", ty: "u16", launch: Some("main_process_port"),
        var: var(vars::MAIN_PROCESS_PORT),
    }
    /// MPI hostfile listing the machines (`host slots=N` per line).
    Hostfile HOSTFILE {
        name: "hostfile", ty: "PathBuf", launch: Some("hostfile"),
    }
    /// Every machine's address, the main one first.
    Hosts HOSTS {
        name: "hosts", ty: "Vec<String>", launch: Some("hosts"),
    }
    /// Start a failed job again up to this many times (from its newest checkpoint).
    MaxRestarts MAX_RESTARTS {
        name: "max_restarts", ty: "usize", default: "0", bound: Bound::AtLeastZero,
        launch: Some("max_restarts"),
    }
    /// After a lost machine, restart on the machines that still answer, if at least this many.
    MinMachines MIN_MACHINES {
        name: "min_machines", ty: "usize", bound: Bound::AtLeastOne, launch: Some("min_machines"),
    }
    /// The signals taken as a preemption.
    PreemptSignals PREEMPT_SIGNALS {
        name: "preempt_signals", ty: "String", default: "TERM,USR1",
        launch: Some("preempt_signals"), var: var(vars::PREEMPT_SIGNALS),
    }
    /// How long a preempted rank may take to stop and save.
    PreemptGrace PREEMPT_GRACE {
        name: "preempt_grace", ty: "Duration", default: "25", bound: Bound::PositiveFinite,
        launch: Some("preempt_grace"), var: var(vars::PREEMPT_GRACE),
    }
    /// The launcher's exit code after a preemption, for a scheduler to requeue on.
    RequeueExitCode REQUEUE_EXIT_CODE {
        name: "requeue_exit_code", ty: "u8", default: "75", bound: Bound::AtLeastOne,
        launch: Some("requeue_exit_code"), var: var(vars::REQUEUE_EXIT_CODE),
    }
}
