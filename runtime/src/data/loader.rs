//! The data loader: this rank's batches of a dataset, epoch after epoch, resumable mid-epoch.

use std::fmt;
use std::sync::Arc;

use candle_core::Device;

use super::prefetch::FetchAhead;
use super::sampler::{self, PlannedBatch};
use super::{Dataset, LoaderPosition, StepObserver};
use crate::stateful::Shared;
use crate::{Error, Result};

/// Yields this rank's batches of a [`Dataset`], shuffled per epoch when asked, placed on a
/// device.
///
/// Unprepared, a loader is a world of one on its own device (CPU unless [`device`](Self::device)
/// says otherwise). `Accelerator::prepare` shards it across the processes and moves its batches
/// to the accelerator's device: with `W` processes each batch of `B` here is one block of a
/// global batch of `W * B`, so the run sees the same samples per step as one process with batch
/// `W * B`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use ivme::data::{DataLoader, TensorDataset};
///
/// let x = Tensor::arange(0f32, 10., &Device::Cpu)?;
/// let mut loader = DataLoader::new(TensorDataset::new(x)?, 4).shuffle(true).seed(7);
/// assert_eq!(loader.len(), 3); // 4 + 4 + 2
/// for _epoch in 0..2 {
///     for batch in loader.iter() {
///         let batch = batch?; // a new order each epoch
///         assert!(batch.dims()[0] <= 4);
///     }
/// }
/// # Ok::<(), ivme::Error>(())
/// ```
pub struct DataLoader<D: Dataset> {
    dataset: Arc<D>,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    even_batches: bool,
    device: Device,
    rank: usize,
    world: usize,
    prepared: bool,
    observer: Option<Arc<dyn StepObserver>>,
    // Once prepared, the Accelerator's copy of the position: it saves it with the training
    // state and writes a restored one back, which the loader adopts on its next use.
    shared: Option<Shared<LoaderPosition>>,
    epoch: u64,
    consumed: usize,
    // Samples of this epoch's order handled before this plan (by a run on another number of
    // processes); this rank's plan splits the rest.
    skip: usize,
    last_padding: usize,
    /// This rank's plan for `epoch`; cleared whenever anything it depends on changes.
    plan: Option<Vec<PlannedBatch>>,
    /// Counts the plans built, so batches built ahead for an older one are never handed out.
    plan_gen: u64,
    /// Worker threads building the next batches, when [`prefetch`](Self::prefetch) asked.
    ahead: Option<Box<dyn FetchAhead<D::Batch>>>,
    /// Batches built ahead and worker threads, as last set.
    ahead_settings: (usize, usize),
}

impl<D: Dataset> DataLoader<D> {
    /// Creates a loader over `dataset` yielding batches of `batch_size` samples, unshuffled, on
    /// the CPU, keeping a short last batch.
    pub fn new(dataset: D, batch_size: usize) -> Self {
        DataLoader {
            dataset: Arc::new(dataset),
            batch_size,
            shuffle: false,
            seed: 0,
            drop_last: false,
            even_batches: true,
            device: Device::Cpu,
            rank: 0,
            world: 1,
            prepared: false,
            observer: None,
            shared: None,
            epoch: 0,
            consumed: 0,
            skip: 0,
            last_padding: 0,
            plan: None,
            plan_gen: 0,
            ahead: None,
            ahead_settings: (0, 1),
        }
    }

