//! Gemma 2's settings, read from a Hugging Face `config.json` as transformers 5 writes it
//! (`rope_parameters`) or as transformers 4 did (`rope_theta`), and checked once, with the fix
//! named for what is refused.

use crate::error::{Error, Result};
use serde::{Deserialize, Deserializer};
use std::path::Path;

/// A Gemma 2 model's shape and settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma2Config {
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
    /// The longest sequence the rotary tables are made for.
    pub max_position_embeddings: usize,
    /// The output head reuses the token embedding.
    pub tie_word_embeddings: bool,
    /// Biases on the query, key, value and output projections.
    pub attention_bias: bool,
    /// The attention scores are scaled by `query_pre_attn_scalar^-0.5` (not `head_dim^-0.5`).
    pub query_pre_attn_scalar: f64,
    /// `cap * tanh(scores / cap)` on the attention scores, if set.
    pub attn_logit_softcapping: Option<f64>,
    /// `cap * tanh(logits / cap)` on the output logits, if set.
    pub final_logit_softcapping: Option<f64>,
    /// The window of the sliding layers: each query attends to at most this many keys, itself
    /// included.
    pub sliding_window: Option<usize>,
    /// For each layer, whether it attends through the sliding window (`layer_types`'
    /// `sliding_attention`) rather than to the whole prefix.
    pub sliding_layers: Vec<bool>,
}

/// `serde`'s `Option` reads both an absent field and `null` as `None`; this keeps them apart
/// (absent: `None`, `null`: `Some(None)`), for fields whose absence means a default.
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> std::result::Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// `config.json` as transformers writes it for Gemma 2; fields ivme reads, others ignored.
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
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    attention_dropout: Option<f64>,
    hidden_activation: Option<String>,
    hidden_act: Option<String>,
    query_pre_attn_scalar: Option<f64>,
    #[serde(default, deserialize_with = "present")]
    attn_logit_softcapping: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    final_logit_softcapping: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    sliding_window: Option<Option<usize>>,
    layer_types: Option<Vec<String>>,
    use_bidirectional_attention: Option<bool>,
}

impl Gemma2Config {
    /// Reads `folder/config.json` (or a `config.json` path) and checks it.
    pub fn from_folder(folder: impl AsRef<Path>) -> Result<Gemma2Config> {
        crate::models::config_file::read(folder.as_ref(), Self::from_json)
    }

