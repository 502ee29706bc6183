//! The llama family, trainable end to end: Llama 2/3 (with Llama 3's rope scaling), Mistral
//! (sliding window), Qwen2 (query/key/value biases) and Phi-3 (fused projections), read from a
//! Hugging Face folder.
//!
//! Every norm, rotary embedding and attention goes through [`crate::nn`]'s differentiable
//! ops, so `loss.backward()` reaches every weight (candle-transformers' `Llama` reaches the
//! output head only). The forward covers the whole sequence: logits at every position, no KV
//! cache. The model is a [`CausalLm`]: its blocks can be run one by
//! one. Variable names are transformers': `model.embed_tokens.weight`,
//! `model.layers.N.self_attn.q_proj.weight`, …, `model.norm.weight`, `lm_head.weight`.
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use ivme::models::{causal_lm_loss, llama::{Llama, LlamaConfig}, load_weights, IGNORE_INDEX};
//! # fn main() -> ivme::Result<()> {
//! let folder = std::path::Path::new("my-llama");
//! let cfg = LlamaConfig::from_folder(folder)?;
//! let varmap = VarMap::new();
//! let model = Llama::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
//! load_weights(&varmap, folder)?;
//! let ids = Tensor::new(&[[1u32, 5, 9, 2]], &Device::Cpu)?;
//! let loss = causal_lm_loss(&model.forward(&ids)?, &ids.to_dtype(DType::I64)?, IGNORE_INDEX)?;
//! let grads = loss.backward()?; // a gradient for every variable
//! # Ok(())
//! # }
//! ```

mod block;
mod config;

pub use block::{DecoderBlock, RmsNorm};
pub use config::{Flavor, Llama3Scaling, LlamaConfig};

use super::decoder::{BlockContext, CausalLm};
use super::proj::Proj;
use super::rotary::RotaryTables;
use crate::finetune::Lora;
use crate::nn::{self, Attention};
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Embedding, VarBuilder};

/// A llama-family causal language model.
#[derive(Debug, Clone)]
pub struct Llama {
    cfg: LlamaConfig,
    embed: Embedding,
    blocks: Vec<DecoderBlock>,
    norm: RmsNorm,
    head: Proj,
    rotary: RotaryTables,
}

impl Llama {
    /// The model under `vb` (the folder's root: `model.*` and `lm_head`), every weight trained.
    pub fn new(cfg: &LlamaConfig, vb: VarBuilder) -> Result<Llama> {
        Self::build(cfg, vb, None)
    }

    /// The model with LoRA adapters on the linears `lora`'s targets name (transformers' module
    /// names: `q_proj`, `v_proj`, `layers.0.mlp.up_proj`, …); over a frozen base (`vb` from
    /// [`Accelerator::base_var_builder`](crate::Accelerator::base_var_builder)) only the
    /// adapters train.
    pub fn with_lora(cfg: &LlamaConfig, vb: VarBuilder, lora: &Lora) -> Result<Llama> {
        Self::build(cfg, vb, Some(lora))
    }

    fn build(cfg: &LlamaConfig, vb: VarBuilder, lora: Option<&Lora>) -> Result<Llama> {
        let m = vb.pp("model");
        let embed = candle_nn::embedding(cfg.vocab_size, cfg.hidden_size, m.pp("embed_tokens"))?;
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| DecoderBlock::new(cfg, m.pp("layers").pp(i), lora))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, m.pp("norm"))?;
        let head = if cfg.tie_word_embeddings {
            Proj::Plain(candle_nn::Linear::new(embed.embeddings().clone(), None))
        } else {
            Proj::new(
                cfg.hidden_size,
                cfg.vocab_size,
                false,
                vb.pp("lm_head"),
                lora,
            )?
        };
        let rotary = RotaryTables::new(
            cfg.head_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling.as_ref(),
            vb.device(),
        )?;
        Ok(Llama {
            cfg: cfg.clone(),
            embed,
            blocks,
            norm,
            head,
            rotary,
        })
    }

    /// The config the model was built from.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Logits `(b, t, vocab)` at every position of `input_ids` `(b, t)` (u32 or i64 token ids).
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.logits(input_ids, None)
    }

    /// [`forward`](Self::forward) with a padding mask `(b, t)`: keys where it is 0 are never
    /// attended to (the 1s and 0s transformers' `attention_mask` holds).
    pub fn forward_masked(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.logits(input_ids, attention_mask)
    }
}

impl CausalLm for Llama {
    type Block = DecoderBlock;

    /// The token embeddings `(b, t, hidden)` of `input_ids`: the input of the first block.
    fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.embed.forward(&input_ids.to_dtype(DType::U32)?)
    }

    /// Rotary tables, causal masking (and Mistral's window), the padding mask if given.
    fn context(
        &self,
        t: usize,
        dtype: DType,
        attention_mask: Option<&Tensor>,
    ) -> Result<BlockContext> {
        let attention = Attention {
            causal: true,
            sliding_window: self.cfg.sliding_window,
            ..Attention::default()
        };
        BlockContext::new(&self.rotary, t, dtype, attention_mask, attention)
    }

    /// The decoder blocks (`model.layers.N`).
    fn blocks(&self) -> &[DecoderBlock] {
        &self.blocks
    }

    /// The final norm and the output head.
    fn head(&self, hidden: &Tensor) -> Result<Tensor> {
        self.head.forward(&self.norm.forward(hidden)?)
    }

    /// The final norm, then the head and the loss together in chunks of positions (a LoRA
    /// adapted head goes through its logits).
    fn head_loss(&self, hidden: &Tensor, labels: &Tensor, ignore_index: i64) -> Result<Tensor> {
        match &self.head {
            Proj::Plain(head) if head.bias().is_none() => {
                let h = self.norm.forward(hidden)?;
                let labels = labels.flatten_all()?;
                nn::linear_cross_entropy(&h, head.weight(), &labels, ignore_index)
            }
            _ => crate::models::decoder::logits_loss(&self.head(hidden)?, labels, ignore_index),
        }
    }
}
