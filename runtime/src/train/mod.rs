//! The training step's parts below the facade: the prepared models' parameters and window
//! sums (`params.rs`, `training.rs`), where the window stands (`window.rs`), how a window ends
//! (`sync/`: replicated or sharded, with the buckets of `bucket.rs` and the slices of
//! `shard.rs`), and buffers.

pub(crate) mod bucket;
pub(crate) mod buffers;
pub(crate) mod frozen;
pub(crate) mod params;
mod params_io;
mod params_prepare;
pub(crate) mod reach;
pub(crate) mod shard;
pub(crate) mod sync;
pub(crate) mod training;
pub(crate) mod window;
