//! The [`Accelerator`]: a thin facade over process state, communication, gradients,
//! precision and data, with one code path for one process and for many.

use crate::comm::{Communicator, Counted};
use crate::error::{Error, Result};
use crate::optim::{AcceleratedOptimizer, StatefulOptimizer};
use crate::precision::autocast::{Autocast, AutocastOutput};
use crate::precision::scaler::LossScaler;
use crate::rng::{mix, Rng};
use crate::setup::config::Precision;
use crate::setup::state::ProcessState;
use crate::stateful::Shared;
use crate::train::window::GradientState;
use candle_core::{DType, Device, Var};
use prepare::Prepare;

pub use builder::AcceleratorBuilder;
use candle_nn::VarMap;
use std::fmt::Display;
use std::sync::Arc;

mod activations;
mod background;
mod backward;
mod buffers;
mod builder;
mod checkpoints;
mod finetune;
mod metrics;
mod model_files;
mod models;
mod newest;
mod preempt;
pub mod prepare;
mod profile;
mod reshard;
mod restore;
#[cfg(test)]
mod slow_data;
mod snapshots;
mod step_times;
mod tools;
mod zero3;

/// The entry point: knows the distributed setup and drives gradients, precision and data.
///
/// ```no_run
/// # fn main() -> ivme::Result<()> {
/// let mut accelerator = ivme::Accelerator::builder().grad_accum(2).build()?;
/// accelerator.print(format!("training on {} processes", accelerator.num_processes()));
/// # Ok(()) }
/// ```
pub struct Accelerator {
    /// Who this process is, and on which device.
    state: ProcessState,
    /// The communicator for that device (the identity in a world of one), counted.
    comm: std::rc::Rc<Counted>,
    /// How windows end: the sync strategy, bucket size and clipping (sync.rs).
    sync: crate::train::sync::SyncSettings,
    /// Mixed precision: policy, loss scaler, NaN-loss guard, exact initial values.
    mixed: crate::precision::MixedPrecision,
    /// The prepared models and optimizers and the accumulation window (training.rs).
    training: crate::train::training::Training,
    /// The generator, the loaders' positions and the attribute's loop cursor.
    data: crate::data::DataProgress,
    /// The project folder, locks, background saves and registered objects.
    checkpoints: crate::checkpoint::Checkpointing,
    /// Experiment trackers, once `init_trackers` ran.
    trackers: Shared<Option<crate::observe::tracking::Trackers>>,
    /// A fine-tune's base, patterns and the `VarMap`s builders made variables in.
    finetune: crate::finetune::FineTuning,
    /// Whether the ranks agreed to stop for a preemption (setup/preempt.rs).
    preempt: crate::setup::preempt::Preemption,
    /// Print the step-time report every this many optimizer steps (`IVME_STEP_TIMES`).
    step_times_every: Option<u64>,
    /// The run's profile, when profiling (profile.rs).
    profiling: Option<profile::Profiling>,
    /// Activation checkpointing, when on: the thread's segments are recorded and recomputed.
    segments: Option<crate::activations::Segments>,
    /// ZeRO-3's units, once a model is prepared under it (zero3.rs).
    zero3: Option<zero3::Zero3>,
}

impl std::fmt::Debug for Accelerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accelerator")
            .field("state", &self.state)
            .field("comm", &self.comm)
            .field(ivme_settings::PRECISION.name, &self.mixed.policy())
            .field(
                ivme_settings::GRAD_ACCUM.name,
                &self.training.window().accum(),
            )
            .field("models", &self.training.models().len())
            .field("optimizers", &self.training.optimizers().len())
            .finish()
    }
}

impl Accelerator {
    /// An Accelerator with settings from the launcher's environment and the defaults.
    pub fn new() -> Result<Self> {
        Self::builder().build()
    }

    /// Starts configuring an Accelerator.
    pub fn builder() -> AcceleratorBuilder {
        AcceleratorBuilder::default()
    }

    /// The device this process computes on.
    pub fn device(&self) -> &Device {
        &self.state.device
    }
    /// This process's global rank.
    pub fn process_index(&self) -> usize {
        self.state.rank
    }
    /// This process's rank on its machine.
    pub fn local_process_index(&self) -> usize {
        self.state.local_rank
    }
    /// The number of processes in the run.
    pub fn num_processes(&self) -> usize {
        self.state.world_size
    }
    /// Whether this is the main process (global rank 0).
    pub fn is_main_process(&self) -> bool {
        self.state.is_main_process()
    }
    /// Whether this is the main process of its machine.
    pub fn is_local_main_process(&self) -> bool {
        self.state.is_local_main_process()
    }
    /// The full process state.
    pub fn state(&self) -> &ProcessState {
        &self.state
    }
    /// The configured precision.
    pub fn precision(&self) -> Precision {
        self.mixed.policy()
    }
    /// The seed given to the builder (0 by default).
    pub fn seed(&self) -> u64 {
        self.data.seed()
    }
    /// Micro-batches per optimizer step.
    pub fn gradient_accumulation_steps(&self) -> usize {
        self.training.window().accum()
    }
    /// Whether the next backward ends an accumulation window (a real optimizer step).
    pub fn sync_gradients(&self) -> bool {
        self.training.window().peek().sync
    }
    /// The communicator, for collectives of your own.
    pub fn comm(&self) -> &dyn Communicator {
        &*self.comm
    }
    /// How many collectives this process has run so far.
    pub fn collective_count(&self) -> u64 {
        self.comm.count()
    }
    /// How many bytes this process has handed to collectives so far (gradients, broadcasts,
    /// agreements): the difference over a step is what the step communicated.
    pub fn collective_bytes(&self) -> u64 {
        self.comm.bytes()
    }
    /// The current fp16 loss scaler, if any.
    pub fn scaler(&self) -> Option<&LossScaler> {
        self.mixed.scaler()
    }

