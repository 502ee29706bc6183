//! The settings an [`Accelerator`](crate::Accelerator) is built from, and where each came from.

use crate::error::{Error, Result};
use candle_core::DType;
use std::fmt;
use std::str::FromStr;

/// The numeric precision of the forward and backward passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32.
    #[default]
    No,
    /// f16 compute with f32 master weights and dynamic loss scaling.
    Fp16,
    /// bf16 compute with f32 master weights (no loss scaling needed).
    Bf16,
}

impl Precision {
    /// The valid spellings, for error messages: the same list as the attribute's
    /// (`ivme_macros_core::PRECISIONS`; a test of the `ivme` command keeps them equal), so
    /// code, the attribute, the launcher and config files spell a precision alike.
    pub const VALID: &'static [&'static str] = &["no", "fp16", "bf16"];

    /// The dtype the model computes in under this precision.
    pub fn compute_dtype(self) -> DType {
        match self {
            Precision::No => DType::F32,
            Precision::Fp16 => DType::F16,
            Precision::Bf16 => DType::BF16,
        }
    }

    /// The spelling used in configs and the attribute.
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::No => "no",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Precision {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "no" | "f32" | "fp32" | "none" => Ok(Precision::No),
            "fp16" | "f16" => Ok(Precision::Fp16),
            "bf16" => Ok(Precision::Bf16),
            _ => Err(Error::config(
                "precision",
                s,
                format!("use one of {}", Precision::VALID.join(", ")),
            )),
        }
    }
}

/// How much of the training state each process holds (ZeRO-style sharding; docs/sharding.md
/// has the memory formula and when to pick each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Sharding {
    /// Every process holds everything (plain data parallelism).
    #[default]
    No,
    /// Stage 1: each process holds the f32 master weights and optimizer state of its 1/N
    /// slice of the parameters only; gradients are still averaged whole.
    Optimizer,
    /// Stage 2: as stage 1, and gradients are reduce-scattered, so each process keeps only
    /// its slice of them after the sync.
    Gradients,
}

impl Sharding {
    /// The valid spellings, for error messages.
    pub const VALID: &'static [&'static str] = &["no", "optimizer", "gradients", "0", "1", "2"];

    /// The spelling used in configs.
    pub fn as_str(self) -> &'static str {
        match self {
            Sharding::No => "no",
            Sharding::Optimizer => "optimizer",
            Sharding::Gradients => "gradients",
        }
    }
}

impl fmt::Display for Sharding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Sharding {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "no" | "none" | "0" => Ok(Sharding::No),
            "optimizer" | "1" | "zero1" => Ok(Sharding::Optimizer),
            "gradients" | "2" | "zero2" => Ok(Sharding::Gradients),
            _ => Err(Error::config(
                "sharding",
                s,
                format!("use one of {}", Sharding::VALID.join(", ")),
            )),
        }
    }
}

/// How the buffers of a prepared model (state the forward writes and no optimizer steps, such
/// as BatchNorm's running statistics) agree across processes at the end of every accumulation
/// window; docs/buffers.md says what each costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BufferSync {
    /// Every process takes rank 0's buffers (what PyTorch's DDP does by default).
    #[default]
    Broadcast,
    /// Every process takes the mean of all processes' buffers (for BatchNorm: statistics of
    /// the whole global batch, as SyncBatchNorm's running statistics are).
    Average,
    /// Each process keeps its own; the ranks' models differ in their buffers, a checkpoint and
    /// `save_model` hold rank 0's, and a resume gives every rank rank 0's.
    Local,
}

impl BufferSync {
    /// The valid spellings, for error messages.
    pub const VALID: &'static [&'static str] = &["broadcast", "average", "local"];

    /// The spelling used in configs and the attribute.
    pub fn as_str(self) -> &'static str {
        match self {
            BufferSync::Broadcast => "broadcast",
            BufferSync::Average => "average",
            BufferSync::Local => "local",
        }
    }
}

impl fmt::Display for BufferSync {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for BufferSync {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "broadcast" => Ok(BufferSync::Broadcast),
            "average" | "mean" => Ok(BufferSync::Average),
            "local" => Ok(BufferSync::Local),
            _ => Err(Error::config(
                "buffers",
                s,
                format!("use one of {}", BufferSync::VALID.join(", ")),
            )),
        }
    }
}

/// Resolves one setting by precedence (code > environment > default) and returns a warning
/// naming both values when code and the environment disagree.
pub(crate) fn resolve<T>(
    key: &str,
    code: Option<T>,
    var: &crate::setup::env::Var,
    default: T,
) -> Result<(T, Option<String>)>
where
    T: FromStr + PartialEq + fmt::Debug + Copy,
    T::Err: fmt::Display,
{
    resolve_with(key, code, var, default, |s| {
        s.parse::<T>().map_err(|e| e.to_string())
    })
}

/// [`resolve`] with the variable's own parser.
pub(crate) fn resolve_with<T>(
    key: &str,
    code: Option<T>,
    var: &crate::setup::env::Var,
    default: T,
    parse: impl Fn(&str) -> std::result::Result<T, String>,
) -> Result<(T, Option<String>)>
where
    T: PartialEq + fmt::Debug + Copy,
{
    let env_var = var.name;
    let from_env = match var.get() {
        Some(raw) => Some(parse(&raw).map_err(|e| {
            Error::config(env_var, &raw, format!("`{key}` from the environment: {e}"))
        })?),
        None => None,
    };
    Ok(match (code, from_env) {
        (Some(c), Some(e)) if c != e => (
            c,
            Some(format!(
                "ivme: `{key}` is {c:?} in code and {e:?} from {env_var}; using the code's value"
            )),
        ),
        (Some(c), _) => (c, None),
        (None, Some(e)) => (e, None),
        (None, None) => (default, None),
    })
}
