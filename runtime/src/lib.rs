//! # ivme: Accelerate-style distributed training for candle
//!
//! Write an ordinary candle training loop; run it unchanged on a CPU, one GPU, many processes
//! or many machines, with gradient accumulation, clipping and mixed precision. Use the
//! [`Accelerator`] by hand, or put [`#[accelerate(...)]`](macro@accelerate) on the training
//! function and let it write the runtime calls.
//!
//! A single process is a world of size one: the same program runs under `cargo run` and under
//! `ivme launch --num_processes N`.

#![warn(missing_docs)]

pub mod accelerator;
pub mod autocast;
mod builder;
pub mod checkpoint;
pub mod comm;
pub mod config;
pub mod data;
pub mod error;
pub mod grads;
pub mod logging;
pub mod memory;
pub mod metrics;
pub mod optim;
pub mod prepare;
pub mod progress;
mod resume;
pub mod rng;
pub mod scaler;
pub mod state;
pub mod stateful;
pub mod tracking;

#[doc(hidden)]
pub mod macro_support;

pub use accelerator::{Accelerator, AcceleratorBuilder};
pub use config::Precision;
pub use error::{Error, Result};
pub use grads::Gradients;
pub use ivme_macros::accelerate;
pub use prepare::Prepare;
