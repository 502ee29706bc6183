//! LoRA adapters (Hu et al., 2021): a frozen linear layer `W x` plus a trained low-rank update
//! `(alpha / r) · B A x`, with `A` (r × in) drawn from the seeded generator and `B` (out × r)
//! zero, so training starts from the pretrained function exactly.

use super::pattern::matches;
use super::FineTuning;
use crate::error::{Error, Result};
use crate::rng::Rng;
use crate::stateful::Shared;
use candle_core::{Module, Tensor};
use candle_nn::{Init, VarBuilder};

/// A LoRA adapter's settings: its rank, scale, dropout and which modules get one.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The rank `r` of the update `B A`.
    pub rank: usize,
    /// The update is scaled by `alpha / rank`.
    pub alpha: f64,
    /// Dropout on the adapter's input while training (0 for none), drawn from the
    /// Accelerator's seeded generator, so a resumed run draws the same masks.
    pub dropout: f32,
    /// Module name patterns that get an adapter (`q_proj`, `layers.*.attn.v_proj`): see
    /// [`Lora::linear`].
    pub targets: Vec<String>,
}

impl LoraConfig {
    /// Rank `rank`, scale `alpha / rank`, no dropout, adapters on the modules `targets` match.
    pub fn new(rank: usize, alpha: f64, targets: &[&str]) -> Self {
        LoraConfig {
            rank,
            alpha,
            dropout: 0.0,
            targets: targets.iter().map(|t| t.to_string()).collect(),
        }
    }

    /// The same settings with dropout `p` on the adapter's input while training.
    pub fn with_dropout(mut self, p: f32) -> Self {
        self.dropout = p;
        self
    }

    /// The factor the update `B A x` is scaled by: `alpha / rank`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }
}

/// Builds linear layers with LoRA adapters where the module's name matches a target (made by
/// [`Accelerator::lora`](crate::Accelerator::lora)).
#[derive(Debug, Clone)]
pub struct Lora {
    config: LoraConfig,
    /// Each target's index in the fine-tune's record, for counting matches.
    targets: Vec<usize>,
    record: FineTuning,
    adapted: Shared<Vec<String>>,
    rng: Shared<Rng>,
}

impl Lora {
    /// A builder for `config` (see `Accelerator::lora`): its settings checked, its targets
    /// recorded in `record` so one that matches nothing is refused at prepare.
    pub(crate) fn new(config: LoraConfig, record: FineTuning, rng: Shared<Rng>) -> Result<Lora> {
        if config.rank == 0 {
            return Err(Error::Usage("a LoRA rank must be at least 1".into()));
        }
        if !config.alpha.is_finite() || config.alpha <= 0.0 {
            return Err(Error::Usage(format!(
                "a LoRA alpha must be a positive number, not {}",
                config.alpha
            )));
        }
        if !(0.0..1.0).contains(&config.dropout) {
            return Err(Error::Usage(format!(
                "a LoRA dropout is a probability in [0, 1), not {}",
                config.dropout
            )));
        }
        if config.targets.is_empty() {
            return Err(Error::Usage(
                "a LoRA config names no target module: give the names (or patterns) of the \
                 linear layers to adapt, e.g. [\"q_proj\", \"v_proj\"]"
                    .into(),
            ));
        }
        let targets = config
            .targets
            .iter()
            .map(|t| record.add_target("LoRA target", t))
            .collect();
        Ok(Lora {
            config,
            targets,
            record,
            adapted: Shared::default(),
            rng,
        })
    }
}

impl Lora {
    /// The settings this builder was made with.
    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// The modules that got an adapter so far, in the order they were built.
    pub fn adapted(&self) -> Vec<String> {
        self.adapted.lock().clone()
    }

