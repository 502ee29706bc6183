//! BERT, trainable end to end: the encoder (absolute positions, token types, post-norm blocks)
//! and its masked-language-model head, read from a Hugging Face folder (`BertForMaskedLM`'s
//! names: `bert.embeddings.*`, `bert.encoder.layer.N.*`, `cls.predictions.*`).
//!
//! Its layer norms and attention go through [`crate::nn`]'s differentiable ops, so every weight
//! gets a gradient (candle-transformers' `BertModel` computes its layer norms with candle-nn's
//! fused op, which has no backward pass).

use super::proj::Proj;
use crate::error::{Error, Result};
use crate::finetune::Lora;
use crate::nn::{self, Attention};
use candle_core::{DType, Module, Tensor};
use candle_nn::{Embedding, VarBuilder};
use serde::Deserialize;
use std::path::Path;

/// A BERT model's shape and settings (`config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// The width of the hidden states.
    pub hidden_size: usize,
    /// Encoder blocks.
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// The width of each block's feed-forward layer.
    pub intermediate_size: usize,
    /// Positions the position embedding holds.
    pub max_position_embeddings: usize,
    /// Token types (segments) the type embedding holds.
    pub type_vocab_size: usize,
    /// The layer norms' epsilon.
    pub layer_norm_eps: f64,
    /// The feed-forward activation: exact (`gelu`) or tanh-approximated (`gelu_new`,
    /// `gelu_pytorch_tanh`) GELU.
    pub tanh_gelu: bool,
}

#[derive(Debug, Deserialize)]
struct Raw {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    intermediate_size: usize,
    max_position_embeddings: usize,
    type_vocab_size: Option<usize>,
    layer_norm_eps: Option<f64>,
    hidden_act: Option<String>,
    position_embedding_type: Option<String>,
    hidden_dropout_prob: Option<f64>,
    attention_probs_dropout_prob: Option<f64>,
    is_decoder: Option<bool>,
}

impl BertConfig {
    /// Reads `folder/config.json` (or a `config.json` path) and checks it.
    pub fn from_folder(folder: impl AsRef<Path>) -> Result<BertConfig> {
        super::config_file::read(folder.as_ref(), Self::from_json)
    }

    /// Parses a `config.json`'s text and checks it.
    pub fn from_json(text: &str) -> Result<BertConfig> {
        let raw: Raw = serde_json::from_str(text)
            .map_err(|e| Error::Usage(format!("not a BERT config.json: {e}")))?;
        let refuse = |m: String| Err(Error::Usage(m));
        if let Some(t) = raw.model_type.as_deref().filter(|t| *t != "bert") {
            return refuse(format!("model_type `{t}` is not BERT"));
        }
        if let Some(p) = raw
            .position_embedding_type
            .as_deref()
            .filter(|p| *p != "absolute")
        {
            return refuse(format!(
                "position_embedding_type `{p}` is not supported: BERT here takes `absolute`"
            ));
        }
        if raw.is_decoder == Some(true) {
            return refuse("is_decoder = true is not supported: BERT here is an encoder".into());
        }
        for (key, p) in [
            ("hidden_dropout_prob", raw.hidden_dropout_prob),
            (
                "attention_probs_dropout_prob",
                raw.attention_probs_dropout_prob,
            ),
        ] {
            if p.is_some_and(|p| p != 0.0) {
                return refuse(format!(
                    "{key} = {} is not supported (no dropout is applied): set it to 0",
                    p.unwrap_or_default()
                ));
            }
        }
        let tanh_gelu = match raw.hidden_act.as_deref().unwrap_or("gelu") {
            "gelu" => false,
            "gelu_new" | "gelu_pytorch_tanh" => true,
            other => {
                return refuse(format!(
                    "hidden_act `{other}` is not supported: BERT here takes `gelu`, `gelu_new` \
                     or `gelu_pytorch_tanh`"
                ))
            }
        };
        if raw.num_attention_heads == 0 || raw.hidden_size % raw.num_attention_heads != 0 {
            return refuse(format!(
                "hidden_size ({}) must be a multiple of num_attention_heads ({})",
                raw.hidden_size, raw.num_attention_heads
            ));
        }
        Ok(BertConfig {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            intermediate_size: raw.intermediate_size,
            max_position_embeddings: raw.max_position_embeddings,
            type_vocab_size: raw.type_vocab_size.unwrap_or(2),
            layer_norm_eps: raw.layer_norm_eps.unwrap_or(1e-12),
            tanh_gelu,
        })
    }
}

