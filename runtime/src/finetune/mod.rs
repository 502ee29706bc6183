//! Fine-tuning a pretrained model: the base read from a Hugging Face model folder as constants
//! (no gradient, no optimizer state, no collective bytes), the layers you choose trained, LoRA
//! adapters, and adapters saved and merged in the layout PEFT users load.
//!
//! | piece | what it does |
//! |---|---|
//! | [`Accelerator::load_base`](crate::Accelerator::load_base) | opens a model folder's safetensors, checksums them and checks every process opened the same files; each tensor is read when the model asks for it |
//! | [`Accelerator::base_var_builder`](crate::Accelerator::base_var_builder) | a `VarBuilder` that hands the base's tensors out as constants and creates everything else (adapters, a new head, layers [`Base::unfreeze`] names) as variables of your `VarMap` |
//! | [`Accelerator::lora`](crate::Accelerator::lora), [`Lora::linear`] | linear layers with a rank-r adapter where the module's name matches a target |
//! | [`Accelerator::save_adapter`](crate::Accelerator::save_adapter) | `adapter_model.safetensors` + `adapter_config.json`, PEFT's layout |
//! | [`merge_adapter`] (`ivme merge-weights --adapter`) | folds an adapter into its base: a plain model folder |
//!
//! What trains is what the prepared optimizers hold: a variable of a prepared model that no
//! optimizer holds is frozen (its gradient is dropped at once: not accumulated, synced or
//! clipped). A base tensor handed out as a constant costs less still: it is no variable, so no
//! optimizer, master or sync ever sees it, and LoRA layers run it through [`frozen_linear`],
//! whose backward never computes its gradient. See docs/finetune.md.

mod base;
mod frozen;
mod lora;
mod pattern;
mod peft;

pub use base::{Base, BaseFile};
pub use frozen::frozen_linear;
pub use lora::{Lora, LoraConfig, LoraLinear};
pub(crate) use peft::write_adapter;
pub use peft::{merge_adapter, AdapterMerge, ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX};

use crate::error::{Error, Result};
use crate::stateful::Shared;
use candle_nn::VarMap;
use std::path::PathBuf;

/// The base a fine-tune was built over, as checkpoints record it: the folder and each
/// safetensors file's name, size and CRC-32. A resume checks the base it runs over against it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BaseRecord {
    /// The folder, as the program named it.
    pub folder: PathBuf,
    /// Its safetensors files, in name order.
    pub files: Vec<BaseFile>,
}

impl BaseRecord {
    /// Refuses `now` (the base this run opened, if any) unless it has the same files with the
    /// same sizes and checksums as this record; the error names the first file that differs.
    pub(crate) fn check(&self, now: Option<&BaseRecord>) -> std::result::Result<(), String> {
        let Some(now) = now else {
            return Err(format!(
                "was trained over the base {} ({} file(s)), but this run opened no base: build \
                 the model with `accelerator.load_base(..)` and `base_var_builder` first",
                self.folder.display(),
                self.files.len()
            ));
        };
        for want in &self.files {
            match now.files.iter().find(|f| f.name == want.name) {
                None => {
                    return Err(format!(
                        "was trained over a base with `{}`, which the base this run opened ({}) \
                         lacks",
                        want.name,
                        now.folder.display()
                    ))
                }
                Some(got) if got != want => {
                    return Err(format!(
                        "was trained over a base whose `{}` is {} bytes with CRC-32 {:08x}; in {} \
                         it is {} bytes with CRC-32 {:08x}: the pretrained weights changed, so \
                         the adapters would no longer fit them",
                        want.name,
                        want.bytes,
                        want.crc32,
                        now.folder.display(),
                        got.bytes,
                        got.crc32
                    ))
                }
                Some(_) => {}
            }
        }
        if let Some(extra) = now
            .files
            .iter()
            .find(|f| !self.files.iter().any(|w| w.name == f.name))
        {
            return Err(format!(
                "was trained over a base without `{}`, which {} holds",
                extra.name,
                now.folder.display()
            ));
        }
        Ok(())
    }
}

/// A name pattern the user gave (a LoRA target, a layer to unfreeze) and how many names it
/// matched, so one that matches nothing is refused at prepare instead of training nothing.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// What the pattern is for, in words: "LoRA target", "unfreeze pattern".
    pub(crate) what: &'static str,
    pub(crate) pattern: String,
    pub(crate) hits: usize,
}

/// The Accelerator's record of a fine-tune: the `VarMap`s its builders made variables in (so
/// an optimizer over any of their variables can be prepared without naming the map), the
/// patterns given and what they matched, the modules LoRA saw, and the base.
#[derive(Default, Clone)]
pub(crate) struct FineTuning {
    built: Shared<Vec<VarMap>>,
    pub(crate) targets: Shared<Vec<Target>>,
    /// Every module name a [`Lora`] was asked to build, adapted or not (for error messages).
    pub(crate) seen: Shared<Vec<String>>,
    /// The base loaded last, and the parameters it handed out as constants.
    pub(crate) base: Shared<Option<BaseRecord>>,
    pub(crate) constants: Shared<usize>,
}

impl std::fmt::Debug for FineTuning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FineTuning")
            .field("targets", &*self.targets.lock())
            .field("base", &self.base.lock().as_ref().map(|b| b.folder.clone()))
            .finish()
    }
}

impl FineTuning {
    /// Remembers that a builder made variables in `varmap`.
    pub(crate) fn remember(&self, varmap: &VarMap) {
        let mut built = self.built.lock();
        let data = varmap.data();
        if !built.iter().any(|v| std::ptr::eq(v.data(), data)) {
            built.push(varmap.clone());
        }
    }

    /// The `VarMap`s builders made variables in, oldest first.
    pub(crate) fn built(&self) -> Vec<VarMap> {
        self.built.lock().clone()
    }

    /// Registers a pattern; returns its index for [`hit`](Self::hit).
    pub(crate) fn add_target(&self, what: &'static str, pattern: &str) -> usize {
        let mut t = self.targets.lock();
        t.push(Target {
            what,
            pattern: pattern.to_string(),
            hits: 0,
        });
        t.len() - 1
    }

    /// Counts a match of pattern `k`.
    pub(crate) fn hit(&self, k: usize) {
        if let Some(t) = self.targets.lock().get_mut(k) {
            t.hits += 1;
        }
    }

    /// Refuses a pattern that matched nothing, naming it and what it could have matched.
    pub(crate) fn check_targets(&self) -> Result<()> {
        let targets = self.targets.lock();
        let Some(t) = targets.iter().find(|t| t.hits == 0) else {
            return Ok(());
        };
        let seen = self.seen.lock();
        let some: Vec<&str> = seen.iter().take(8).map(String::as_str).collect();
        let listed = if some.is_empty() {
            "no linear layer was built through `lora.linear(..)`".to_string()
        } else {
            format!(
                "the modules built through `lora.linear(..)` are {}{}",
                some.join(", "),
                if seen.len() > some.len() { ", …" } else { "" }
            )
        };
        Err(Error::Prepare(format!(
            "the {} `{}` matched no module, so it would train nothing: {listed}; a target \
             matches a module's whole name, a prefix of it, or its last parts (`q_proj` \
             matches `layers.0.attn.q_proj`), and `*` matches any characters",
            t.what, t.pattern
        )))
    }
}
