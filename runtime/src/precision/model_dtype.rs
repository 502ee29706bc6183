//! What low precision does to model code, said plainly.
//!
//! Under bf16/fp16 a model's weights, and so its activations, are in the low precision. Model
//! code that fixes a dtype of its own (an f32 mask fill value, an f32 rotary table) then meets a
//! low-precision tensor and candle refuses the op; code with a constant that is finite in f32
//! but infinite in 16 bits (`f32::MIN` in a mask) turns the loss into NaN. Both are explained
//! here: [`explain`] turns candle's dtype errors into messages that say what happened and what
//! to do, and [`LossGuard`] stops a run whose forward pass is NaN in the low precision before
//! it writes NaN into the weights or skips every step.

use crate::error::{Error, Result};
use crate::setup::config::Precision;
use candle_core::{DType, Tensor};

/// The ivme precision whose compute dtype is `dt` (bf16 or f16), if it is one.
fn low_precision(dt: DType) -> Option<Precision> {
    match dt {
        DType::BF16 => Some(Precision::Bf16),
        DType::F16 => Some(Precision::Fp16),
        _ => None,
    }
}

/// candle's layer ops that take the input as their left operand and a weight as the right.
const INPUT_FIRST: &[&str] = &[
    "conv1d",
    "conv2d",
    "conv_transpose1d",
    "conv_transpose2d",
    "matmul",
];

/// Where the docs list the models known to do this, and the patches.
const DOCS: &str = "docs/precision.md";

/// A dtype error that 16-bit weights caused becomes an [`Error::Precision`] that says what
/// happened and what to do; every other candle error is [`Error::Candle`].
impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        explain(e)
    }
}

/// Turns a candle error into ivme's, with an explanation when it is a dtype problem of the
/// kind 16-bit weights cause (f32 meeting bf16/f16, or an op without a 16-bit kernel); other
/// errors pass through unchanged. The error itself says which 16-bit dtype is involved, so
/// nothing outside it is consulted.
pub(crate) fn explain(e: candle_core::Error) -> Error {
    let (low, p) = match root(&e) {
        candle_core::Error::DTypeMismatchBinaryOp { lhs, rhs, .. } => {
            match (low_precision(*lhs), low_precision(*rhs)) {
                (None, Some(p)) if *lhs == DType::F32 => (*rhs, p),
                (Some(p), None) if *rhs == DType::F32 => (*lhs, p),
                _ => return Error::Candle(e),
            }
        }
        candle_core::Error::UnsupportedDTypeForOp(dt, _) => match low_precision(*dt) {
            Some(p) => (*dt, p),
            None => return Error::Candle(e),
        },
        _ => return Error::Candle(e),
    };
    let hint = match root(&e) {
        // A layer whose input (lhs) is f32 while its weight (rhs) is low precision: the batch
        // itself was never cast, which is the usual cause and not the model's code.
        candle_core::Error::DTypeMismatchBinaryOp { lhs, rhs, op }
            if *lhs == DType::F32 && *rhs == low && INPUT_FIRST.contains(op) =>
        {
            format!(
                "candle's `{op}` got an f32 input and {low:?} weights{at}. Under precision {p} \
                 the model's weights are {low:?}, so the input, usually the batch itself, was \
                 never cast: pass it through an autocast scope, \
                 `accelerator.autocast(|ac| model.forward(&ac.input(&x)?))`; under \
                 `#[accelerate]` the attribute does this for `forward`/`forward_t` calls on the \
                 batch, so call the model through one of those (not a method of your own), or \
                 cast with `x.to_dtype(accelerator.precision().compute_dtype())`. If that \
                 input was made inside model code, make it in the weights' dtype instead; see \
                 {DOCS}",
                at = made_at(&e)
            )
        }
        candle_core::Error::DTypeMismatchBinaryOp { lhs, rhs, op }
            if [*lhs, *rhs].contains(&DType::F32) && [*lhs, *rhs].contains(&low) =>
        {
            format!(
                "candle's `{op}` got one f32 tensor and one {low:?} tensor{at}. Under precision {p} \
                 the model's weights, and so its activations, are {low:?}; the f32 one was made \
                 by code that fixes its dtype instead of taking it from its input or its \
                 VarBuilder (a mask's fill value such as `Tensor::new(f32::NEG_INFINITY, ..)`, a \
                 rotary or position table, a constant). To fix it, make that tensor in \
                 `x.dtype()` or `vb.dtype()` (in your code, or in a copy of the model's), or \
                 train this model with precision \"no\"; {DOCS} lists the candle-transformers \
                 models known to do this",
                at = made_at(&e)
            )
        }
        candle_core::Error::UnsupportedDTypeForOp(dt, op) if *dt == low => format!(
            "candle has no {dt:?} kernel for `{op}` on this device{at} (candle 0.11.1's CPU \
             backend runs conv1d/conv2d through a matmul without {dt:?}). Use precision \
             \"fp16\" on the CPU, {dt:?} on a GPU, or precision \"no\"; see {DOCS}",
            at = made_at(&e)
        ),
        _ => return Error::Candle(e),
    };
    Error::Precision(format!("{}: {hint}", root(&e)))
}

