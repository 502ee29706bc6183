//! Small random-init models from candle-transformers 0.11.1, each behind one training task, for
//! the model matrix (`models/examples/model_matrix.rs`, `models/tests/model_matrix.rs`).
//!
//! The models' own code is used unchanged. What a user writes around them is here: the config,
//! the data, the head on top and the loss. Every model is built from a `VarBuilder` and takes
//! the dtype it computes in from it (`vb.dtype()`), which is what lets the same code run in
//! f32, bf16 and fp16.
//!
//! Include it with `#[path = "support/models.rs"] mod models;` (and `support/init.rs`).

use candle_core::{DType, Device, IndexOp, Module, Tensor, D};
use candle_nn::{linear, Linear, VarBuilder};
use candle_transformers::models::xlm_roberta;
use candle_transformers::models::{bert, llama, llama2_c, mistral, phi3, qwen2, t5, vit};
use ivme::rng::Rng;

/// Tokens in the language tasks' vocabulary.
pub const VOCAB: usize = 32;
/// Tokens per sequence in the language tasks.
pub const SEQ: usize = 8;
/// Samples per micro-batch.
pub const BATCH: usize = 4;
/// Side of the vision task's images.
pub const IMAGE: usize = 8;
/// Classes of the classification tasks.
pub const CLASSES: usize = 4;

/// The model families of the matrix, by the name the example takes on its command line.
pub const FAMILIES: [&str; 15] = [
    "llama",
    "qwen2",
    "xlmr",
    "bert",
    "vit",
    "t5",
    "llama2c",
    "mistral",
    "phi3",
    "ivme_llama",
    "ivme_mistral",
    "ivme_qwen2",
    "ivme_phi3",
    "ivme_gemma2",
    "ivme_bert",
];

/// The families built on ivme's trainable models (`ivme::models`): every variable trains.
#[allow(dead_code)] // read by the tests that include this file
pub const IVME_FAMILIES: [&str; 6] = [
    "ivme_llama",
    "ivme_mistral",
    "ivme_qwen2",
    "ivme_phi3",
    "ivme_gemma2",
    "ivme_bert",
];

