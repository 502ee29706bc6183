//! The loader's prefetch settings ([`DataLoader::prefetch`], [`DataLoader::workers`]): they
//! start the worker threads of `data/prefetch.rs` that `next_batch` asks batches of.

use super::DataLoader;
use crate::data::prefetch::Workers;
use crate::data::Dataset;

impl<D> DataLoader<D>
where
    D: Dataset + Send + Sync + 'static,
    D::Batch: Send + 'static,
{
    /// Builds up to `depth` batches ahead on background threads (0, the default, builds each
    /// when the loop asks), so that reading and decoding samples overlaps the training step.
    /// The batches, their order, the position saved in checkpoints and where an error shows
    /// are the same as without it; at most `depth` batches wait in memory. While the loop
    /// waits it builds itself the batches no worker has started, so prefetching is not
    /// slower than none for a dataset whose batches cost less than a hand-off to a thread. See
    /// [`workers`](Self::workers) for the number of threads (1 by default).
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use ivme::data::{DataLoader, TensorDataset};
    ///
    /// let x = Tensor::arange(0f32, 10., &Device::Cpu)?;
    /// let mut loader = DataLoader::new(TensorDataset::new(x)?, 4).prefetch(2);
    /// assert_eq!(loader.iter().count(), 3);
    /// # Ok::<(), ivme::Error>(())
    /// ```
    pub fn prefetch(mut self, depth: usize) -> Self {
        self.ahead_settings.0 = depth;
        self.restart_workers();
        self
    }

    /// Builds the batches asked for by [`prefetch`](Self::prefetch) on `threads` threads
    /// (at least 1), for datasets whose samples are costly to read or decode.
    pub fn workers(mut self, threads: usize) -> Self {
        self.ahead_settings.1 = threads.max(1);
        self.restart_workers();
        self
    }

    fn restart_workers(&mut self) {
        let (depth, threads) = self.ahead_settings;
        // The old workers (if any) finish their batch and stop first.
        self.ahead = None;
        if depth > 0 {
            let workers: Workers<D::Batch> = Workers::start(self.dataset.clone(), depth, threads);
            self.ahead = Some(Box::new(workers));
        }
    }
}