/// The error under candle's backtrace, context and path wrappers.
fn root(e: &candle_core::Error) -> &candle_core::Error {
    match e {
        candle_core::Error::WithBacktrace { inner, .. }
        | candle_core::Error::Context { inner, .. }
        | candle_core::Error::WithPath { inner, .. } => root(inner),
        other => other,
    }
}

/// ", called from FRAME (FILE:LINE)" for the first frame of the error's backtrace outside
/// candle and the standard library, or a pointer to `RUST_BACKTRACE` when none was captured.
fn made_at(e: &candle_core::Error) -> String {
    let mut e = e;
    let trace = loop {
        match e {
            candle_core::Error::WithBacktrace { backtrace, .. } => break Some(backtrace),
            candle_core::Error::Context { inner, .. }
            | candle_core::Error::WithPath { inner, .. } => e = inner,
            _ => break None,
        }
    };
    match trace {
        None => {
            " (run with RUST_BACKTRACE=1 and this message names the line that called it)".into()
        }
        Some(t) => first_foreign_frame(&t.to_string())
            .map(|f| format!(", called from {f}"))
            .unwrap_or_default(),
    }
}

/// The first `N: symbol` line of a printed backtrace that is not candle-core's or the standard
/// library's, with the `at file:line` line under it.
fn first_foreign_frame(trace: &str) -> Option<String> {
    let mut lines = trace.lines().map(str::trim).peekable();
    while let Some(line) = lines.next() {
        let Some((n, symbol)) = line.split_once(": ") else {
            continue;
        };
        // Thread entry points (`start_thread`) have no path: not a place in anyone's code.
        if n.parse::<usize>().is_err() || !symbol.contains("::") {
            continue;
        }
        let theirs = [
            "candle_core::",
            "std::",
            "core::",
            "alloc::",
            "rayon",
            "gemm",
        ];
        let path = symbol.trim_start_matches('<');
        if theirs.iter().any(|p| path.starts_with(p)) {
            continue;
        }
        let at = lines
            .peek()
            .and_then(|l| l.strip_prefix("at "))
            .map(|l| format!(" ({l})"))
            .unwrap_or_default();
        return Some(format!("`{symbol}`{at}"));
    }
    None
}

/// Optimizer steps of a bf16 run whose losses are checked (a model whose forward is NaN in
/// bf16 shows it at once; later NaNs are divergence, which is the user's to handle).
const BF16_CHECKED_STEPS: usize = 8;
/// Consecutive fp16 steps skipped with a non-finite loss before the run stops.
const FP16_PATIENCE: usize = 3;

/// Watches the losses handed to `backward` under bf16/fp16 (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct LossGuard {
    /// The current window's losses, detached from their graphs; read only when needed.
    window: Vec<Tensor>,
    /// bf16 windows checked so far.
    checked: usize,
    /// fp16 steps skipped in a row with a non-finite loss.
    streak: usize,
}

impl LossGuard {
    /// Keeps `loss` (f32, before any scaling) for the check at the end of its window.
    pub(crate) fn record(&mut self, precision: Precision, loss: &Tensor) {
        let wanted = match precision {
            Precision::No => false,
            Precision::Bf16 => self.checked < BF16_CHECKED_STEPS,
            Precision::Fp16 => true,
        };
        if wanted {
            self.window.push(loss.detach());
        }
    }

    /// Checks the window that just synced: under bf16 in the first steps, under fp16 when its
    /// gradients overflowed (the losses are read only then).
    pub(crate) fn at_sync(&mut self, precision: Precision, overflow: bool) -> Result<()> {
        let window = std::mem::take(&mut self.window);
        match precision {
            Precision::No => Ok(()),
            Precision::Bf16 => {
                if self.checked >= BF16_CHECKED_STEPS {
                    return Ok(());
                }
                self.checked += 1;
                match first_non_finite(&window)? {
                    Some(v) => Err(nan_error(precision, v, self.checked)),
                    None => Ok(()),
                }
            }
            Precision::Fp16 => {
                let bad = if overflow {
                    first_non_finite(&window)?
                } else {
                    None
                };
                match bad {
                    None => {
                        self.streak = 0;
                        Ok(())
                    }
                    Some(v) => {
                        self.streak += 1;
                        if self.streak >= FP16_PATIENCE {
                            Err(nan_error(precision, v, self.streak))
                        } else {
                            Ok(())
                        }
                    }
                }
            }
        }
    }
}