    /// Shuffles the samples with a new order every epoch (the same order on every rank).
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self.plan = None;
        self
    }

    /// Sets the shuffle seed (default 0); with the epoch it fixes the order.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self.plan = None;
        self
    }

    /// Drops the last, incomplete global batch instead of yielding short batches.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self.plan = None;
        self
    }

    /// Pads the last global batch with samples from the start of the epoch so every rank gets
    /// the same number of batches (default on). Turned off, ranks past the data's end get one
    /// batch fewer, which deadlocks any collective they would have joined: use it only for
    /// loops without gradient sync, and drop padding from metrics with
    /// [`last_batch_padding`](Self::last_batch_padding) otherwise.
    pub fn even_batches(mut self, even_batches: bool) -> Self {
        self.even_batches = even_batches;
        self.plan = None;
        self
    }

    /// Places batches on `device` (default CPU; `prepare` sets the accelerator's device).
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Takes only rank `rank`'s share of a `world`-way split, as `prepare` would, without
    /// marking the loader prepared.
    ///
    /// For code that runs the processes itself, and for tests that look at every rank's share
    /// from one process. `prepare` replaces this split with the accelerator's.
    pub fn shard(mut self, rank: usize, world: usize) -> Result<Self> {
        if self.prepared {
            return Err(Error::Prepare(
                "this DataLoader is prepared, so its split comes from the Accelerator; call \
                 `shard` before `prepare`, or not at all"
                    .into(),
            ));
        }
        check_split(rank, world)?;
        self.rank = rank;
        self.world = world;
        self.plan = None;
        Ok(self)
    }

    /// Hands the loader to an accelerator: its rank, world size, device and the observer told
    /// about every batch. A loader is prepared once.
    pub(crate) fn attach(
        &mut self,
        rank: usize,
        world: usize,
        device: Device,
        observer: Option<Arc<dyn StepObserver>>,
    ) -> Result<Shared<LoaderPosition>> {
        if self.prepared {
            return Err(Error::Prepare(
                "this DataLoader was already prepared; prepare each loader once".into(),
            ));
        }
        check_split(rank, world)?;
        self.rank = rank;
        self.world = world;
        self.device = device;
        self.observer = observer;
        self.prepared = true;
        self.plan = None;
        let shared = Shared::new(self.own_position());
        self.shared = Some(shared.clone());
        Ok(shared)
    }

    /// Takes over a position the Accelerator restored since the loader last moved.
    fn adopt(&mut self) {
        let Some(shared) = &self.shared else { return };
        let p = *shared.lock();
        if p != self.own_position() {
            if (p.epoch, p.seed, p.skip) != (self.epoch, self.seed, self.skip) {
                self.plan = None;
            }
            self.epoch = p.epoch;
            self.seed = p.seed;
            self.consumed = p.consumed;
            self.skip = p.skip;
        }
    }

    /// Tells the Accelerator where the loader now is.
    fn publish(&self) {
        if let Some(shared) = &self.shared {
            *shared.lock() = self.own_position();
        }
    }

    fn own_position(&self) -> LoaderPosition {
        let n = self.dataset.len();
        let len = self.len();
        // Every rank's batches of a full step are consumed together; once this rank's plan is
        // done, so is the epoch (a dropped tail included).
        let samples = if len > 0 && self.consumed >= len {
            n
        } else {
            (self.skip + self.consumed * self.world * self.batch_size).min(n)
        };
        LoaderPosition {
            epoch: self.epoch,
            seed: self.seed,
            consumed: self.consumed,
            skip: self.skip,
            samples,
        }
    }

    /// Whether this rank has had every batch of the current epoch.
    fn epoch_done(&self) -> bool {
        let len = self.len();
        (len > 0 && self.consumed >= len) || (self.skip > 0 && self.skip >= self.dataset.len())
    }

    /// Returns true once an accelerator has prepared this loader.
    pub fn is_prepared(&self) -> bool {
        self.prepared
    }

    /// Returns the number of batches this rank gets per epoch.
    pub fn len(&self) -> usize {
        sampler::batches_per_rank(
            self.dataset.len().saturating_sub(self.skip),
            self.batch_size,
            self.world,
            self.rank,
            self.drop_last,
            self.even_batches,
        )
    }

    /// Returns true when this rank gets no batches.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Returns the number of samples per batch on this rank.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Returns the current epoch.
    pub fn epoch(&self) -> u64 {
        self.position().epoch
    }

    /// Moves to `epoch`, at its start; naming the current epoch keeps the position, so a loop
    /// calling `set_epoch(e)` each epoch resumes mid-epoch after `set_position`.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.adopt();
        if epoch != self.epoch {
            self.epoch = epoch;
            self.consumed = 0;
            self.skip = 0;
            self.plan = None;
            self.publish();
        }
    }

    /// Returns the position to save: epoch, seed and batches consumed.
    pub fn position(&self) -> LoaderPosition {
        match &self.shared {
            Some(shared) => *shared.lock(),
            None => self.own_position(),
        }
    }

    /// Restores a saved position, so the next batch is the one after the last yielded.
    pub fn set_position(&mut self, position: LoaderPosition) -> Result<()> {
        let len = sampler::batches_per_rank(
            self.dataset.len().saturating_sub(position.skip),
            self.batch_size,
            self.world,
            self.rank,
            self.drop_last,
            self.even_batches,
        );
        if position.consumed > len {
            return Err(Error::Usage(format!(
                "the saved data position has {} batches consumed, but this loader yields {len} \
                 per epoch on this rank; resume with the same dataset, batch size, drop_last, \
                 even_batches and number of processes as the saved run",
                position.consumed
            )));
        }
        if (position.epoch, position.seed, position.skip) != (self.epoch, self.seed, self.skip) {
            self.plan = None;
        }
        self.epoch = position.epoch;
        self.seed = position.seed;
        self.consumed = position.consumed;
        self.skip = position.skip;
        self.publish();
        Ok(())
    }

    /// Returns how many samples of the last yielded batch were padding (repeats that evened
    /// out the ranks); drop that many rows from the end before computing metrics.
    pub fn last_batch_padding(&self) -> usize {
        self.last_padding
    }

    /// Returns the dataset.
    pub fn dataset(&self) -> &D {
        &self.dataset
    }

    /// Iterates over the rest of the current epoch; when it is already complete, over the
    /// whole next epoch (reshuffled), so a plain `for` loop per epoch needs no `set_epoch`.
    pub fn iter(&mut self) -> Batches<'_, D> {
        let pending = if self.batch_size == 0 {
            Some(Error::config(
                "batch_size",
                0,
                "give DataLoader::new a batch size of at least 1",
            ))
        } else {
            self.adopt();
            if self.epoch_done() {
                self.set_epoch(self.epoch.wrapping_add(1));
            }
            None
        };
        Batches {
            loader: self,
            pending,
        }
    }

    /// Builds this epoch's plan if it is not cached yet.
    fn ensure_plan(&mut self) {
        if self.plan.is_none() {
            self.plan_gen += 1;
            let order =
                sampler::epoch_order(self.dataset.len(), self.shuffle, self.seed, self.epoch);
            self.plan = Some(sampler::plan_epoch(
                &order[self.skip.min(order.len())..],
                self.batch_size,
                self.world,
                self.rank,
                self.drop_last,
                self.even_batches,
            ));
        }
    }

    /// Fetches the next planned batch, advancing the position even when fetching fails so a
    /// bad sample cannot stall the loop forever.
    fn next_batch(&mut self) -> Option<Result<D::Batch>> {
        self.ensure_plan();
        let plan = self.plan.as_ref()?;
        let index = self.consumed;
        let planned = plan.get(index)?;
        self.consumed += 1;
        self.publish();
        let fetching = std::time::Instant::now();
        let batch = match &mut self.ahead {
            Some(ahead) => {
                // This batch and the next ones are asked for; this one is waited for.
                for (i, p) in plan.iter().enumerate().skip(index).take(ahead.depth() + 1) {
                    ahead.ask((self.plan_gen, i), &p.indices, &self.device);
                }
                ahead
                    .take((self.plan_gen, index))
                    .unwrap_or_else(|| self.dataset.get_batch(&planned.indices, &self.device))
            }
            None => self.dataset.get_batch(&planned.indices, &self.device),
        };
        self.last_padding = planned.padding;
        if batch.is_ok() {
            if let Some(observer) = &self.observer {
                observer.on_fetch(fetching.elapsed());
                observer.on_samples(planned.indices.len().saturating_sub(planned.padding));
                observer.on_batch(index, plan.len(), planned.padding);
            }
        }
        Some(batch)
    }
}

