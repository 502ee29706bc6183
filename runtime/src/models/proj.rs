//! The linear layers of a model: trained in full, or frozen with a LoRA adapter where the
//! fine-tune's targets name the module.

use crate::finetune::{Lora, LoraLinear};
use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;

/// A model's linear layer: candle's, or ivme's LoRA-adapted one.
#[derive(Debug, Clone)]
pub enum Proj {
    /// `x Wᵀ + b`, every weight as the builder made it.
    Plain(candle_nn::Linear),
    /// A frozen (or not) base plus an adapter where the module was a target.
    Lora(LoraLinear),
}

impl Proj {
    /// A linear layer `in_dim → out_dim` under `vb` (`weight`, and `bias` when `bias`), built by
    /// `lora` when one is given (which adds an adapter if the module's name is a target).
    pub fn new(
        in_dim: usize,
        out_dim: usize,
        bias: bool,
        vb: VarBuilder,
        lora: Option<&Lora>,
    ) -> Result<Proj> {
        Ok(match (lora, bias) {
            (Some(l), true) => Proj::Lora(l.linear(in_dim, out_dim, vb)?),
            (Some(l), false) => Proj::Lora(l.linear_no_bias(in_dim, out_dim, vb)?),
            (None, true) => Proj::Plain(candle_nn::linear(in_dim, out_dim, vb)?),
            (None, false) => Proj::Plain(candle_nn::linear_no_bias(in_dim, out_dim, vb)?),
        })
    }
}

impl Module for Proj {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Proj::Plain(l) => crate::nn::linear(x, l.weight(), l.bias()),
            Proj::Lora(l) => l.forward(x),
        }
    }
}