/// A layer norm with a weight and a bias, through ivme's differentiable fused op.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f32,
}

impl LayerNorm {
    /// The norm's `weight` and `bias` of width `dim` under `vb`.
    pub fn new(dim: usize, eps: f64, vb: VarBuilder) -> candle_core::Result<LayerNorm> {
        Ok(LayerNorm {
            weight: vb.get_with_hints(dim, "weight", candle_nn::Init::Const(1.0))?,
            bias: vb.get_with_hints(dim, "bias", candle_nn::Init::Const(0.0))?,
            eps: eps as f32,
        })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        nn::layer_norm(x, &self.weight, Some(&self.bias), self.eps)
    }
}

/// One post-norm encoder block (`bert.encoder.layer.N`).
#[derive(Debug, Clone)]
pub struct EncoderBlock {
    unit: String,
    q: Proj,
    k: Proj,
    v: Proj,
    attn_out: Proj,
    attn_norm: LayerNorm,
    up: Proj,
    down: Proj,
    out_norm: LayerNorm,
    heads: usize,
    tanh_gelu: bool,
}

impl EncoderBlock {
    /// The block under `vb`, its linears adapted by `lora` where targeted (`query`, `value`, …).
    pub fn new(cfg: &BertConfig, vb: VarBuilder, lora: Option<&Lora>) -> candle_core::Result<Self> {
        let (h, i, eps) = (cfg.hidden_size, cfg.intermediate_size, cfg.layer_norm_eps);
        let a = vb.pp("attention");
        let s = a.pp("self");
        Ok(EncoderBlock {
            unit: vb.prefix(),
            q: Proj::new(h, h, true, s.pp("query"), lora)?,
            k: Proj::new(h, h, true, s.pp("key"), lora)?,
            v: Proj::new(h, h, true, s.pp("value"), lora)?,
            attn_out: Proj::new(h, h, true, a.pp("output").pp("dense"), lora)?,
            attn_norm: LayerNorm::new(h, eps, a.pp("output").pp("LayerNorm"))?,
            up: Proj::new(h, i, true, vb.pp("intermediate").pp("dense"), lora)?,
            down: Proj::new(i, h, true, vb.pp("output").pp("dense"), lora)?,
            out_norm: LayerNorm::new(h, eps, vb.pp("output").pp("LayerNorm"))?,
            heads: cfg.num_attention_heads,
            tanh_gelu: cfg.tanh_gelu,
        })
    }

    /// The block over hidden states `(b, t, hidden)`, attending as `attention` says (its
    /// padding mask; no causal masking).
    pub fn forward(&self, x: &Tensor, attention: &Attention) -> candle_core::Result<Tensor> {
        let (b, t, h) = x.dims3()?;
        let d = h / self.heads;
        let split = |p: &Proj| -> candle_core::Result<Tensor> {
            p.forward(x)?.reshape((b, t, self.heads, d))
        };
        let y = nn::attention_bthd(
            &split(&self.q)?,
            &split(&self.k)?,
            &split(&self.v)?,
            attention,
        )?;
        let y = y.reshape((b, t, h))?;
        let x = self.attn_norm.forward(&(x + self.attn_out.forward(&y)?)?)?;
        let up = gelu(&self.up.forward(&x)?, self.tanh_gelu)?;
        self.out_norm.forward(&(&x + self.down.forward(&up)?)?)
    }
}

fn gelu(x: &Tensor, tanh: bool) -> candle_core::Result<Tensor> {
    if tanh {
        x.gelu()
    } else {
        x.gelu_erf()
    }
}

/// BERT with its masked-language-model head (`BertForMaskedLM`).
#[derive(Debug, Clone)]
pub struct Bert {
    cfg: BertConfig,
    words: Embedding,
    positions: Embedding,
    types: Embedding,
    embed_norm: LayerNorm,
    blocks: Vec<EncoderBlock>,
    transform: Proj,
    transform_norm: LayerNorm,
    decoder_bias: Tensor,
}

