//! Differentiable fused ops and layers for training transformers.
//!
//! candle-nn's fused `rms_norm`, `layer_norm`, `softmax_last_dim`, `rope*` and `sdpa` are
//! written for inference: they carry no backward pass, so a model built on them trains only what
//! lies after its last norm. The ops here compute the same values and record a backward pass:
//! on the CPU each is one custom op whose forward and backward are one pass over the data each
//! (f32, bf16 and f16, the arithmetic in f32); on other devices they are composed of candle ops,
//! which have a backward there.
//!
//! Three ops exist for speed rather than for a missing backward: [`linear`] (candle-nn's
//! `Linear` as one graph node), [`gated`] (the gated MLP's `act(gate) · up`) and
//! [`attention_bthd`] (attention over the projections' own layout). candle's backward gives
//! every graph node, views included, a zero-filled gradient and adds into it; fewer nodes and
//! one pass per op is most of what separates a candle training step from PyTorch's. Through
//! an Accelerator's `backward`, [`linear`] also writes each weight's gradient straight into an
//! f32 buffer of its own (summed over the weight's uses, rounded once to a 16-bit weight's
//! dtype), so no weight's gradient is zero-filled and added into.
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! # fn main() -> candle_core::Result<()> {
//! let x = Var::randn(0f32, 1., (2, 5, 8), &Device::Cpu)?;
//! let w = Var::ones(8, candle_core::DType::F32, &Device::Cpu)?;
//! let y = ivme::nn::rms_norm(&x, &w, 1e-5)?;
//! let grads = y.sqr()?.sum_all()?.backward()?;
//! assert!(grads.get(&x).is_some() && grads.get(&w).is_some());
//! # Ok(())
//! # }
//! ```

mod attention;
mod cross_entropy;
mod elem;
mod fastmath;
mod gated;
pub(crate) mod grad_sink;
mod linear;
mod linear_ce;
mod norm;
mod rope;
mod rows;
mod softmax;

pub use attention::{attention, attention_bthd, attention_composed, Attention};
pub use cross_entropy::cross_entropy;
pub use gated::{gated, GateAct};
pub use linear::linear;
pub use linear_ce::linear_cross_entropy;
pub use norm::{layer_norm, rms_norm};
pub use rope::{rope, rope_i, rope_thd};
pub use softmax::softmax_last_dim;

/// The composed forms (plain candle ops, autograd's backward): what other devices run, and
/// the slow reference the fused ops are tested against.
#[doc(hidden)]
pub use cross_entropy::cross_entropy_composed;
#[doc(hidden)]
pub use gated::gated_composed;
#[doc(hidden)]
pub use linear::linear_composed;
#[doc(hidden)]
pub use norm::{layer_norm_composed, rms_norm_composed};
#[doc(hidden)]
pub use rope::{rope_composed, rope_i_composed, rope_thd_composed};
#[doc(hidden)]
pub use softmax::softmax_last_dim_composed;
