//! Saving and loading: Hugging Face model files and crash-safe, verified training checkpoints.
//!
//! - [`model`]: `model.safetensors` or numbered shards with an index json, the layout the
//!   Hugging Face ecosystem reads; loading checks names and shapes before touching a variable.
//! - [`store`]: per-rank training state in a folder that becomes a checkpoint only when a
//!   manifest of every file's checksum is written last and the folder is renamed into place.
//! - [`project`]: automatic `checkpoint_{n}` naming, finding the newest valid checkpoint, and
//!   rotation.
//! - [`lock`]: one writing job per checkpoint folder (an advisory lock naming its holder).
//! - [`staging`]: a uniquely named, claimed temporary folder per save, and recovery of what
//!   crashed saves leave behind.
//! - [`background`]: asynchronous saves: the state copied into host memory, written by a
//!   background thread, committed at the next wait point.
//! - [`layout`]: how model and optimizer state spreads over the rank folders (whole on rank 0,
//!   or each rank's slice under sharding), so a checkpoint resumes on any number of processes;
//!   [`merge_weights`] turns any layout into a Hugging Face model folder.
//!
//! - `plan`: what a load has found and will apply, checked before anything changes.
//! - `snapshots`: in-memory snapshots every few steps, which a restart resumes from when they
//!   are newer than the newest checkpoint on disk.
//!
//! These are storage and protocol over tensors, JSON and paths: no file here imports the
//! [`Accelerator`](crate::Accelerator). The facade (`accelerator/checkpoints.rs`, `restore.rs`,
//! `reshard.rs`, `newest.rs`, `background.rs`) gathers each part's state and puts barriers
//! between the steps.

pub mod background;
pub(crate) mod checks;
pub(crate) mod direct;
#[doc(hidden)]
pub mod faults;
pub(crate) mod format;
pub(crate) mod fsio;
pub mod layout;
#[cfg(test)]
mod load_tests;
pub mod lock;
mod manifest;
mod merge;
pub mod model;
pub(crate) mod names;
pub(crate) mod own_state;
mod parts;
pub(crate) mod plan;
pub mod project;
pub(crate) mod read;
pub(crate) mod snapshots;
pub(crate) use parts::Checkpointing;
pub mod staging;
pub mod store;
pub(crate) mod swap;

pub use lock::FolderLock;
pub use merge::{merge_weights, MergeOptions, Merged};
pub use model::{
    load_checkpoint_in_model, load_checkpoint_in_varmap, read_safetensors_metadata, save_model,
    LoadReport, ShardSize,
};
pub use project::{find_resumable, latest_valid, rotate, ProjectConfiguration};
pub use store::{
    abandon, begin, clean_stale, commit, read_rank, read_rank_with, stream_tensors, verify,
    Cleaned, Component, FileEntry, Manifest, ManifestMeta, RankState,
};
