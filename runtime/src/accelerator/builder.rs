//! [`AcceleratorBuilder`]: the settings an Accelerator is built from, resolved against the
//! launcher's environment, and the checks that refuse what this build or device cannot do.

use crate::accelerator::Accelerator;
use crate::comm::{self, CommOptions, Counted};
use crate::error::{Error, Result};
use crate::setup::config::{check_bound, resolve, resolve_with, Precision};
use crate::setup::env;
use crate::setup::state::{select_device, EnvLayout, ProcessState};
use crate::stateful::Shared;
use candle_core::{DType, Device, Tensor};
use ivme_settings::{self as table, Setting};
use std::time::Duration;

#[path = "comm_options.rs"]
mod comm_options;

/// Settings for an [`Accelerator`]; anything left unset comes from the launcher's
/// environment (`IVME_*`), then from the defaults.
#[derive(Debug, Clone, Default)]
pub struct AcceleratorBuilder {
    grad_accum: Option<usize>,
    precision: Option<Precision>,
    sharding: Option<crate::setup::config::Sharding>,
    buffers: Option<crate::setup::config::BufferSync>,
    cpu: Option<bool>,
    clip_grad_norm: Option<f64>,
    clip_grad_value: Option<f64>,
    seed: Option<u64>,
    bucket_mb: Option<usize>,
    overlap: Option<bool>,
    activation_checkpointing: Option<bool>,
    initial_loss_scale: Option<f64>,
    project_dir: Option<std::path::PathBuf>,
    total_limit: Option<usize>,
    collective_timeout: Option<Duration>,
    debug_sync: Option<bool>,
    async_checkpoints: bool,
    malloc_tuning: Option<bool>,
    snapshot_every: Option<u64>,
    profile: Option<std::path::PathBuf>,
    flops_per_sample: Option<f64>,
    peak_flops: Option<f64>,
}

