//! The settings an [`Accelerator`](crate::Accelerator) is built from, and where each came from.

use crate::error::{Error, Result};
use candle_core::DType;
use ivme_settings::{self as table, Setting};
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
                table::PRECISION.name,
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
    /// Stage 3: as stage 2, and the weights of each checkpointed segment's unit (a block,
    /// named by its variables' prefix) are held as 1/N slices too: gathered just before the
    /// segment runs (forward and recompute), freed after, their gradients reduce-scattered as
    /// soon as the segment's backward ends. Implies activation checkpointing.
    Parameters,
}

impl Sharding {
    /// The valid spellings, for error messages.
    pub const VALID: &'static [&'static str] = &[
        "no",
        "optimizer",
        "gradients",
        "parameters",
        "0",
        "1",
        "2",
        "3",
    ];

    /// The spelling used in configs.
    pub fn as_str(self) -> &'static str {
        match self {
            Sharding::No => "no",
            Sharding::Optimizer => "optimizer",
            Sharding::Gradients => "gradients",
            Sharding::Parameters => "parameters",
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
            "parameters" | "3" | "zero3" => Ok(Sharding::Parameters),
            _ => Err(Error::config(
                table::SHARDING.name,
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
                table::BUFFERS.name,
                s,
                format!("use one of {}", BufferSync::VALID.join(", ")),
            )),
        }
    }
}

/// Resolves one setting by precedence (code > its variable > its default, all three as the
/// settings table's row says) and returns a warning naming both values when code and the
/// environment disagree.
pub(crate) fn resolve<T>(setting: &Setting, code: Option<T>) -> Result<(T, Option<String>)>
where
    T: FromStr + PartialEq + fmt::Debug + Copy,
    T::Err: fmt::Display,
{
    resolve_with(setting, code, |s| s.parse::<T>().map_err(|e| e.to_string()))
}

/// [`resolve`] with the variable's own parser, which reads the row's default too.
pub(crate) fn resolve_with<T>(
    setting: &Setting,
    code: Option<T>,
    parse: impl Fn(&str) -> std::result::Result<T, String>,
) -> Result<(T, Option<String>)>
where
    T: PartialEq + fmt::Debug + Copy,
{
    let key = setting.name;
    let from_env = match setting.var {
        Some(var) => match var.get() {
            Some(raw) => Some(parse(&raw).map_err(|e| {
                Error::config(var.name, &raw, format!("`{key}` from the environment: {e}"))
            })?),
            None => None,
        },
        None => None,
    };
    let env_var = setting.var_name();
    Ok(match (code, from_env) {
        (Some(c), Some(e)) if c != e => (
            c,
            Some(format!(
                "ivme: `{key}` is {c:?} in code and {e:?} from {env_var}; using the code's value"
            )),
        ),
        (Some(c), _) => (c, None),
        (None, Some(e)) => (e, None),
        (None, None) => (default_of(setting, parse), None),
    })
}

/// The row's default, read by the setting's own parser (a test reads every row's).
fn default_of<T>(setting: &Setting, parse: impl Fn(&str) -> std::result::Result<T, String>) -> T {
    parse(setting.default).unwrap_or_else(|e| {
        panic!(
            "the settings table's default of `{}` ({:?}) does not parse: {e}",
            setting.name, setting.default
        )
    })
}

/// Refuses a value outside the row's bound, in the bound's words; `shown` is the value as the
/// error shows it.
pub(crate) fn check_bound(setting: &Setting, value: f64, shown: impl fmt::Display) -> Result<()> {
    match setting.bound.admits(value) {
        true => Ok(()),
        false => Err(Error::config(
            setting.name,
            shown,
            format!("use {}", setting.bound.wording()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::setup::env::parse_bool;

    #[test]
    fn the_tables_defaults_read_as_the_builder_reads_them() {
        let switch = |s: &str| parse_bool(s).ok_or_else(|| s.to_string());
        assert_eq!(
            default_of(&table::GRAD_ACCUM, |s| s
                .parse::<usize>()
                .map_err(|e| e.to_string())),
            1
        );
        assert_eq!(
            default_of(&table::PRECISION, |s| s
                .parse::<Precision>()
                .map_err(|e| e.to_string())),
            Precision::No
        );
        assert_eq!(
            default_of(&table::SHARDING, |s| s
                .parse::<Sharding>()
                .map_err(|e| e.to_string())),
            Sharding::No
        );
        assert_eq!(
            default_of(&table::BUFFERS, |s| s
                .parse::<BufferSync>()
                .map_err(|e| e.to_string())),
            BufferSync::Broadcast
        );
        assert!(!default_of(&table::CPU, switch));
        assert!(!default_of(&table::OVERLAP, switch));
    }

    #[test]
    fn a_value_outside_the_bound_is_refused_in_the_bounds_words() {
        assert!(check_bound(&table::GRAD_ACCUM, 1.0, 1).is_ok());
        let e = check_bound(&table::GRAD_ACCUM, 0.0, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("grad_accum") && e.contains("at least 1"), "{e}");
        let e = check_bound(&table::CLIP_GRAD_NORM, f64::NAN, "NaN")
            .unwrap_err()
            .to_string();
        assert!(e.contains("positive, finite"), "{e}");
    }
}