/// A model and the loss of one batch of its task.
pub trait Task {
    /// The mean loss over the batch, in f32.
    fn loss(&mut self, inputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor>;
}

/// The mean cross-entropy of `logits` (any float dtype) against class indices.
fn cross_entropy(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::loss::cross_entropy(&logits.to_dtype(DType::F32)?, targets)
}

/// Meta's llama (`llama.rs`): its forward returns the logits of the last position, so the task
/// is to predict the token after the sequence.
struct Llama {
    model: llama::Llama,
    cache: llama::Cache,
}

impl Task for Llama {
    fn loss(&mut self, inputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        cross_entropy(&self.model.forward(inputs, 0, &mut self.cache)?, targets)
    }
}

/// Qwen2's decoder (`qwen2::Model`, all positions' hidden states) under a language-model head of
/// our own: every position predicts the next token.
struct Qwen2 {
    model: qwen2::Model,
    head: Linear,
}

impl Task for Qwen2 {
    fn loss(&mut self, inputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        // No cache across steps: each forward is a fresh sequence.
        self.model.clear_kv_cache();
        let hidden = self.model.forward(inputs, 0, None)?;
        let logits = self.head.forward(&hidden)?.flatten_to(1)?;
        cross_entropy(&logits, &targets.flatten_all()?)
    }
}

/// ivme's own families (`ivme::models`): logits at every position, each against its target,
/// through norms, rotary embeddings and attention that all have a backward pass.
struct IvmeModel<F: Fn(&Tensor) -> candle_core::Result<Tensor>> {
    logits: F,
}

impl<F: Fn(&Tensor) -> candle_core::Result<Tensor>> Task for IvmeModel<F> {
    fn loss(&mut self, inputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        let logits = (self.logits)(inputs)?;
        let (b, t, v) = logits.dims3()?;
        ivme::models::token_loss(
            &logits.reshape((b * t, v))?,
            &targets.flatten_all()?,
            ivme::models::IGNORE_INDEX,
        )
    }
}

/// A BERT encoder with a classifier on the first token's state.
struct Bert {
    model: bert::BertModel,
    head: Linear,
}

impl Task for Bert {
    fn loss(&mut self, inputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        let types = inputs.zeros_like()?;
        let hidden = self.model.forward(inputs, &types, None)?;
        cross_entropy(&self.head.forward(&hidden.i((.., 0))?)?, targets)
    }
}

/// An XLM-RoBERTa encoder with a classifier on the first token's state.
struct Xlmr {
    model: xlm_roberta::XLMRobertaModel,
    head: Linear,
}

impl Task for Xlmr {
    fn loss(&mut self, inputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        let attend = inputs.ones_like()?;
        let types = inputs.zeros_like()?;
        let hidden = self
            .model
            .forward(inputs, &attend, &types, None, None, None)?;
        cross_entropy(&self.head.forward(&hidden.i((.., 0))?)?, targets)
    }
}

/// A vision transformer classifying small images.
struct Vit {
    model: vit::Model,
    dtype: DType,
}

impl Task for Vit {
    fn loss(&mut self, inputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        // Images arrive in f32; the model computes in its weights' dtype.
        cross_entropy(&self.model.forward(&inputs.to_dtype(self.dtype)?)?, targets)
    }
}

/// T5, encoder and decoder: the decoder reads a start token plus the sequence's first half
/// and predicts the token after it (its forward returns the last position's logits).
struct T5 {
    model: t5::T5ForConditionalGeneration,
}

impl Task for T5 {
    fn loss(&mut self, inputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        self.model.clear_kv_cache();
        let start = Tensor::zeros((inputs.dim(0)?, 1), DType::U32, inputs.device())?;
        let decoder = Tensor::cat(&[&start, &inputs.narrow(1, 0, SEQ / 2)?], 1)?;
        cross_entropy(&self.model.forward(inputs, &decoder)?, targets)
    }
}

/// Karpathy's llama2.c model (`llama2_c.rs`), all positions' logits.
struct Llama2c {
    model: llama2_c::Llama,
    cache: llama2_c::Cache,
}

impl Task for Llama2c {
    fn loss(&mut self, inputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        let logits = self
            .model
            .forward(inputs, 0, &mut self.cache)?
            .flatten_to(1)?;
        cross_entropy(&logits, &targets.flatten_all()?)
    }
}

/// Mistral (`mistral.rs`, sliding-window attention), the last position's logits. Its forward
/// appends every call's keys and values to a cache inside the model: a training step must clear
/// it first, or the next batch would attend to the previous batch's keys (and the cache would
/// grow without end).
struct Mistral {
    model: mistral::Model,
}

impl Task for Mistral {
    fn loss(&mut self, inputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        self.model.clear_kv_cache();
        cross_entropy(&self.model.forward(inputs, 0)?.squeeze(1)?, targets)
    }
}

/// Microsoft's Phi-3 (`phi3.rs`, fused qkv and gate-up projections), the last position's
/// logits; its cache is cleared every step, as Mistral's.
struct Phi3 {
    model: phi3::Model,
}

impl Task for Phi3 {
    fn loss(&mut self, inputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        self.model.clear_kv_cache();
        cross_entropy(&self.model.forward(inputs, 0)?.squeeze(1)?, targets)
    }
}

fn json<T: serde::de::DeserializeOwned>(text: &str) -> candle_core::Result<T> {
    serde_json::from_str(text).map_err(candle_core::Error::wrap)
}

/// Builds `family`'s model from `vb`, tiny but with every part of the real architecture.
pub fn build(family: &str, vb: VarBuilder) -> candle_core::Result<Box<dyn Task>> {
    let dtype = vb.dtype();
    let device = vb.device().clone();
    Ok(match family {
        "llama" => {
            let cfg: llama::LlamaConfig = json(&format!(
                r#"{{"hidden_size": 32, "intermediate_size": 64, "vocab_size": {VOCAB},
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64,
                    "tie_word_embeddings": false}}"#
            ))?;
            let cfg = cfg.into_config(false);
            Box::new(Llama {
                cache: llama::Cache::new(false, dtype, &cfg, &device)?,
                model: llama::Llama::load(vb, &cfg)?,
            })
        }
        "qwen2" => {
            let cfg: qwen2::Config = json(&format!(
                r#"{{"vocab_size": {VOCAB}, "hidden_size": 32, "intermediate_size": 64,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "max_position_embeddings": 64, "sliding_window": 64, "max_window_layers": 2,
                    "tie_word_embeddings": false, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                    "use_sliding_window": false, "hidden_act": "silu"}}"#
            ))?;
            Box::new(Qwen2 {
                head: linear(32, VOCAB, vb.pp("lm_head"))?,
                model: qwen2::Model::new(&cfg, vb.pp("model"))?,
            })
        }
        "bert" => {
            let cfg = bert::Config {
                vocab_size: VOCAB,
                hidden_size: 32,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                intermediate_size: 64,
                max_position_embeddings: 64,
                ..Default::default()
            };
            Box::new(Bert {
                head: linear(32, CLASSES, vb.pp("classifier"))?,
                model: bert::BertModel::load(vb.pp("bert"), &cfg)?,
            })
        }
        "xlmr" => {
            let cfg = xlm_roberta::Config {
                hidden_size: 32,
                layer_norm_eps: 1e-5,
                attention_probs_dropout_prob: 0.0,
                hidden_dropout_prob: 0.0,
                num_attention_heads: 4,
                position_embedding_type: "absolute".into(),
                intermediate_size: 64,
                hidden_act: candle_nn::Activation::Gelu,
                num_hidden_layers: 2,
                vocab_size: VOCAB,
                max_position_embeddings: 64,
                type_vocab_size: 1,
                pad_token_id: 1,
            };
            Box::new(Xlmr {
                head: linear(32, CLASSES, vb.pp("classifier"))?,
                model: xlm_roberta::XLMRobertaModel::new(&cfg, vb.pp("roberta"))?,
            })
        }
        "vit" => {
            let cfg = vit::Config {
                hidden_size: 32,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                intermediate_size: 64,
                hidden_act: candle_nn::Activation::Gelu,
                layer_norm_eps: 1e-12,
                image_size: IMAGE,
                patch_size: 4,
                num_channels: 3,
                qkv_bias: true,
            };
            Box::new(Vit {
                model: vit::Model::new(&cfg, CLASSES, vb)?,
                dtype,
            })
        }
        "t5" => {
            let cfg: t5::Config = json(&format!(
                r#"{{"vocab_size": {VOCAB}, "d_model": 32, "d_kv": 8, "d_ff": 64,
                    "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4,
                    "relative_attention_num_buckets": 8, "dropout_rate": 0.0,
                    "layer_norm_epsilon": 1e-6, "initializer_factor": 1.0,
                    "feed_forward_proj": "gated-gelu", "tie_word_embeddings": false,
                    "is_encoder_decoder": true, "use_cache": false, "pad_token_id": 0,
                    "eos_token_id": 1, "decoder_start_token_id": 0}}"#
            ))?;
            Box::new(T5 {
                model: t5::T5ForConditionalGeneration::load(vb, &cfg)?,
            })
        }
        "llama2c" => {
            let cfg = llama2_c::Config {
                dim: 32,
                hidden_dim: 64,
                n_layers: 2,
                n_heads: 4,
                n_kv_heads: 2,
                vocab_size: VOCAB,
                seq_len: SEQ,
                norm_eps: 1e-5,
            };
            Box::new(Llama2c {
                // The cache looks its rotary tables up in the builder it is given and computes
                // them when they are missing; a VarMap would create them as random variables.
                cache: llama2_c::Cache::new(
                    false,
                    &cfg,
                    VarBuilder::from_tensors(Default::default(), dtype, &device),
                )?,
                model: llama2_c::Llama::load(vb, cfg)?,
            })
        }
        "mistral" => {
            // A window shorter than the sequence, so the sliding-window mask is exercised.
            let cfg: mistral::Config = json(&format!(
                r#"{{"vocab_size": {VOCAB}, "hidden_size": 32, "intermediate_size": 64,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": null, "hidden_act": "silu", "max_position_embeddings": 64,
                    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 4,
                    "use_flash_attn": false}}"#
            ))?;
            Box::new(Mistral {
                model: mistral::Model::new(&cfg, vb)?,
            })
        }
        "phi3" => {
            let cfg: phi3::Config = json(&format!(
                r#"{{"vocab_size": {VOCAB}, "hidden_act": "silu", "hidden_size": 32,
                    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                    "bos_token_id": null, "eos_token_id": null, "rope_scaling": null,
                    "max_position_embeddings": 64, "original_max_position_embeddings": null,
                    "partial_rotary_factor": null, "tie_word_embeddings": false}}"#
            ))?;
            Box::new(Phi3 {
                model: phi3::Model::new(&cfg, vb)?,
            })
        }
        "ivme_llama" | "ivme_mistral" | "ivme_qwen2" | "ivme_phi3" => {
            // The same shape as the candle-transformers families above, in transformers'
            // config.json form: Mistral with a window shorter than the sequence, Qwen2 with
            // its query/key/value biases and a tied head, Phi-3 with fused projections.
            let model_type = family.trim_start_matches("ivme_");
            let cfg = ivme::models::llama::LlamaConfig::from_json(&format!(
                r#"{{"model_type": "{model_type}", "hidden_size": 32, "intermediate_size": 64,
                    "vocab_size": {VOCAB}, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                    "max_position_embeddings": 64, "sliding_window": 4,
                    "tie_word_embeddings": {}}}"#,
                model_type == "qwen2"
            ))
            .map_err(candle_core::Error::wrap)?;
            let model = ivme::models::llama::Llama::new(&cfg, vb)?;
            Box::new(IvmeModel {
                logits: move |x: &Tensor| model.forward(x),
            })
        }
        "ivme_gemma2" => {
            // Soft-capped attention and logits, one sliding and one full layer.
            let cfg = ivme::models::gemma2::Gemma2Config::from_json(&format!(
                r#"{{"model_type": "gemma2", "hidden_size": 32, "intermediate_size": 64,
                    "vocab_size": {VOCAB}, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
                    "rope_theta": 10000.0, "max_position_embeddings": 64, "sliding_window": 4,
                    "query_pre_attn_scalar": 8, "attn_logit_softcapping": 50.0,
                    "final_logit_softcapping": 30.0}}"#
            ))
            .map_err(candle_core::Error::wrap)?;
            let model = ivme::models::gemma2::Gemma2::new(&cfg, vb)?;
            Box::new(IvmeModel {
                logits: move |x: &Tensor| model.forward(x),
            })
        }
        "ivme_bert" => {
            // The encoder and its masked-LM head; every position predicts its target.
            let cfg = ivme::models::bert::BertConfig::from_json(&format!(
                r#"{{"model_type": "bert", "hidden_size": 32, "intermediate_size": 64,
                    "vocab_size": {VOCAB}, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "max_position_embeddings": 64, "type_vocab_size": 2,
                    "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}}"#
            ))
            .map_err(candle_core::Error::wrap)?;
            let model = ivme::models::bert::Bert::new(&cfg, vb)?;
            Box::new(IvmeModel {
                logits: move |x: &Tensor| model.forward(x, None, None),
            })
        }
        other => candle_core::bail!("unknown model family `{other}`; one of {FAMILIES:?}"),
    })
}