impl AcceleratorBuilder {
    /// Saves checkpoints without a path to `dir/checkpoints/checkpoint_{n}` (automatic
    /// naming); see [`ProjectConfiguration`](crate::checkpoint::ProjectConfiguration).
    pub fn project_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.project_dir = Some(dir.into());
        self
    }

    /// How long one collective may wait for the other processes (10 minutes by default, or
    /// `IVME_COLLECTIVE_TIMEOUT` seconds): past it the job fails with an error naming the
    /// collective and the ranks that had not arrived, instead of hanging.
    pub fn collective_timeout(mut self, timeout: Duration) -> Self {
        self.collective_timeout = Some(timeout);
        self
    }

    /// Compares every collective across all processes before running it and, when they are
    /// not at the same call, fails listing what *each* process was doing (the check that is
    /// always on names the first pair that disagrees); also `IVME_DEBUG_SYNC=1`. One small
    /// extra collective per collective: for debugging.
    pub fn debug_sync(mut self, on: bool) -> Self {
        self.debug_sync = Some(on);
        self
    }

    /// Whether building the Accelerator tunes glibc's allocator for candle (on by default;
    /// `IVME_MALLOC_TUNING=0` turns it off too): blocks up to 32 MiB come from the heap and
    /// freed memory stays for the next step, as `ivme launch` sets for its ranks, so a program
    /// is as fast under `cargo run`, `mpirun` or `srun`. A glibc variable
    /// (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`) already set wins; a global allocator
    /// of the program's own is unaffected. See docs/performance.md.
    pub fn malloc_tuning(mut self, on: bool) -> Self {
        self.malloc_tuning = Some(on);
        self
    }

    /// Keeps a snapshot of the training state in memory every `steps` optimizer steps (0 turns
    /// it off, the default; also `IVME_SNAPSHOT_EVERY`), taken at the loop's
    /// [`preemption_point`](Accelerator::preemption_point) and written in the background to a
    /// folder in `/dev/shm` that `ivme launch` keeps across its restarts. After a crash,
    /// `--max_restarts` and [`load_state_if_any`](Accelerator::load_state_if_any) resume from
    /// the newest snapshot when it is newer than the newest checkpoint on disk, so a failure
    /// costs at most `steps` steps. Needs `ivme launch` and every process on one machine;
    /// otherwise it does nothing. See docs/faults.md.
    pub fn snapshot_every(mut self, steps: u64) -> Self {
        self.snapshot_every = Some(steps);
        self
    }

    /// Profiles the run into `dir` (also `IVME_PROFILE`, `ivme launch --profile`): every
    /// process records its phases per optimizer step and writes a Chrome trace and a record
    /// there; [`end_training`](Accelerator::end_training) prints a summary (phase shares, the
    /// rank the others wait for, steps/s, samples/s) and logs it to the trackers; `ivme profile
    /// dir` draws it. Costs well under 1 % of a step; see [`profile`](crate::profile).
    pub fn profile(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.profile = Some(dir.into());
        self
    }

    /// The model's FLOPs per sample, forward and backward (also `IVME_FLOPS_PER_SAMPLE`), so
    /// that a profile's summary gives the model FLOP/s.
    pub fn flops_per_sample(mut self, flops: f64) -> Self {
        self.flops_per_sample = Some(flops);
        self
    }

    /// Each process's peak FLOP/s (also `IVME_PEAK_FLOPS`), so that a profile's summary gives
    /// the model FLOP utilisation along with [`flops_per_sample`](Self::flops_per_sample).
    pub fn peak_flops(mut self, flops: f64) -> Self {
        self.peak_flops = Some(flops);
        self
    }

    /// Makes [`save_state`](Accelerator::save_state) asynchronous: it copies the state into
    /// host memory and returns, a background thread writes the files, and the checkpoint is
    /// committed at the next save, `wait_for_checkpoint`, `load_state` or the end of training
    /// (see [`save_state_async`](Accelerator::save_state_async)). Off by default.
    pub fn async_checkpoints(mut self, on: bool) -> Self {
        self.async_checkpoints = on;
        self
    }

    /// Keeps only the newest `n` automatically named checkpoints.
    pub fn total_limit(mut self, n: usize) -> Self {
        self.total_limit = Some(n);
        self
    }

    /// The fp16 loss scale to start from (65536 by default); it adapts while training.
    pub fn initial_loss_scale(mut self, scale: f64) -> Self {
        self.initial_loss_scale = Some(scale);
        self
    }
    /// Accumulates gradients over `n` micro-batches per optimizer step (`n >= 1`).
    pub fn grad_accum(mut self, n: usize) -> Self {
        self.grad_accum = Some(n);
        self
    }
    /// Sets the compute precision.
    pub fn precision(mut self, p: Precision) -> Self {
        self.precision = Some(p);
        self
    }
    /// Forces the CPU even when a GPU is present.
    pub fn cpu(mut self, cpu: bool) -> Self {
        self.cpu = Some(cpu);
        self
    }
    /// Clips the synced gradients to this global L2 norm before every real step.
    pub fn clip_grad_norm(mut self, max_norm: f64) -> Self {
        self.clip_grad_norm = Some(max_norm);
        self
    }
    /// Clamps the synced gradients to `[-v, v]` before every real step.
    pub fn clip_grad_value(mut self, v: f64) -> Self {
        self.clip_grad_value = Some(v);
        self
    }
    /// How much of the training state each process holds: [`Sharding::Optimizer`] (stage 1)
    /// or [`Sharding::Gradients`] (stage 2) split the f32 masters and optimizer state (and the
    /// synced gradients) across processes; see docs/sharding.md.
    ///
    /// [`Sharding::Optimizer`]: crate::Sharding::Optimizer
    /// [`Sharding::Gradients`]: crate::Sharding::Gradients
    pub fn sharding(mut self, s: crate::setup::config::Sharding) -> Self {
        self.sharding = Some(s);
        self
    }
    /// How the prepared models' buffers (BatchNorm's running statistics, a counter, an EMA:
    /// variables the forward writes and no gradient reaches) agree across processes at the end
    /// of each accumulation window: [`BufferSync::Broadcast`] (the default: rank 0's),
    /// [`BufferSync::Average`] (the mean of every rank's) or [`BufferSync::Local`] (each
    /// keeps its own); see docs/buffers.md.
    ///
    /// [`BufferSync::Broadcast`]: crate::BufferSync::Broadcast
    /// [`BufferSync::Average`]: crate::BufferSync::Average
    /// [`BufferSync::Local`]: crate::BufferSync::Local
    pub fn buffers(mut self, b: crate::setup::config::BufferSync) -> Self {
        self.buffers = Some(b);
        self
    }
    /// The seed for ivme's generators: [`Accelerator::rng`] and the initial weights
    /// [`Accelerator::var_builder`] draws (0 unless set).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }
    /// The size of the buffers gradients are flattened into for averaging, in MiB (ZeRO stage
    /// 2 stages its reduce-scatter and all-gather through buffers of a quarter of it).
    pub fn bucket_size_mb(mut self, mb: usize) -> Self {
        self.bucket_mb = Some(mb);
        self
    }

    /// Steps the optimizer inside `backward`, each bucket's part of the gradient as soon as its
    /// mean is in, while later buckets are still being averaged (also `ivme launch --overlap`,
    /// `IVME_OVERLAP=1`). The numbers are the same bit for bit. It pays only where each process
    /// has a core to spare for the sync thread and the transfers wait on a network; with one
    /// core a process it slows the step (docs/performance.md has the measurements), and the
    /// build warns. The prepared optimizer's `step` then only records the outcome, so set the
    /// learning rate before `backward`, and clip through the builder, not the returned
    /// gradients.
    pub fn overlap(mut self, on: bool) -> Self {
        self.overlap = Some(on);
        self
    }

    /// Drops the activations of each checkpointed segment once it has run and runs it again
    /// during `backward` (also `activation_checkpointing = true`,
    /// `IVME_ACTIVATION_CHECKPOINTING=1`): the forward keeps only the segments' inputs, for one
    /// more forward of each segment. Mark segments with
    /// [`activations::checkpoint`](crate::activations::checkpoint); ivme's models
    /// ([`crate::models`]) mark their blocks. On for the thread that builds the Accelerator.
    pub fn activation_checkpointing(mut self, on: bool) -> Self {
        self.activation_checkpointing = Some(on);
        self
    }

    /// Resolves the settings, joins the distributed run and builds the Accelerator.
    pub fn build(self) -> Result<Accelerator> {
        // Before any thread of ivme's starts: it changes the environment.
        crate::setup::threads::tune();
        let mut warnings = Vec::new();
        let step = self.resolve_step(&mut warnings)?;
        let comm_options = CommOptions {
            threads: step.overlap,
            ..self.comm_options()?
        };
        let profile = super::profile::ProfileSettings::resolve(
            self.profile.clone(),
            self.flops_per_sample,
            self.peak_flops,
        )?;
        let project = self.project()?;
        let preempt = crate::setup::preempt::PreemptSettings::read(|k| std::env::var(k).ok())?;
        let step_times_every = step_times_every()?;
        let snapshot_every = self.resolve_snapshot_every()?;
        let (state, comm) = join(step.cpu, &comm_options)?;
        check_precision(step.precision, &state.device)?;
        let checkpointing =
            super::zero3::checkpointing(step.checkpointing, step.sharding, &state.device)?;
        if step.overlap {
            let overlap = crate::train::sync::overlap_warnings;
            warnings.extend(overlap(state.world_size, state.local_world_size, &*comm));
        }
        if state.is_main_process() {
            for w in &warnings {
                warn_user!("{}", w.strip_prefix("ivme: ").unwrap_or(w));
            }
        }
        let tuning = self.malloc_tuning.unwrap_or_else(|| {
            env::MALLOC_TUNING
                .get()
                .is_none_or(|raw| env::parse_bool(&raw) != Some(false))
        });
        crate::setup::allocator::tune(tuning);
        // After the communicator opened, so that no MPI set-up replaces the handlers.
        crate::setup::preempt::install(&preempt);
        let (seed, _) = resolve(&table::SEED, self.seed)?;
        let snapshots = super::snapshots::snapshots_of(snapshot_every, &state);
        let profiling = profile.map(|p| super::profile::Profiling::start(p, &state));
        let mut comm = Counted::new(comm);
        let training = crate::train::training::Training::new(step.grad_accum);
        if let Some(p) = &profiling {
            comm = comm.recording_into(p.trace().clone());
            training.window().clock().record_into(p.trace().clone());
        }
        let sync = self.sync_settings(&step)?;
        let rank = state.rank;
        Ok(Accelerator {
            state,
            comm: std::rc::Rc::new(comm),
            sync,
            mixed: crate::precision::MixedPrecision::new(step.precision, self.initial_loss_scale),
            training,
            data: crate::data::DataProgress::new(seed, rank),
            checkpoints: crate::checkpoint::Checkpointing::new(project, self.async_checkpoints)
                .with_snapshots(snapshots),
            trackers: Shared::new(None),
            finetune: Default::default(),
            preempt: Default::default(),
            step_times_every,
            profiling,
            segments: checkpointing.then(crate::activations::Segments::start),
            zero3: None,
        })
    }

    /// The settings of the training step, resolved and checked together (collecting the
    /// warnings a setting from the environment overriding code gives).
    fn resolve_step(&self, warnings: &mut Vec<String>) -> Result<StepSettings> {
        let mut take = |w: Option<String>| warnings.extend(w);
        let (grad_accum, w) = resolve(&table::GRAD_ACCUM, self.grad_accum)?;
        take(w);
        let (precision, w) = resolve(&table::PRECISION, self.precision)?;
        take(w);
        let (sharding, w) = resolve(&table::SHARDING, self.sharding)?;
        take(w);
        let (buffers, w) = resolve(&table::BUFFERS, self.buffers)?;
        take(w);
        let (cpu, w) = resolve_with(&table::CPU, self.cpu, switch(&table::CPU))?;
        take(w);
        let (overlap, w) = resolve_with(&table::OVERLAP, self.overlap, switch(&table::OVERLAP))?;
        take(w);
        let row = &table::ACTIVATION_CHECKPOINTING;
        let (checkpointing, w) = resolve_with(row, self.activation_checkpointing, switch(row))?;
        take(w);
        let step = StepSettings {
            grad_accum,
            precision,
            sharding,
            buffers,
            cpu,
            overlap,
            checkpointing,
        };
        self.check_step(&step)?;
        Ok(step)
    }

    /// Refuses step settings that cannot work together, or a value outside its row's bound.
    fn check_step(&self, step: &StepSettings) -> Result<()> {
        let sharded = step.sharding != crate::setup::config::Sharding::No;
        if step.buffers == crate::setup::config::BufferSync::Local && sharded {
            return Err(Error::config(
                table::BUFFERS.name,
                "local, with sharding",
                "use buffers = broadcast or average under sharding: a sharded checkpoint \
                 holds one value of each buffer, and local buffers differ by process",
            ));
        }
        if step.overlap && sharded {
            return Err(Error::config(
                table::OVERLAP.name,
                format!("true, with sharding = {}", step.sharding),
                "leave overlap off under sharding: the sharded step already runs inside \
                 `backward`, over this process's slice",
            ));
        }
        check_bound(&table::GRAD_ACCUM, step.grad_accum as f64, step.grad_accum)?;
        if let (Some(_), Some(_)) = (self.clip_grad_norm, self.clip_grad_value) {
            return Err(Error::config(
                table::CLIP_GRAD_NORM.name,
                format!("set together with {}", table::CLIP_GRAD_VALUE.name),
                "choose one kind of clipping",
            ));
        }
        for (row, v) in [
            (&table::CLIP_GRAD_NORM, self.clip_grad_norm),
            (&table::CLIP_GRAD_VALUE, self.clip_grad_value),
            (&table::INITIAL_LOSS_SCALE, self.initial_loss_scale),
        ] {
            if let Some(v) = v {
                check_bound(row, v, v)?;
            }
        }
        Ok(())
    }

    /// How windows end: the stage, the bucket size (its row's default), clipping, buffers
    /// and overlap.
    fn sync_settings(&self, step: &StepSettings) -> Result<crate::train::sync::SyncSettings> {
        let (bucket_mb, _) = resolve(&table::BUCKET_SIZE_MB, self.bucket_mb)?;
        Ok(crate::train::sync::SyncSettings::new(
            step.sharding,
            bucket_mb.max(1) << 20,
            self.clip_grad_norm,
            self.clip_grad_value,
        )
        .with_buffers(step.buffers)
        .with_overlap(step.overlap))
    }

    /// The project configuration `project_dir` and `total_limit` make, if any.
    fn project(&self) -> Result<Option<crate::checkpoint::ProjectConfiguration>> {
        match (&self.project_dir, self.total_limit) {
            (Some(dir), limit) => {
                let mut p = crate::checkpoint::ProjectConfiguration::new(dir.clone())
                    .automatic_checkpoint_naming(true);
                if let Some(n) = limit {
                    p = p.total_limit(n);
                }
                p.validate()?;
                Ok(Some(p))
            }
            (None, Some(n)) => Err(Error::config(
                table::TOTAL_LIMIT.name,
                n,
                "set project_dir too: the limit applies to a project's checkpoints",
            )),
            (None, None) => Ok(None),
        }
    }

    /// Every how many optimizer steps a snapshot is taken in memory (0: none): the builder's
    /// value, else `IVME_SNAPSHOT_EVERY`.
    fn resolve_snapshot_every(&self) -> Result<u64> {
        match (self.snapshot_every, env::SNAPSHOT_EVERY.get()) {
            (Some(k), _) => Ok(k),
            (None, None) => Ok(0),
            (None, Some(raw)) => raw.parse::<u64>().map_err(|_| {
                Error::config(
                    env::SNAPSHOT_EVERY.name,
                    &raw,
                    "use a whole number of optimizer steps, or 0 to turn snapshots off",
                )
            }),
        }
    }
}

