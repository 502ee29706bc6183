//! Where a loader stands in its epoch, and how that position carries over to a run on another
//! number of processes.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Where a loader stands: the epoch, the shuffle seed and how many of this rank's batches of
/// that epoch have been handed out. Saved with the training state so a resumed run continues
/// with the next batch.
///
/// `skip` and `samples` count in samples of the epoch's (shared, shuffled) order, so a position
/// means the same thing on any number of processes: a run resumed on another world size skips
/// the `samples` already used and splits the rest of the epoch among its own ranks.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoaderPosition {
    /// The epoch, which with the seed fixes the shuffled order.
    pub epoch: u64,
    /// The shuffle seed.
    pub seed: u64,
    /// Batches of this epoch already yielded on this rank.
    pub consumed: usize,
    /// Samples at the start of this epoch's order that a run on another number of processes
    /// had already used; this rank's batches split the rest. Zero except after such a resume.
    #[serde(default)]
    pub skip: usize,
    /// Samples of this epoch's order used by all ranks together, up to this position (the
    /// whole dataset once the epoch is complete). Written by the loader; read when the state is
    /// resumed on another number of processes.
    #[serde(default)]
    pub samples: usize,
}

impl LoaderPosition {
    /// The position a run on another number of processes resumes from: the same epoch and
    /// seed, with the samples this position had used skipped and the rest of the epoch ahead.
    ///
    /// Refuses a mid-epoch position written before positions counted samples (ivme 0.1.0's
    /// first checkpoints), which cannot be placed in a different split.
    pub fn for_new_world(&self) -> Result<LoaderPosition> {
        if self.consumed > 0 && self.samples == 0 {
            return Err(Error::Usage(
                "the saved data position does not say how many samples all ranks had used (it \
                 was written by an older ivme), so it cannot be moved to another number of \
                 processes; resume on the number of processes that saved it"
                    .into(),
            ));
        }
        Ok(LoaderPosition {
            epoch: self.epoch,
            seed: self.seed,
            consumed: 0,
            skip: self.samples,
            samples: self.samples,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{DataLoader, TensorDataset};
    use candle_core::{Device, Tensor};

    /// Every rank's sample ids for the rest of the epoch, as `(rank, ids)` per batch.
    fn rest_of_epoch(n: u32, batch: usize, world: usize, at: LoaderPosition) -> Vec<Vec<u32>> {
        (0..world)
            .map(|r| {
                let x = Tensor::arange(0u32, n, &Device::Cpu).unwrap();
                let mut l = DataLoader::new(TensorDataset::new(x).unwrap(), batch)
                    .shuffle(true)
                    .seed(5)
                    .shard(r, world)
                    .unwrap();
                l.set_position(at).unwrap();
                let mut ids = Vec::new();
                for b in l.iter() {
                    ids.extend(b.unwrap().to_vec1::<u32>().unwrap());
                }
                ids
            })
            .collect()
    }

    #[test]
    fn a_position_moved_to_another_world_size_covers_the_rest_of_the_epoch_once() {
        let n = 23u32;
        // 2 ranks × batch 3: after 2 batches each, 12 samples of the shuffled order are used.
        let x = Tensor::arange(0u32, n, &Device::Cpu).unwrap();
        let mut seen = Vec::new();
        let mut saved = LoaderPosition::default();
        for r in 0..2 {
            let mut l = DataLoader::new(TensorDataset::new(x.clone()).unwrap(), 3)
                .shuffle(true)
                .seed(5)
                .shard(r, 2)
                .unwrap();
            for b in l.iter().take(2) {
                seen.extend(b.unwrap().to_vec1::<u32>().unwrap());
            }
            saved = l.position();
        }
        assert_eq!((saved.consumed, saved.samples), (2, 12));
        let moved = saved.for_new_world().unwrap();
        for (world, batch) in [(1usize, 6usize), (3, 2), (3, 4)] {
            let rest = rest_of_epoch(n, batch, world, moved);
            let mut all: Vec<u32> = seen.iter().chain(rest.iter().flatten()).copied().collect();
            // Padding repeats at most world - 1 samples so every rank runs as many steps.
            let padded = all.len() - n as usize;
            assert!(padded < world, "{world}×{batch}: {padded} repeats");
            all.sort();
            all.dedup();
            assert_eq!(all, (0..n).collect::<Vec<_>>(), "{world}×{batch}");
        }
        // The next epoch starts from its beginning, on the whole order.
        let x = Tensor::arange(0u32, n, &Device::Cpu).unwrap();
        let mut l = DataLoader::new(TensorDataset::new(x).unwrap(), 4)
            .shuffle(true)
            .seed(5);
        l.set_position(moved).unwrap();
        let rest: usize = l.iter().map(|b| b.unwrap().dims()[0]).sum();
        assert_eq!(rest, n as usize - 12);
        let next: usize = l.iter().map(|b| b.unwrap().dims()[0]).sum();
        assert_eq!(next, n as usize);
        assert_eq!(l.epoch(), 1);
    }

    #[test]
    fn a_finished_epoch_moves_as_finished_and_old_positions_are_refused() {
        let x = Tensor::arange(0u32, 10, &Device::Cpu).unwrap();
        let mut l = DataLoader::new(TensorDataset::new(x.clone()).unwrap(), 4).drop_last(true);
        for b in l.iter() {
            b.unwrap();
        }
        // The dropped tail counts as used: the epoch is over.
        assert_eq!(l.position().samples, 10);
        let moved = l.position().for_new_world().unwrap();
        let mut fresh = DataLoader::new(TensorDataset::new(x).unwrap(), 3);
        fresh.set_position(moved).unwrap();
        assert_eq!(fresh.iter().count(), 4, "the whole next epoch");
        assert_eq!(fresh.epoch(), 1);
        let old = LoaderPosition {
            epoch: 0,
            seed: 0,
            consumed: 2,
            ..Default::default()
        };
        let e = old.for_new_world().unwrap_err().to_string();
        assert!(e.contains("older ivme"), "{e}");
    }
}
