//! # ivme: Accelerate-style distributed training for candle
//!
//! Write an ordinary candle training loop; run it unchanged on a CPU, one GPU, many processes
//! or many machines, with gradient accumulation, clipping and mixed precision. Use the
//! [`Accelerator`] by hand, or put [`#[accelerate(...)]`](macro@accelerate) on the training
//! function and let it write the runtime calls.
//!
//! A single process is a world of size one: the same program runs under `cargo run` and under
//! `ivme launch --num_processes N`.
//!
//! ```no_run
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{linear, Optimizer, VarBuilder, VarMap};
//! use ivme::optim::{AdamW, ParamsAdamW};
//!
//! #[ivme::accelerate(grad_accum = 2, precision = "bf16", clip_grad_norm = 1.0)]
//! fn train(batches: Vec<(Tensor, Tensor)>) -> candle_core::Result<()> {
//!     let device = Device::Cpu; // becomes this process's device
//!     let varmap = VarMap::new();
//!     let model = linear(8, 1, VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
//!     let mut opt = AdamW::new(varmap.all_vars(), ParamsAdamW::default())?;
//!     for (inputs, targets) in batches {
//!         let outputs = model.forward(&inputs.to_device(&device)?)?;
//!         let loss = candle_nn::loss::mse(&outputs, &targets.to_device(&device)?)?;
//!         let grads = loss.backward()?;
//!         opt.step(&grads)?;
//!     }
//!     Ok(())
//! }
//! # fn main() {}
//! ```

#![warn(missing_docs)]

pub mod accelerator;
pub mod autocast;
mod bucket;
mod buffers;
mod builder;
pub mod checkpoint;
pub mod comm;
pub mod config;
pub mod data;
pub mod env;
pub mod error;
mod exact_init;
pub mod grads;
pub mod logging;
pub mod memory;
pub mod metrics;
mod model_dtype;
mod model_files;
pub mod optim;
mod precision;
pub mod prepare;
pub mod progress;
mod register;
mod resume;
pub mod rng;
pub mod scaler;
mod shard;
pub mod state;
pub mod stateful;
mod sync;
pub mod tracking;
mod training;
mod window;

#[doc(hidden)]
pub mod macro_support;

pub use accelerator::{Accelerator, AcceleratorBuilder};
pub use config::{BufferSync, Precision, Sharding};
pub use error::{Error, Result};
pub use grads::Gradients;
pub use ivme_macros::accelerate;
pub use prepare::Prepare;

/// What this build of the library was made with, for bug reports (`ivme env` prints it).
pub mod build {
    /// The library's version.
    pub const VERSION: &str = env!("CARGO_PKG_VERSION");
    /// The rustc that compiled the library.
    pub const RUSTC: &str = env!("IVME_BUILD_RUSTC");
    /// The candle version the library was built against.
    pub const CANDLE: &str = env!("IVME_BUILD_CANDLE");
    /// The library's optional backends, each with whether this build has it.
    pub const FEATURES: &[(&str, bool)] = &[
        ("mpi", cfg!(feature = "mpi")),
        ("cuda", cfg!(feature = "cuda")),
        ("metal", cfg!(feature = "metal")),
    ];
}