/// The step's settings once resolved.
struct StepSettings {
    grad_accum: usize,
    precision: Precision,
    sharding: crate::setup::config::Sharding,
    buffers: crate::setup::config::BufferSync,
    cpu: bool,
    overlap: bool,
    checkpointing: bool,
}

/// Every how many optimizer steps the step-time report is printed (`IVME_STEP_TIMES`; 0 or
/// unset: never).
fn step_times_every() -> Result<Option<u64>> {
    let Some(raw) = env::STEP_TIMES.get() else {
        return Ok(None);
    };
    match raw.parse::<u64>() {
        Ok(0) => Ok(None),
        Ok(n) => Ok(Some(n)),
        Err(_) => Err(Error::config(
            env::STEP_TIMES.name,
            &raw,
            "use a whole number of optimizer steps, or 0 for no report",
        )),
    }
}

/// Joins the run the launcher's environment describes (one process when there is none): the
/// device first, then the communicator for that device, checked to agree with the
/// environment about this process's rank.
fn join(cpu: bool, options: &CommOptions) -> Result<(ProcessState, Box<dyn comm::Communicator>)> {
    let layout = EnvLayout::from_env()?;
    let (rank, world, local_rank, local_world) = match layout {
        Some(l) => (l.rank, l.world_size, l.local_rank, l.local_world_size),
        None => (0, 1, 0, 1),
    };
    let device = select_device(local_rank, cpu)?;
    let comm = comm::open(world, &device, options)?;
    if comm.world_size() != world || comm.rank() != rank {
        // Under srun, MPI forms its world only through a process manager interface.
        let srun = std::env::var_os(env::SLURM_STEP_NUM_TASKS).is_some();
        return Err(Error::Setup(format!(
            "the environment says rank {rank} of {world} but {} says rank {} of {}; start \
             the program with `ivme launch` or a matching mpirun{}",
            comm.name(),
            comm.rank(),
            comm.world_size(),
            if srun {
                ", or give srun MPI's process manager: `srun --mpi=pmix` (Open MPI) or \
                 `--mpi=pmi2` (MPICH)"
            } else {
                ""
            }
        )));
    }
    let state = ProcessState {
        rank,
        world_size: world,
        local_rank,
        local_world_size: local_world,
        device,
    };
    Ok((state, comm))
}

/// The parser of an on/off setting's variable (`1`, `true`, `0`, ...), which reads its default too.
fn switch(row: &Setting) -> impl Fn(&str) -> std::result::Result<bool, String> {
    let values = row.var.map_or("true or false", |v| v.values);
    move |s| env::parse_bool(s).ok_or_else(|| format!("use {values}"))
}

/// Refuses a precision the device cannot run, rather than silently training in f32.
fn check_precision(p: Precision, device: &Device) -> Result<()> {
    if p == Precision::No {
        return Ok(());
    }
    let dt = p.compute_dtype();
    let probe = || -> candle_core::Result<()> {
        let a = Tensor::ones((2, 2), dt, device)?;
        a.matmul(&a)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()?;
        Ok(())
    };
    probe().map_err(|e| {
        Error::Precision(format!(
            "{p} is not supported on {device:?} by this build ({e}); use precision \"no\" or \
             another device"
        ))
    })
}
