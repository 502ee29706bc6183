//! One Gemma 2 decoder block: RMS norm → attention → RMS norm → residual, RMS norm → gated
//! tanh-GELU MLP → RMS norm → residual. A block is the unit activation checkpointing and
//! parameter sharding take.

use super::Gemma2Config;
use crate::finetune::Lora;
use crate::models::decoder::{Block, BlockContext};
use crate::models::proj::Proj;
use crate::nn::{self, Attention};
use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;

/// Gemma's RMS norm: `x / rms(x) · (1 + weight)`, through ivme's differentiable fused op (the
/// stored weight is the offset from 1, so a fresh one is 0).
#[derive(Debug, Clone)]
pub struct GemmaRmsNorm {
    weight: Tensor,
    eps: f32,
}

impl GemmaRmsNorm {
    /// The norm's `weight` of width `dim` under `vb` (zeros when fresh: the identity scale).
    pub fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<GemmaRmsNorm> {
        Ok(GemmaRmsNorm {
            weight: vb.get_with_hints(dim, "weight", candle_nn::Init::Const(0.0))?,
            eps: eps as f32,
        })
    }
}

impl Module for GemmaRmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // `1 + w` as a recorded op, so `w` gets its gradient.
        let scale = (&self.weight + 1.0)?.to_dtype(x.dtype())?;
        nn::rms_norm(x, &scale, self.eps)
    }
}

/// Self-attention with grouped key/value heads, rotary positions, Gemma 2's score scale and
/// soft-capping, and a sliding window on the layers that have one.
#[derive(Debug, Clone)]
struct SelfAttention {
    q: Proj,
    k: Proj,
    v: Proj,
    o: Proj,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
    softcap: Option<f32>,
    sliding_window: Option<usize>,
}

impl SelfAttention {
    fn new(cfg: &Gemma2Config, layer: usize, vb: VarBuilder, lora: Option<&Lora>) -> Result<Self> {
        let (h, d, b) = (cfg.hidden_size, cfg.head_dim, cfg.attention_bias);
        let (q, kv) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
        let sliding = cfg.sliding_layers.get(layer).copied().unwrap_or(false);
        Ok(SelfAttention {
            q: Proj::new(h, q, b, vb.pp("q_proj"), lora)?,
            k: Proj::new(h, kv, b, vb.pp("k_proj"), lora)?,
            v: Proj::new(h, kv, b, vb.pp("v_proj"), lora)?,
            o: Proj::new(q, h, b, vb.pp("o_proj"), lora)?,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: d,
            scale: cfg.query_pre_attn_scalar.powf(-0.5) as f32,
            softcap: cfg.attn_logit_softcapping.map(|c| c as f32),
            sliding_window: if sliding { cfg.sliding_window } else { None },
        })
    }

    fn forward(&self, x: &Tensor, ctx: &BlockContext) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let d = self.head_dim;
        let q = self.q.forward(x)?.reshape((b, t, self.heads, d))?;
        let k = self.k.forward(x)?.reshape((b, t, self.kv_heads, d))?;
        let v = self.v.forward(x)?.reshape((b, t, self.kv_heads, d))?;
        let q = nn::rope_thd(&q, &ctx.cos, &ctx.sin)?;
        let k = nn::rope_thd(&k, &ctx.cos, &ctx.sin)?;
        let opts = Attention {
            scale: Some(self.scale),
            causal: true,
            softcap: self.softcap,
            sliding_window: self.sliding_window,
            mask: ctx.attention.mask.clone(),
        };
        let y = nn::attention_bthd(&q, &k, &v, &opts)?;
        let y = y.reshape((b, t, self.heads * d))?;
        self.o.forward(&y)
    }
}

/// The gated MLP: `down(gelu_tanh(gate(x)) · up(x))`.
#[derive(Debug, Clone)]
struct Mlp {
    gate: Proj,
    up: Proj,
    down: Proj,
}

impl Mlp {
    fn new(cfg: &Gemma2Config, vb: VarBuilder, lora: Option<&Lora>) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Mlp {
            gate: Proj::new(h, i, false, vb.pp("gate_proj"), lora)?,
            up: Proj::new(h, i, false, vb.pp("up_proj"), lora)?,
            down: Proj::new(i, h, false, vb.pp("down_proj"), lora)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (gate, up) = (self.gate.forward(x)?, self.up.forward(x)?);
        self.down
            .forward(&nn::gated(&gate, &up, nn::GateAct::GeluTanh)?)
    }
}

/// One Gemma 2 decoder block (`model.layers.N` in a Hugging Face folder).
#[derive(Debug, Clone)]
pub struct Gemma2Block {
    unit: String,
    input_norm: GemmaRmsNorm,
    attention: SelfAttention,
    post_attention_norm: GemmaRmsNorm,
    pre_feedforward_norm: GemmaRmsNorm,
    mlp: Mlp,
    post_feedforward_norm: GemmaRmsNorm,
}

impl Gemma2Block {
    /// Block `layer` under `vb` (`model.layers.N`), its linears adapted by `lora` where
    /// targeted; the layer's index decides whether it attends through the sliding window.
    pub fn new(
        cfg: &Gemma2Config,
        layer: usize,
        vb: VarBuilder,
        lora: Option<&Lora>,
    ) -> Result<Gemma2Block> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let norm = |name: &str| GemmaRmsNorm::new(h, eps, vb.pp(name));
        Ok(Gemma2Block {
            unit: vb.prefix(),
            input_norm: norm("input_layernorm")?,
            attention: SelfAttention::new(cfg, layer, vb.pp("self_attn"), lora)?,
            post_attention_norm: norm("post_attention_layernorm")?,
            pre_feedforward_norm: norm("pre_feedforward_layernorm")?,
            mlp: Mlp::new(cfg, vb.pp("mlp"), lora)?,
            post_feedforward_norm: norm("post_feedforward_layernorm")?,
        })
    }

    /// Whether this block attends through the sliding window (else to the whole prefix).
    pub fn is_sliding(&self) -> bool {
        self.attention.sliding_window.is_some()
    }
}

impl Block for Gemma2Block {
    fn unit(&self) -> Option<&str> {
        Some(&self.unit)
    }

    /// The block applied to hidden states `x` `(b, t, hidden)`. Of `ctx.attention` only the
    /// padding mask is read: the scale, soft-capping and window are the block's own.
    fn forward(&self, x: &Tensor, ctx: &BlockContext) -> Result<Tensor> {
        let a = self.attention.forward(&self.input_norm.forward(x)?, ctx)?;
        let h = (x + self.post_attention_norm.forward(&a)?)?;
        let m = self.mlp.forward(&self.pre_feedforward_norm.forward(&h)?)?;
        &h + self.post_feedforward_norm.forward(&m)?
    }
}
