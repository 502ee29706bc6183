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

/// Reports a warning of ivme's own (see `observe::logging::warn`): `warn_user!("...", args)`,
/// the text without the `ivme: ` prefix.
macro_rules! warn_user {
    ($($arg:tt)*) => {
        $crate::observe::logging::warn(format_args!($($arg)*))
    };
}

pub mod accelerator;
pub mod activations;
pub mod checkpoint;
pub mod comm;
pub mod data;
pub mod error;
pub mod finetune;
pub mod models;
pub mod nn;
mod observe;
pub mod optim;
mod precision;
pub mod rng;
mod setup;
pub mod stateful;
mod train;

#[doc(hidden)]
pub mod macro_support;

pub use accelerator::{Accelerator, AcceleratorBuilder};
pub use config::{BufferSync, Precision, Sharding};
pub use error::{CheckpointErrorKind, Error, Result};
pub use optim::gradients::Gradients;

/// The gradients `backward` returns and the accumulation window's state, by their older
/// paths (`ivme::grads::Gradients`); the types live in [`optim`] and the training step.
pub mod grads {
    pub use crate::optim::gradients::{global_norm, Gradients};
    pub use crate::train::bucket::all_reduce_bucketed;
    pub use crate::train::window::{GradientState, MicroStep};
}
// Public paths from before the parts had folders of their own.
pub use accelerator::prepare::{self, Prepare};
pub use ivme_macros::accelerate;
pub use observe::{logging, memory, metrics, profile, progress, step_times, tracking};
pub use precision::{autocast, scaler};
pub use setup::{config, env, preempt, state};

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
