//! Data loading: datasets, seeded shuffling, sharding across processes, batching, device
//! placement and a resumable position.

mod dataset;
mod files;
mod json_lines;
mod loader;
mod loop_position;
mod packed;
mod position;
mod prefetch;
mod progress;
pub mod sampler;
#[cfg(any(feature = "arrow", feature = "parquet"))]
mod table;
mod text_lines;
mod token_file;

pub use dataset::{Dataset, TensorColumns, TensorDataset};
pub(crate) use files::same_files;
pub use files::DataFile;
pub use json_lines::{JsonLines, Record};
pub use loader::{Batches, DataLoader};
#[doc(hidden)]
pub use loop_position::{LoopCursor, LoopPosition};
pub use packed::Packed;
pub use position::LoaderPosition;
pub(crate) use progress::DataProgress;
#[cfg(feature = "arrow")]
pub use table::ArrowFiles;
#[cfg(feature = "parquet")]
pub use table::ParquetFiles;
#[cfg(any(feature = "arrow", feature = "parquet"))]
pub use table::{Row, Value};
pub use text_lines::TextLines;
pub use token_file::{TokenFile, TokenWidth};

/// Told about every batch a prepared loader hands out, so gradient accumulation knows where
/// each accumulation window starts and ends (including a short last window).
pub trait StepObserver: Send + Sync {
    /// Batch `index` (0-based, within the epoch) of `batches_in_epoch` is about to be used;
    /// its last `padding` samples only even out the ranks.
    fn on_batch(&self, index: usize, batches_in_epoch: usize, padding: usize);

    /// Building the batch just handed out took `took` (for the step-time report).
    fn on_fetch(&self, took: std::time::Duration) {
        let _ = took;
    }

    /// The batch just handed out holds `samples` samples besides its padding (for the
    /// progress bar's samples per second).
    fn on_samples(&self, samples: usize) {
        let _ = samples;
    }
}
