//! Gemma 2, trainable end to end, read from a Hugging Face folder (`Gemma2ForCausalLM`).
//!
//! What sets it apart from the llama family: the embeddings are scaled by `sqrt(hidden_size)`;
//! every RMS norm scales by `1 + weight`; each block norms the attention's and the MLP's inputs
//! and outputs (four norms); the attention scores are scaled by `query_pre_attn_scalar^-0.5`
//! and soft-capped (`cap · tanh(s / cap)`); the layers `layer_types` marks `sliding_attention`
//! attend through a sliding window, the others to the whole prefix; the MLP gates with the tanh
//! GELU; the output head is tied to the embedding and its logits are soft-capped too.
//!
//! Every norm, rotary embedding and attention goes through [`crate::nn`]'s differentiable
//! ops, so `loss.backward()` reaches every weight. The forward covers the whole sequence: logits
//! at every position, no KV cache. Variable names are transformers':
//! `model.embed_tokens.weight`, `model.layers.N.self_attn.q_proj.weight`, …,
//! `model.layers.N.pre_feedforward_layernorm.weight`, …, `model.norm.weight`.
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use ivme::models::gemma2::{Gemma2, Gemma2Config};
//! use ivme::models::{causal_lm_loss, load_weights, IGNORE_INDEX};
//! # fn main() -> ivme::Result<()> {
//! let folder = std::path::Path::new("my-gemma2");
//! let cfg = Gemma2Config::from_folder(folder)?;
//! let varmap = VarMap::new();
//! let model = Gemma2::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
//! load_weights(&varmap, folder)?;
//! let ids = Tensor::new(&[[1u32, 5, 9, 2]], &Device::Cpu)?;
//! let loss = causal_lm_loss(&model.forward(&ids)?, &ids.to_dtype(DType::I64)?, IGNORE_INDEX)?;
//! let grads = loss.backward()?; // a gradient for every variable
//! # Ok(())
//! # }
//! ```

mod block;
mod config;

pub use block::{Gemma2Block, GemmaRmsNorm};
pub use config::Gemma2Config;

use super::decoder::{BlockContext, CausalLm};
use super::proj::Proj;
use super::rotary::RotaryTables;
use crate::finetune::Lora;
use crate::nn::Attention;
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Embedding, VarBuilder};

/// A Gemma 2 causal language model.
#[derive(Debug, Clone)]
pub struct Gemma2 {
    cfg: Gemma2Config,
    embed: Embedding,
    blocks: Vec<Gemma2Block>,
    norm: GemmaRmsNorm,
    head: Proj,
    rotary: RotaryTables,
}

impl Gemma2 {
    /// The model under `vb` (the folder's root: `model.*`, and `lm_head` when untied), every
    /// weight trained.
    pub fn new(cfg: &Gemma2Config, vb: VarBuilder) -> Result<Gemma2> {
        Self::build(cfg, vb, None)
    }

    /// The model with LoRA adapters on the linears `lora`'s targets name (transformers' module
    /// names: `q_proj`, `v_proj`, `layers.0.mlp.up_proj`, …); over a frozen base (`vb` from
    /// [`Accelerator::base_var_builder`](crate::Accelerator::base_var_builder)) only the
    /// adapters train.
    pub fn with_lora(cfg: &Gemma2Config, vb: VarBuilder, lora: &Lora) -> Result<Gemma2> {
        Self::build(cfg, vb, Some(lora))
    }

    fn build(cfg: &Gemma2Config, vb: VarBuilder, lora: Option<&Lora>) -> Result<Gemma2> {
        let m = vb.pp("model");
        let embed = candle_nn::embedding(cfg.vocab_size, cfg.hidden_size, m.pp("embed_tokens"))?;
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| Gemma2Block::new(cfg, i, m.pp("layers").pp(i), lora))
            .collect::<Result<Vec<_>>>()?;
        let norm = GemmaRmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, m.pp("norm"))?;
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
            None,
            vb.device(),
        )?;
        Ok(Gemma2 {
            cfg: cfg.clone(),
            embed,
            blocks,
            norm,
            head,
            rotary,
        })
    }

    /// The config the model was built from.
    pub fn config(&self) -> &Gemma2Config {
        &self.cfg
    }

    /// Logits `(b, t, vocab)` at every position of `input_ids` `(b, t)` (u32 or i64 token ids),
    /// soft-capped by `final_logit_softcapping`.
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

impl CausalLm for Gemma2 {
    type Block = Gemma2Block;

    /// The token embeddings `(b, t, hidden)` of `input_ids`, scaled by `sqrt(hidden_size)` (the
    /// factor rounded to the activations' dtype, as transformers does): the first block's input.
    fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        let e = self.embed.forward(&input_ids.to_dtype(DType::U32)?)?;
        let normalizer =
            Tensor::new((self.cfg.hidden_size as f32).sqrt(), e.device())?.to_dtype(e.dtype())?;
        e.broadcast_mul(&normalizer)
    }

    /// What every block needs for a sequence of `t` tokens whose activations are `dtype`:
    /// rotary tables, causal masking, the padding mask if given (each block adds its own scale,
    /// soft-capping and window).
    fn context(
        &self,
        t: usize,
        dtype: DType,
        attention_mask: Option<&Tensor>,
    ) -> Result<BlockContext> {
        let attention = Attention {
            causal: true,
            ..Attention::default()
        };
        BlockContext::new(&self.rotary, t, dtype, attention_mask, attention)
    }

    /// The decoder blocks, in order: the units a checkpointed or sharded forward runs one by
    /// one (`model.layers.N`).
    fn blocks(&self) -> &[Gemma2Block] {
        &self.blocks
    }

    /// The final norm, the output head and the final soft-capping over the last block's
    /// output: logits.
    fn head(&self, hidden: &Tensor) -> Result<Tensor> {
        let logits = self.head.forward(&self.norm.forward(hidden)?)?;
        match self.cfg.final_logit_softcapping {
            Some(cap) => (logits / cap)?.tanh()? * cap,
            None => Ok(logits),
        }
    }
}