fn first_non_finite(losses: &[Tensor]) -> Result<Option<f32>> {
    for l in losses {
        let v = l.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        if !v.is_finite() {
            return Ok(Some(v));
        }
    }
    Ok(None)
}

fn nan_error(p: Precision, value: f32, steps: usize) -> Error {
    let when = match p {
        Precision::Fp16 => format!(
            "on {steps} optimizer steps in a row, before loss scaling, so lowering the scale \
             cannot help"
        ),
        _ => format!("at optimizer step {steps}, before any update"),
    };
    Error::Precision(format!(
        "the loss was {value} under precision {p} {when}: the forward pass itself makes inf or \
         NaN in {dt:?}. A common cause in model code is a constant that is finite in f32 but \
         infinite in 16 bits, such as an attention mask built as `(1 - mask) * f32::MIN` \
         (candle-transformers' bert.rs), where 0 × -inf is NaN. To fix it, use the dtype's own \
         limit or a large finite value there (in your code, or in a copy of the model's), or \
         train this model with precision \"no\"; {DOCS} lists the models known to do this",
        dt = p.compute_dtype()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_16_bit_dtype_error_is_explained_from_the_error_alone() {
        // No Accelerator is built in this test: the explanation must not depend on one.
        let uncast = candle_core::Error::DTypeMismatchBinaryOp {
            lhs: DType::F32,
            rhs: DType::BF16,
            op: "conv2d",
        };
        let e = explain(uncast).to_string();
        assert!(e.contains("got an f32 input and BF16 weights"), "{e}");
        assert!(e.contains("precision bf16"), "{e}");
        let made_inside = candle_core::Error::DTypeMismatchBinaryOp {
            lhs: DType::F16,
            rhs: DType::F32,
            op: "add",
        };
        let e = explain(made_inside).to_string();
        assert!(e.contains("one f32 tensor and one F16 tensor"), "{e}");
        assert!(e.contains("precision fp16"), "{e}");
        // A mismatch 16-bit weights cannot cause stays candle's own error.
        let other = candle_core::Error::DTypeMismatchBinaryOp {
            lhs: DType::F32,
            rhs: DType::F64,
            op: "add",
        };
        assert!(matches!(explain(other), Error::Candle(_)));
    }

    #[test]
    fn the_first_frame_outside_candle_is_named() {
        let trace = "   0: candle_core::error::Error::bt\n             at /x/error.rs:264:25\n   \
                     1: <candle_core::storage::Storage>::where_cond\n             at /x/s.rs:1:1\n   \
                     2: candle_transformers::models::t5::masked_fill\n             at /y/t5.rs:119:13\n   \
                     3: std::rt::lang_start\n";
        assert_eq!(
            first_foreign_frame(trace).as_deref(),
            Some("`candle_transformers::models::t5::masked_fill` (/y/t5.rs:119:13)")
        );
        assert_eq!(first_foreign_frame(""), None);
    }

    fn loss(v: f32) -> Tensor {
        Tensor::new(v, &candle_core::Device::Cpu).unwrap()
    }

    /// One window of one micro-step with loss `v`, synced; `overflow` as fp16's check saw it.
    fn step(g: &mut LossGuard, p: Precision, v: f32, overflow: bool) -> Result<()> {
        g.record(p, &loss(v));
        g.at_sync(p, overflow)
    }

    #[test]
    fn fp16_stops_only_after_three_steps_in_a_row_with_a_nan_loss() {
        let mut g = LossGuard::default();
        let p = Precision::Fp16;
        // A finite loss whose gradients overflowed is loss scaling's business.
        step(&mut g, p, 1.0, true).unwrap();
        step(&mut g, p, f32::NAN, true).unwrap();
        step(&mut g, p, f32::INFINITY, true).unwrap();
        step(&mut g, p, 2.0, false).unwrap(); // a good step ends the streak
        step(&mut g, p, f32::NAN, true).unwrap();
        step(&mut g, p, f32::NAN, true).unwrap();
        let e = step(&mut g, p, f32::NAN, true).unwrap_err().to_string();
        assert!(e.contains("3 optimizer steps in a row"), "{e}");
    }

    #[test]
    fn bf16_checks_the_first_steps_only() {
        let mut g = LossGuard::default();
        let e = step(&mut g, Precision::Bf16, f32::NAN, false).unwrap_err();
        assert!(e.to_string().contains("step 1"), "{e}");
        let mut g = LossGuard::default();
        for _ in 0..BF16_CHECKED_STEPS {
            step(&mut g, Precision::Bf16, 1.0, false).unwrap();
        }
        step(&mut g, Precision::Bf16, f32::NAN, false).unwrap();
        assert!(
            g.window.is_empty(),
            "nothing is kept once the checks are over"
        );
        step(&mut LossGuard::default(), Precision::No, f32::NAN, false).unwrap();
    }
}
