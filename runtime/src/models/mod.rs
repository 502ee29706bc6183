//! Trainable model families, loadable from Hugging Face folders.
//!
//! candle-transformers' models are written for inference: their norms, softmax and rotary
//! embeddings carry no backward pass, so training one reaches only its output head. The
//! families here are built on [`crate::nn`]'s differentiable ops and train every weight; their
//! blocks are the units a checkpointed or sharded forward takes.

pub mod bert;
mod config_file;
mod decoder;
pub mod gemma2;
pub mod llama;
mod load;
mod loss;
mod proj;
mod rotary;

pub use decoder::{run_block, Block, BlockContext, CausalLm};
pub use load::load_weights;
pub use loss::{causal_lm_loss, token_loss, IGNORE_INDEX};
pub use proj::Proj;
pub use rotary::RotaryTables;
