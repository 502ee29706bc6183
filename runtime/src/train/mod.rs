//! The training step's parts below the facade: the prepared models' parameters and window
//! sums, the buckets they are averaged in, the gradient-sync strategies (replicated and
//! sharded), and buffers.

pub(crate) mod bucket;
pub(crate) mod buffers;
pub(crate) mod frozen;
pub mod grads;
pub(crate) mod overlap;
pub(crate) mod reach;
pub(crate) mod shard;
pub(crate) mod shard_sync;
pub(crate) mod sync;
pub(crate) mod training;
pub(crate) mod window;