    /// Parses a `config.json`'s text and checks it.
    pub fn from_json(text: &str) -> Result<Gemma2Config> {
        let raw: Raw = serde_json::from_str(text)
            .map_err(|e| Error::Usage(format!("not a Gemma 2 config.json: {e}")))?;
        let refuse = |m: String| Err(Error::Usage(m));
        if let Some(t) = raw.model_type.as_deref().filter(|t| *t != "gemma2") {
            return refuse(format!(
                "model_type `{t}` is not Gemma 2 (`gemma2`): read it with its own family's \
                 config"
            ));
        }
        if let Some(p) = raw.attention_dropout.filter(|p| *p != 0.0) {
            return refuse(format!(
                "attention_dropout = {p} is not supported by Gemma 2 here (it applies no \
                 dropout): set it to 0"
            ));
        }
        let act = raw
            .hidden_activation
            .as_deref()
            .or(raw.hidden_act.as_deref())
            .unwrap_or("gelu_pytorch_tanh");
        if !matches!(act, "gelu_pytorch_tanh" | "gelu_tanh") {
            let key = if raw.hidden_activation.is_some() {
                "hidden_activation"
            } else {
                "hidden_act"
            };
            return refuse(format!(
                "{key} `{act}` is not supported by Gemma 2 here: it takes the tanh GELU \
                 (`gelu_pytorch_tanh`)"
            ));
        }
        for (key, v) in [
            ("rope_parameters", raw.rope_parameters.as_ref()),
            ("rope_scaling", raw.rope_scaling.as_ref()),
        ] {
            let Some(v) = v.filter(|v| !v.is_null()) else {
                continue;
            };
            let kind = v
                .get("rope_type")
                .or_else(|| v.get("type"))
                .and_then(|k| k.as_str())
                .unwrap_or("default");
            if kind != "default" {
                return refuse(format!(
                    "{key} of type `{kind}` is not supported by Gemma 2 here: it takes \
                     `default` rotary embeddings (no scaling)"
                ));
            }
            let partial = v.get("partial_rotary_factor").and_then(|f| f.as_f64());
            if let Some(f) = partial.filter(|f| *f != 1.0) {
                return refuse(format!(
                    "{key}.partial_rotary_factor = {f} is not supported: Gemma 2 here rotates \
                     whole heads (1.0)"
                ));
            }
        }
        if raw.use_bidirectional_attention == Some(true) {
            return refuse(
                "use_bidirectional_attention = true is not supported: Gemma 2 here is a causal \
                 language model (set it to false or null)"
                    .into(),
            );
        }
        let heads = raw.num_attention_heads;
        if heads == 0 || raw.hidden_size == 0 || raw.num_hidden_layers == 0 {
            return refuse(
                "hidden_size, num_attention_heads and num_hidden_layers must be at least 1".into(),
            );
        }
        let kv = raw.num_key_value_heads.unwrap_or(heads);
        if kv == 0 || heads % kv != 0 {
            return refuse(format!(
                "num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})"
            ));
        }
        let head_dim = raw.head_dim.unwrap_or(256);
        if head_dim == 0 || head_dim % 2 != 0 {
            return refuse(format!(
                "head_dim ({head_dim}) must be even (and at least 2) for rotary embeddings"
            ));
        }
        let n = raw.num_hidden_layers;
        // transformers' default: even layers slide, odd layers attend to the whole prefix.
        let sliding_layers = match &raw.layer_types {
            None => (0..n).map(|i| i % 2 == 0).collect(),
            Some(types) if types.len() != n => {
                return refuse(format!(
                    "layer_types names {} layers but num_hidden_layers is {n}",
                    types.len()
                ))
            }
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    "sliding_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => Err(Error::Usage(format!(
                        "layer_types holds `{other}`: Gemma 2 here takes `sliding_attention` \
                         and `full_attention`"
                    ))),
                })
                .collect::<Result<Vec<_>>>()?,
        };
        let sliding_window = raw.sliding_window.unwrap_or(Some(4096));
        if sliding_window == Some(0) {
            return refuse("sliding_window must be at least 1".into());
        }
        if sliding_window.is_none() && sliding_layers.contains(&true) {
            return refuse(
                "layer_types marks sliding_attention layers but sliding_window is null: give \
                 sliding_window"
                    .into(),
            );
        }
        let cap = |key: &str, v: Option<Option<f64>>, default: f64| match v {
            None => Ok(Some(default)),
            Some(None) => Ok(None),
            Some(Some(c)) if c > 0.0 && c.is_finite() => Ok(Some(c)),
            Some(Some(c)) => Err(Error::Usage(format!(
                "{key} = {c} must be a positive number (or null for no capping)"
            ))),
        };
        let query_pre_attn_scalar = raw.query_pre_attn_scalar.unwrap_or(256.0);
        if query_pre_attn_scalar <= 0.0 || !query_pre_attn_scalar.is_finite() {
            return refuse(format!(
                "query_pre_attn_scalar = {query_pre_attn_scalar} must be a positive number"
            ));
        }
        Ok(Gemma2Config {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: n,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: raw
                .rope_theta
                .or_else(|| raw.rope_parameters.as_ref()?.get("rope_theta")?.as_f64())
                .unwrap_or(10_000.0),
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(8192),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(true),
            attention_bias: raw.attention_bias.unwrap_or(false),
            query_pre_attn_scalar,
            attn_logit_softcapping: cap(
                "attn_logit_softcapping",
                raw.attn_logit_softcapping,
                50.0,
            )?,
            final_logit_softcapping: cap(
                "final_logit_softcapping",
                raw.final_logit_softcapping,
                30.0,
            )?,
            sliding_window,
            sliding_layers,
        })
    }

    /// The number of parameters a model of this config holds.
    pub fn num_parameters(&self) -> usize {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let (q, kv) = (
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        );
        let bias = if self.attention_bias {
            q + 2 * kv + h
        } else {
            0
        };
        let layer = 2 * h * q + 2 * h * kv + bias + 3 * h * i + 4 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers * layer + h + head
    }
}