/// `count` micro-batches of `family`'s task, the same on every process: token sequences whose
/// targets are a function of the tokens (so the loss can fall), or images with a class.
pub fn batches(
    family: &str,
    count: usize,
    seed: u64,
) -> candle_core::Result<Vec<(Tensor, Tensor)>> {
    let mut rng = Rng::new(seed);
    let dev = Device::Cpu;
    let tokens = |rng: &mut Rng| -> Vec<u32> {
        (0..BATCH * SEQ)
            .map(|_| (rng.next_u64() % VOCAB as u64) as u32)
            .collect()
    };
    (0..count)
        .map(|_| {
            let ids = tokens(&mut rng);
            let next = |i: usize| (ids[i] + 1) % VOCAB as u32;
            Ok(match family {
                "vit" => {
                    let x = rng.randn(0.0, 1.0, (BATCH, 3, IMAGE, IMAGE), &dev)?;
                    // The class is the brightest of the three channels.
                    let y = x.mean((2, 3))?.argmax(D::Minus1)?;
                    (x, y)
                }
                // Every position's target is its token plus one.
                "qwen2" | "llama2c" | "ivme_llama" | "ivme_mistral" | "ivme_qwen2"
                | "ivme_phi3" | "ivme_gemma2" | "ivme_bert" => {
                    let y: Vec<u32> = (0..ids.len()).map(next).collect();
                    (
                        Tensor::from_vec(ids.clone(), (BATCH, SEQ), &dev)?,
                        Tensor::from_vec(y, (BATCH, SEQ), &dev)?,
                    )
                }
                // One target per sequence: its last token plus one (llama, t5), or the first
                // token's class (bert).
                _ => {
                    let y: Vec<u32> = (0..BATCH)
                        .map(|b| match family {
                            "bert" | "xlmr" => ids[b * SEQ] % CLASSES as u32,
                            "t5" => next(b * SEQ + SEQ / 2 - 1),
                            _ => next(b * SEQ + SEQ - 1),
                        })
                        .collect();
                    (
                        Tensor::from_vec(ids.clone(), (BATCH, SEQ), &dev)?,
                        Tensor::from_vec(y, BATCH, &dev)?,
                    )
                }
            })
        })
        .collect()
}
