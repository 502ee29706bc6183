//! One decoder block of the llama family: RMS norm → attention → residual, RMS norm → gated
//! MLP → residual. A block is the unit activation checkpointing and parameter sharding take.

use super::LlamaConfig;
use crate::finetune::Lora;
use crate::models::decoder::{Block, BlockContext};
use crate::models::proj::Proj;
use crate::nn;
use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;

/// An RMS norm with a trained scale, through ivme's differentiable fused op.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    /// The norm's `weight` of width `dim` under `vb`.
    pub fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: vb.get_with_hints(dim, "weight", candle_nn::Init::Const(1.0))?,
            eps: eps as f32,
        })
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        nn::rms_norm(x, &self.weight, self.eps)
    }
}

/// The query, key and value projections: three linears, or one fused (Phi-3).
#[derive(Debug, Clone)]
enum Qkv {
    Split { q: Proj, k: Proj, v: Proj },
    Fused(Proj),
}

/// Self-attention with grouped key/value heads and rotary positions.
#[derive(Debug, Clone)]
struct SelfAttention {
    qkv: Qkv,
    o: Proj,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl SelfAttention {
    fn new(cfg: &LlamaConfig, vb: VarBuilder, lora: Option<&Lora>) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (q, kv) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
        let b = cfg.qkv_bias;
        let qkv = if cfg.fused {
            Qkv::Fused(Proj::new(h, q + 2 * kv, b, vb.pp("qkv_proj"), lora)?)
        } else {
            Qkv::Split {
                q: Proj::new(h, q, b, vb.pp("q_proj"), lora)?,
                k: Proj::new(h, kv, b, vb.pp("k_proj"), lora)?,
                v: Proj::new(h, kv, b, vb.pp("v_proj"), lora)?,
            }
        };
        Ok(SelfAttention {
            qkv,
            o: Proj::new(q, h, cfg.o_bias, vb.pp("o_proj"), lora)?,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: d,
        })
    }

    fn forward(&self, x: &Tensor, ctx: &BlockContext) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let d = self.head_dim;
        // Rotate in (b, t, heads, d), where the projections' output already lies.
        let (q, k, v) = match &self.qkv {
            Qkv::Split { q, k, v } => (q.forward(x)?, k.forward(x)?, v.forward(x)?),
            Qkv::Fused(qkv) => {
                let y = qkv.forward(x)?;
                let (q, kv) = (self.heads * d, self.kv_heads * d);
                (
                    y.narrow(2, 0, q)?,
                    y.narrow(2, q, kv)?,
                    y.narrow(2, q + kv, kv)?,
                )
            }
        };
        let q = q.reshape((b, t, self.heads, d))?;
        let k = k.reshape((b, t, self.kv_heads, d))?;
        let v = v.reshape((b, t, self.kv_heads, d))?;
        let q = nn::rope_thd(&q, &ctx.cos, &ctx.sin)?;
        let k = nn::rope_thd(&k, &ctx.cos, &ctx.sin)?;
        let y = nn::attention_bthd(&q, &k, &v, &ctx.attention)?;
        let y = y.reshape((b, t, self.heads * d))?;
        self.o.forward(&y)
    }
}

/// The gate and up projections: two linears, or one fused (Phi-3).
#[derive(Debug, Clone)]
enum GateUp {
    Split { gate: Proj, up: Proj },
    Fused(Proj),
}

/// The gated MLP: `down(silu(gate(x)) · up(x))`.
#[derive(Debug, Clone)]
struct Mlp {
    gate_up: GateUp,
    down: Proj,
}

impl Mlp {
    fn new(cfg: &LlamaConfig, vb: VarBuilder, lora: Option<&Lora>) -> Result<Self> {
        let (h, i, b) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        let gate_up = if cfg.fused {
            GateUp::Fused(Proj::new(h, 2 * i, b, vb.pp("gate_up_proj"), lora)?)
        } else {
            GateUp::Split {
                gate: Proj::new(h, i, b, vb.pp("gate_proj"), lora)?,
                up: Proj::new(h, i, b, vb.pp("up_proj"), lora)?,
            }
        };
        Ok(Mlp {
            gate_up,
            down: Proj::new(i, h, b, vb.pp("down_proj"), lora)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (gate, up) = match &self.gate_up {
            GateUp::Split { gate, up } => (gate.forward(x)?, up.forward(x)?),
            GateUp::Fused(gate_up) => {
                let y = gate_up.forward(x)?;
                let i = y.dim(2)? / 2;
                (y.narrow(2, 0, i)?, y.narrow(2, i, i)?)
            }
        };
        self.down
            .forward(&nn::gated(&gate, &up, nn::GateAct::Silu)?)
    }
}

/// One decoder block (`model.layers.N` in a Hugging Face folder).
#[derive(Debug, Clone)]
pub struct DecoderBlock {
    unit: String,
    input_norm: RmsNorm,
    attention: SelfAttention,
    post_attention_norm: RmsNorm,
    mlp: Mlp,
}

impl DecoderBlock {
    /// The block under `vb` (`model.layers.N`), its linears adapted by `lora` where targeted.
    pub fn new(cfg: &LlamaConfig, vb: VarBuilder, lora: Option<&Lora>) -> Result<DecoderBlock> {
        let eps = cfg.rms_norm_eps;
        Ok(DecoderBlock {
            unit: vb.prefix(),
            input_norm: RmsNorm::new(cfg.hidden_size, eps, vb.pp("input_layernorm"))?,
            attention: SelfAttention::new(cfg, vb.pp("self_attn"), lora)?,
            post_attention_norm: RmsNorm::new(
                cfg.hidden_size,
                eps,
                vb.pp("post_attention_layernorm"),
            )?,
            mlp: Mlp::new(cfg, vb.pp("mlp"), lora)?,
        })
    }
}

impl Block for DecoderBlock {
    fn unit(&self) -> Option<&str> {
        Some(&self.unit)
    }

    fn forward(&self, x: &Tensor, ctx: &BlockContext) -> Result<Tensor> {
        let h = (x + self.attention.forward(&self.input_norm.forward(x)?, ctx)?)?;
        &h + self.mlp.forward(&self.post_attention_norm.forward(&h)?)?
    }
}
