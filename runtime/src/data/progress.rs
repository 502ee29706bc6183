//! Where the data stands: the seeded generator, every prepared loader's position and the
//! attribute's loop cursor. One part of the [`Accelerator`](crate::Accelerator), saved and
//! restored with the training state.

use super::{DataFile, LoaderPosition};
use crate::data::LoopCursor;
use crate::error::Result;
use crate::rng::{mix, Rng};
use crate::stateful::{Shared, StateDict};
use std::sync::atomic::{AtomicU64, Ordering};

/// The positions that make a resume replay exactly the data that was not yet seen.
pub(crate) struct DataProgress {
    seed: u64,
    /// The seed new model variables are drawn from: the builder's, or the last `set_seed`'s.
    init_seed: AtomicU64,
    rng: Shared<Rng>,
    loaders: Vec<Shared<LoaderPosition>>,
    /// The fingerprints of each prepared loader's files, taken when it was prepared.
    loader_files: Vec<Vec<DataFile>>,
    loop_cursor: Shared<LoopCursor>,
}

impl DataProgress {
    /// Nothing prepared yet; the generator seeded from `seed` with a stream of `rank`'s own
    /// (dropout on different data must not share masks).
    pub(crate) fn new(seed: u64, rank: usize) -> Self {
        DataProgress {
            seed,
            init_seed: AtomicU64::new(seed),
            rng: Shared::new(Rng::new(mix(seed, rank as u64))),
            loaders: Vec::new(),
            loader_files: Vec::new(),
            loop_cursor: Shared::new(Default::default()),
        }
    }

    /// The seed the builder was given.
    pub(crate) fn seed(&self) -> u64 {
        self.seed
    }

    /// The seed `Accelerator::var_builder` draws new variables from.
    pub(crate) fn init_seed(&self) -> u64 {
        self.init_seed.load(Ordering::Relaxed)
    }

    /// Reseeds the generator with `rng`, and the initialisation with `seed`.
    pub(crate) fn reseed(&self, seed: u64, rng: Rng) {
        self.init_seed.store(seed, Ordering::Relaxed);
        *self.rng.lock() = rng;
    }

    /// This process's seeded generator.
    pub(crate) fn rng(&self) -> &Shared<Rng> {
        &self.rng
    }

    /// Every prepared loader's position, in preparation order.
    pub(crate) fn loaders(&self) -> &[Shared<LoaderPosition>] {
        &self.loaders
    }

    /// The fingerprints of each prepared loader's files, in preparation order.
    pub(crate) fn loader_files(&self) -> &[Vec<DataFile>] {
        &self.loader_files
    }

    /// Adds a prepared loader's position and the fingerprints of the files it reads.
    pub(crate) fn add_loader(&mut self, position: Shared<LoaderPosition>, files: Vec<DataFile>) {
        self.loaders.push(position);
        self.loader_files.push(files);
    }

    /// The position of the attribute's loops over plain collections.
    pub(crate) fn loop_cursor(&self) -> &Shared<LoopCursor> {
        &self.loop_cursor
    }

    /// Each prepared loader's saved state: its position, and the files it counts in (a
    /// resume checks they are the same).
    pub(crate) fn loader_states(&self) -> Result<Vec<StateDict>> {
        let loaders = self.loaders.iter().zip(&self.loader_files);
        loaders
            .map(|(l, files)| {
                let mut json = serde_json::to_value(*l.lock())?;
                json["files"] = serde_json::to_value(files)?;
                Ok(StateDict {
                    tensors: Vec::new(),
                    json,
                })
            })
            .collect()
    }

    /// The generator's saved state.
    pub(crate) fn rng_state(&self) -> Result<StateDict> {
        Ok(StateDict {
            tensors: Vec::new(),
            json: serde_json::to_value(self.rng.lock().state())?,
        })
    }

    /// Puts loaded positions back: each loader's, the generator's (`None` keeps this rank's
    /// own, for a rank the saving run did not have) and the attribute's loop's.
    pub(crate) fn restore(
        &self,
        loaders: Vec<LoaderPosition>,
        rng: Option<crate::rng::RngState>,
        macro_loop: Option<crate::data::LoopPosition>,
    ) {
        for (shared, pos) in self.loaders.iter().zip(loaders) {
            *shared.lock() = pos;
        }
        if let Some(rng) = rng {
            *self.rng.lock() = Rng::from_state(rng);
        }
        if let Some(p) = macro_loop {
            self.loop_cursor.lock().resume_from(p);
        }
    }
}