    /// Blocks until every process reaches this point.
    pub fn wait_for_everyone(&self) -> Result<()> {
        self.comm.barrier()
    }

    /// Prints a line on the main process only.
    pub fn print(&self, msg: impl Display) {
        if self.is_main_process() {
            println!("{msg}");
        }
    }

    /// The dtype a model's variables should be created in: the compute dtype for a request
    /// of f32 under mixed precision, the request otherwise.
    pub fn param_dtype(&self, requested: DType) -> DType {
        if requested == DType::F32 {
            self.mixed.policy().compute_dtype()
        } else {
            requested
        }
    }

    /// Prepares objects for training and returns them in the order given; see [`Prepare`].
    pub fn prepare<P: Prepare>(&mut self, objects: P) -> Result<P::Output> {
        let rank = self.process_index();
        objects
            .prepare_with(self)
            .map_err(|e| crate::setup::status::note_final(rank, e))
    }

    /// Prepares `varmap` (if not yet) and wraps the optimizer built over its variables.
    pub fn prepare_optimizer<O, E>(
        &mut self,
        varmap: &VarMap,
        optimizer: std::result::Result<O, E>,
    ) -> Result<AcceleratedOptimizer<O>>
    where
        O: StatefulOptimizer,
        E: Into<Error>,
    {
        let optimizer = optimizer.map_err(Into::into)?;
        let rank = self.process_index();
        let note = |e| crate::setup::status::note_final(rank, e);
        if self.find_model(varmap).is_none() {
            let held: Vec<_> = optimizer
                .vars()
                .iter()
                .map(|v| v.as_tensor().id())
                .collect();
            self.register_model_holding(varmap, Some(&held))
                .map_err(note)?;
        }
        self.wrap_optimizer(optimizer).map_err(note)
    }

    /// Reseeds ivme's generator (the one [`rng`](Self::rng) returns) from `seed`: the same
    /// stream on every rank, or with `rank_specific` a different one per rank (what dropout on
    /// different data wants). Variables [`var_builder`](Self::var_builder) makes afterwards
    /// are drawn from `seed` too, identical on every rank either way (the initialisation is
    /// keyed by seed and name). Loaders shuffle from their own `seed`, identical on every rank.
    pub fn set_seed(&self, seed: u64, rank_specific: bool) {
        let stream = if rank_specific {
            self.state.rank as u64
        } else {
            u64::MAX
        };
        self.data.reseed(seed, Rng::new(mix(seed, stream)));
    }

    /// This process's seeded generator for anything random that must resume exactly
    /// (dropout masks, augmentation); saved and restored with the training state.
    pub fn rng(&self) -> Shared<Rng> {
        self.data.rng().clone()
    }

    /// The gradient state shared with prepared data loaders.
    pub(crate) fn gradient_state(&self) -> Arc<GradientState> {
        self.training.window().clone()
    }

    /// The position of the attribute's loops over plain collections.
    pub(crate) fn loop_cursor(&self) -> Shared<crate::data::LoopCursor> {
        self.data.loop_cursor().clone()
    }

    /// Runs `f` in an autocast scope: inputs passed through the handle's
    /// [`input`](Autocast::input) are cast to the compute dtype, results come back in f32.
    pub fn autocast<T: AutocastOutput>(
        &self,
        f: impl FnOnce(&Autocast) -> candle_core::Result<T>,
    ) -> candle_core::Result<T> {
        self.autocast_scope().run(f)
    }

    /// A handle for autocast scopes that holds no borrow of the Accelerator, so a closure
    /// can use it while the Accelerator is borrowed mutably elsewhere (the macro binds one).
    pub fn autocast_scope(&self) -> Autocast {
        let dtype = self.mixed.autocast_dtype();
        Autocast::new(dtype)
    }

    /// How much of the training state each process holds (the ZeRO stage).
    pub fn sharding(&self) -> crate::Sharding {
        self.sync.sharding()
    }

    /// The prepared models' variables by name: (name, f32 master) pairs, sorted by name.
    /// Under ZeRO-3 a block's variables hold no elements outside its segment: read the
    /// weights with [`whole_masters`](Self::whole_masters) there.
    pub fn named_master_vars(&self) -> Vec<(String, Var)> {
        self.training.named_master_vars()
    }
}