    /// A linear layer with a bias: `vb.pp("weight")`/`"bias"` as `candle_nn::linear` reads
    /// them, plus `lora_A.weight` (rank × in) and `lora_B.weight` (out × rank) under `vb`'s
    /// prefix when the prefix matches a target (a target matches the module's whole name, a
    /// prefix of it, or its last parts, so `q_proj` matches `layers.0.attn.q_proj`).
    pub fn linear(
        &self,
        in_dim: usize,
        out_dim: usize,
        vb: VarBuilder,
    ) -> candle_core::Result<LoraLinear> {
        let base = candle_nn::linear(in_dim, out_dim, vb.clone())?;
        self.wrap(base, in_dim, out_dim, vb)
    }

    /// A linear layer without a bias, adapted as [`linear`](Self::linear) says.
    pub fn linear_no_bias(
        &self,
        in_dim: usize,
        out_dim: usize,
        vb: VarBuilder,
    ) -> candle_core::Result<LoraLinear> {
        let base = candle_nn::linear_no_bias(in_dim, out_dim, vb.clone())?;
        self.wrap(base, in_dim, out_dim, vb)
    }

    fn wrap(
        &self,
        base: candle_nn::Linear,
        in_dim: usize,
        out_dim: usize,
        vb: VarBuilder,
    ) -> candle_core::Result<LoraLinear> {
        let module = vb.prefix();
        self.record.seen.lock().push(module.clone());
        let hit = self
            .config
            .targets
            .iter()
            .zip(&self.targets)
            .find(|(t, _)| matches(t, &module));
        let Some((_, &k)) = hit else {
            return Ok(LoraLinear {
                base,
                adapter: None,
            });
        };
        self.record.hit(k);
        let r = self.config.rank;
        // PEFT's default: A as a Kaiming-uniform linear weight (bound 1/sqrt(in)), B zero.
        let bound = 1.0 / (in_dim as f64).sqrt();
        let a = vb.pp("lora_A").get_with_hints(
            (r, in_dim),
            "weight",
            Init::Uniform {
                lo: -bound,
                up: bound,
            },
        )?;
        let b = vb
            .pp("lora_B")
            .get_with_hints((out_dim, r), "weight", Init::Const(0.0))?;
        self.adapted.lock().push(module);
        Ok(LoraLinear {
            base,
            adapter: Some(Adapter {
                a,
                b,
                scale: self.config.scale(),
                dropout: self.config.dropout,
                rng: self.rng.clone(),
            }),
        })
    }
}

#[derive(Debug, Clone)]
struct Adapter {
    a: Tensor,
    b: Tensor,
    scale: f64,
    dropout: f32,
    rng: Shared<Rng>,
}

/// A linear layer, with a LoRA adapter when its module was a target:
/// `W x + b + (alpha / r) · B A x`.
#[derive(Debug, Clone)]
pub struct LoraLinear {
    base: candle_nn::Linear,
    adapter: Option<Adapter>,
}

impl LoraLinear {
    /// Whether this layer has an adapter.
    pub fn is_adapted(&self) -> bool {
        self.adapter.is_some()
    }

    /// The frozen layer under the adapter.
    pub fn base(&self) -> &candle_nn::Linear {
        &self.base
    }

    fn apply(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let y = super::frozen_linear(x, self.base.weight(), self.base.bias())?;
        let Some(ad) = &self.adapter else {
            return Ok(y);
        };
        let x = if train && ad.dropout > 0.0 {
            ad.rng.lock().dropout(x, ad.dropout)?
        } else {
            x.clone()
        };
        let down = candle_nn::Linear::new(ad.a.clone(), None).forward(&x)?;
        let up = candle_nn::Linear::new(ad.b.clone(), None).forward(&down)?;
        y + (up * ad.scale)?
    }
}

impl LoraLinear {
    /// The layer with the adapter's dropout only when `train` is true (`forward` applies it
    /// whenever the config has some): `forward_t(x, false)` for evaluation.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.apply(x, train)
    }
}

impl Module for LoraLinear {
    /// The layer as trained: with the adapter's dropout when the config has some.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.apply(x, true)
    }
}
