//! The llama family's settings, read from a Hugging Face `config.json` (Llama 2/3, Mistral and
//! Qwen2 write theirs in one shape) and checked once, with the fix named for what is refused.

use crate::error::{Error, Result};
pub use crate::models::rotary::Llama3Scaling;
use serde::Deserialize;
use std::path::Path;

/// Which architecture of the family a config describes (`model_type` in `config.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// Llama 2 and 3 (`"llama"`): optional biases on every attention projection.
    Llama,
    /// Mistral (`"mistral"`): an optional sliding attention window.
    Mistral,
    /// Qwen2 (`"qwen2"`): biases on the query, key and value projections.
    Qwen2,
    /// Phi-3 (`"phi3"`): the query, key and value projections fused into one `qkv_proj`, the
    /// MLP's gate and up into one `gate_up_proj`.
    Phi3,
}

/// A llama-family model's shape and settings.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// The architecture.
    pub flavor: Flavor,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// The width of the residual stream.
    pub hidden_size: usize,
    /// The width of the MLP's hidden layer.
    pub intermediate_size: usize,
    /// Decoder blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than the query heads).
    pub num_key_value_heads: usize,
    /// Each head's width.
    pub head_dim: usize,
    /// The RMS norms' epsilon.
    pub rms_norm_eps: f64,
    /// The rotary embedding's base.
    pub rope_theta: f64,
    /// Llama 3's frequency scaling, if any.
    pub rope_scaling: Option<Llama3Scaling>,
    /// The longest sequence the rotary tables are made for.
    pub max_position_embeddings: usize,
    /// The output head reuses the token embedding.
    pub tie_word_embeddings: bool,
    /// Biases on the query, key and value projections.
    pub qkv_bias: bool,
    /// A bias on the attention's output projection.
    pub o_bias: bool,
    /// Biases on the MLP's three projections.
    pub mlp_bias: bool,
    /// Each query attends to at most this many keys, itself included (Mistral, Phi-3).
    pub sliding_window: Option<usize>,
    /// The projections are fused as Phi-3 stores them: `qkv_proj` (rows q, then k, then v)
    /// and `gate_up_proj` (rows gate, then up).
    pub fused: bool,
}

/// `config.json` as transformers writes it for the family; fields ivme reads, others ignored.
#[derive(Debug, Deserialize)]
struct Raw {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    /// transformers 5 writes the base and the scaling here instead.
    rope_parameters: Option<serde_json::Value>,
    layer_types: Option<Vec<String>>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    pretraining_tp: Option<usize>,
    attention_dropout: Option<f64>,
    resid_pdrop: Option<f64>,
    embd_pdrop: Option<f64>,
}

impl LlamaConfig {
    /// Reads `folder/config.json` (or a `config.json` path) and checks it.
    pub fn from_folder(folder: impl AsRef<Path>) -> Result<LlamaConfig> {
        crate::models::config_file::read(folder.as_ref(), Self::from_json)
    }