impl Bert {
    /// The model under `vb` (the folder's root), every weight trained.
    pub fn new(cfg: &BertConfig, vb: VarBuilder) -> candle_core::Result<Bert> {
        Self::build(cfg, vb, None)
    }

    /// The model with LoRA adapters on the linears `lora`'s targets name (`query`, `value`, …).
    pub fn with_lora(cfg: &BertConfig, vb: VarBuilder, lora: &Lora) -> candle_core::Result<Bert> {
        Self::build(cfg, vb, Some(lora))
    }

    fn build(cfg: &BertConfig, vb: VarBuilder, lora: Option<&Lora>) -> candle_core::Result<Bert> {
        let (h, eps) = (cfg.hidden_size, cfg.layer_norm_eps);
        let e = vb.pp("bert").pp("embeddings");
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| EncoderBlock::new(cfg, vb.pp("bert").pp("encoder").pp("layer").pp(i), lora))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let p = vb.pp("cls").pp("predictions");
        Ok(Bert {
            cfg: cfg.clone(),
            words: candle_nn::embedding(cfg.vocab_size, h, e.pp("word_embeddings"))?,
            positions: candle_nn::embedding(
                cfg.max_position_embeddings,
                h,
                e.pp("position_embeddings"),
            )?,
            types: candle_nn::embedding(cfg.type_vocab_size, h, e.pp("token_type_embeddings"))?,
            embed_norm: LayerNorm::new(h, eps, e.pp("LayerNorm"))?,
            blocks,
            transform: Proj::new(h, h, true, p.pp("transform").pp("dense"), lora)?,
            transform_norm: LayerNorm::new(h, eps, p.pp("transform").pp("LayerNorm"))?,
            decoder_bias: p.get_with_hints(cfg.vocab_size, "bias", candle_nn::Init::Const(0.0))?,
        })
    }

    /// The config the model was built from.
    pub fn config(&self) -> &BertConfig {
        &self.cfg
    }

    /// The encoder's last hidden states `(b, t, hidden)` for `input_ids` `(b, t)`, with token
    /// types (zeros when `None`) and a 0/1 padding mask (keys where it is 0 are not attended to).
    pub fn encode(
        &self,
        input_ids: &Tensor,
        token_type_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        if t > self.cfg.max_position_embeddings {
            candle_core::bail!(
                "a sequence of {t} tokens is longer than max_position_embeddings ({})",
                self.cfg.max_position_embeddings
            )
        }
        let dev = input_ids.device();
        let ids = input_ids.to_dtype(DType::U32)?;
        let types = match token_type_ids {
            Some(tt) => tt.to_dtype(DType::U32)?,
            None => Tensor::zeros((b, t), DType::U32, dev)?,
        };
        let pos = Tensor::arange(0u32, t as u32, dev)?;
        let x = self
            .words
            .forward(&ids)?
            .broadcast_add(&self.positions.forward(&pos)?)?
            .add(&self.types.forward(&types)?)?;
        let mut h = self.embed_norm.forward(&x)?;
        let attention = Attention {
            mask: attention_mask
                .map(|m| super::decoder::padding_mask(m, t))
                .transpose()?,
            ..Attention::default()
        };
        for block in &self.blocks {
            h = if crate::activations::is_recording() {
                let (block, attention) = (block.clone(), attention.clone());
                let unit = block.unit.clone();
                crate::activations::segment(&h, &unit, move |x| block.forward(x, &attention))?
            } else {
                block.forward(&h, &attention)?
            };
        }
        Ok(h)
    }

    /// The masked-LM logits `(b, t, vocab)`: the head over [`encode`](Self::encode)'s states,
    /// its decoder the word embeddings (tied, as transformers ties them) plus a bias.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        token_type_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let h = self.encode(input_ids, token_type_ids, attention_mask)?;
        let h = gelu(&self.transform.forward(&h)?, self.cfg.tanh_gelu)?;
        let h = self.transform_norm.forward(&h)?;
        h.broadcast_matmul(&self.words.embeddings().t()?)?
            .broadcast_add(&self.decoder_bias)
    }

    /// The encoder blocks, in order (`bert.encoder.layer.N`).
    pub fn blocks(&self) -> &[EncoderBlock] {
        &self.blocks
    }
}