/// Rejects a split with no processes or a rank outside it.
fn check_split(rank: usize, world: usize) -> Result<()> {
    if world == 0 || rank >= world {
        return Err(Error::Usage(format!(
            "rank {rank} of a world of {world} processes does not exist; the rank must be \
             below the (non-zero) number of processes"
        )));
    }
    Ok(())
}

impl<D: Dataset> fmt::Debug for DataLoader<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataLoader")
            .field("samples", &self.dataset.len())
            .field("batch_size", &self.batch_size)
            .field("shuffle", &self.shuffle)
            .field("drop_last", &self.drop_last)
            .field("even_batches", &self.even_batches)
            .field("device", &self.device)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("prepared", &self.prepared)
            .field("prefetch", &self.ahead_settings)
            .field("position", &self.position())
            .finish_non_exhaustive()
    }
}

/// The batches of one epoch (from the loader's position on), as `DataLoader::iter` returns them.
pub struct Batches<'a, D: Dataset> {
    loader: &'a mut DataLoader<D>,
    /// A setting error to report once, instead of yielding batches.
    pending: Option<Error>,
}

impl<D: Dataset> Iterator for Batches<'_, D> {
    type Item = Result<D::Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(err) = self.pending.take() {
            return Some(Err(err));
        }
        if self.loader.batch_size == 0 {
            return None;
        }
        self.loader.next_batch()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.loader.len().saturating_sub(self.loader.consumed);
        let left = left + usize::from(self.pending.is_some());
        (left, Some(left))
    }
}

impl<D: Dataset> ExactSizeIterator for Batches<'_, D> {}

impl<'a, D: Dataset> IntoIterator for &'a mut DataLoader<D> {
    type Item = Result<D::Batch>;
    type IntoIter = Batches<'a, D>;

    fn into_iter(self) -> Batches<'a, D> {
        self.iter()
    }
}

#[path = "loader_prefetch.rs"]
mod prefetching;

#[cfg(test)]
#[path = "loader_tests.rs"]
mod tests;