    /// Parses a `config.json`'s text and checks it.
    pub fn from_json(text: &str) -> Result<LlamaConfig> {
        let raw: Raw = serde_json::from_str(text)
            .map_err(|e| Error::Usage(format!("not a llama-family config.json: {e}")))?;
        let flavor = match raw.model_type.as_deref() {
            None | Some("llama") => Flavor::Llama,
            Some("mistral") => Flavor::Mistral,
            Some("qwen2") => Flavor::Qwen2,
            Some("phi3") => Flavor::Phi3,
            Some(other) => {
                return Err(Error::Usage(format!(
                    "model_type `{other}` is not of the llama family (llama, mistral, qwen2, phi3)"
                )))
            }
        };
        for (key, p) in [
            ("attention_dropout", raw.attention_dropout),
            ("resid_pdrop", raw.resid_pdrop),
            ("embd_pdrop", raw.embd_pdrop),
        ] {
            if p.is_some_and(|p| p != 0.0) {
                return Err(Error::Usage(format!(
                    "{key} = {} is not supported by the llama family (it applies no dropout): \
                     set it to 0",
                    p.unwrap_or_default()
                )));
            }
        }
        let partial = raw
            .rope_parameters
            .as_ref()
            .and_then(|r| r.get("partial_rotary_factor"))
            .and_then(|v| v.as_f64());
        if partial.is_some_and(|f| f != 1.0) {
            return Err(Error::Usage(format!(
                "partial_rotary_factor = {} is not supported yet: the llama family rotates whole \
                 heads (1.0)",
                partial.unwrap_or_default()
            )));
        }
        if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(Error::Usage(format!(
                "hidden_act `{act}` is not supported by the llama family: it takes `silu`"
            )));
        }
        if raw.pretraining_tp.is_some_and(|tp| tp > 1) {
            // transformers computes the same function either way; only the split differs.
            tracing::debug!("pretraining_tp ignored: it splits the same matmuls");
        }
        let sliding_layers = raw
            .layer_types
            .iter()
            .flatten()
            .filter(|t| t.as_str() == "sliding_attention")
            .count();
        if sliding_layers > 0 && sliding_layers != raw.num_hidden_layers {
            return Err(Error::Usage(format!(
                "layer_types gives {sliding_layers} of {} layers a sliding window: a window on \
                 some layers only is not supported yet",
                raw.num_hidden_layers
            )));
        }
        if flavor == Flavor::Qwen2 && (raw.use_sliding_window == Some(true) || sliding_layers > 0) {
            return Err(Error::Usage(
                "use_sliding_window = true (Qwen2's per-layer window) is not supported yet: \
                 set it to false to train with full attention"
                    .into(),
            ));
        }
        let heads = raw.num_attention_heads;
        if heads == 0 || raw.hidden_size == 0 || raw.num_hidden_layers == 0 {
            return Err(Error::Usage(
                "hidden_size, num_attention_heads and num_hidden_layers must be at least 1".into(),
            ));
        }
        let kv = raw.num_key_value_heads.unwrap_or(heads);
        if kv == 0 || heads % kv != 0 {
            return Err(Error::Usage(format!(
                "num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})"
            )));
        }
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if raw.hidden_size % heads == 0 => raw.hidden_size / heads,
            None => {
                return Err(Error::Usage(format!(
                    "hidden_size ({}) is not a multiple of num_attention_heads ({heads}): \
                     give head_dim",
                    raw.hidden_size
                )))
            }
        };
        if head_dim % 2 != 0 {
            return Err(Error::Usage(format!(
                "head_dim ({head_dim}) must be even for rotary embeddings"
            )));
        }
        let sliding_window = match flavor {
            Flavor::Mistral | Flavor::Phi3 => raw.sliding_window,
            Flavor::Llama | Flavor::Qwen2 => None,
        };
        if sliding_window == Some(0) {
            return Err(Error::Usage("sliding_window must be at least 1".into()));
        }
        let bias = raw.attention_bias.unwrap_or(false);
        Ok(LlamaConfig {
            flavor,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: raw
                .rope_theta
                .or_else(|| raw.rope_parameters.as_ref()?.get("rope_theta")?.as_f64())
                .unwrap_or(10_000.0),
            rope_scaling: scaling(raw.rope_scaling.as_ref().or(raw.rope_parameters.as_ref()))?,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            fused: flavor == Flavor::Phi3,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: flavor == Flavor::Qwen2 || bias,
            o_bias: flavor == Flavor::Llama && bias,
            mlp_bias: flavor == Flavor::Llama && raw.mlp_bias.unwrap_or(false),
            sliding_window,
        })
    }

    /// The number of parameters a model of this config holds.
    pub fn num_parameters(&self) -> usize {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let (q, kv) = (
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        );
        let attn = h * q
            + 2 * h * kv
            + q * h
            + if self.qkv_bias { q + 2 * kv } else { 0 }
            + if self.o_bias { h } else { 0 };
        let mlp = 3 * h * i + if self.mlp_bias { 2 * i + h } else { 0 };
        let layer = attn + mlp + 2 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers * layer + h + head
    }
}

/// `rope_scaling` (or transformers 5's `rope_parameters`): none, `default`, or `llama3`; any
/// other kind is refused by name.
fn scaling(raw: Option<&serde_json::Value>) -> Result<Option<Llama3Scaling>> {
    let Some(v) = raw.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|k| k.as_str())
        .unwrap_or("default");
    match kind {
        "default" => Ok(None),
        "llama3" => {
            let num = |k: &str| {
                v.get(k).and_then(|x| x.as_f64()).ok_or_else(|| {
                    Error::Usage(format!("rope_scaling of type llama3 needs a number `{k}`"))
                })
            };
            let s = Llama3Scaling {
                factor: num("factor")? as f32,
                low_freq_factor: num("low_freq_factor")? as f32,
                high_freq_factor: num("high_freq_factor")? as f32,
                original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
            };
            if s.factor <= 0.0 || s.high_freq_factor <= s.low_freq_factor {
                return Err(Error::Usage(format!(
                    "rope_scaling llama3 needs factor > 0 and high_freq_factor > \
                     low_freq_factor, not {s:?}"
                )));
            }
            Ok(Some(s))
        }
        other => Err(Error::Usage(format!(
            "rope_scaling of type `{other}` is not supported by the llama family \
             (it takes `default` and `llama3`)"
        ))),
    }
}
