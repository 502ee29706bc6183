//! The causal language-modelling loss: each position predicts the next token.

use candle_core::{DType, Result, Tensor};

/// The label transformers and ivme skip: a position whose label is this adds no loss.
pub const IGNORE_INDEX: i64 = -100;

/// Mean cross-entropy of `logits` `(b, t, vocab)` predicting `labels` `(b, t)` one position on
/// (position `i`'s logits against label `i + 1`, as transformers' causal LMs do), skipping
/// labels equal to `ignore_index` (padding, prompts); f32 arithmetic whatever the logits'
/// dtype. A batch whose every label is ignored has loss 0 (and zero gradients).
pub fn causal_lm_loss(logits: &Tensor, labels: &Tensor, ignore_index: i64) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    let (lb, lt) = labels.dims2()?;
    if (lb, lt) != (b, t) {
        candle_core::bail!(
            "causal_lm_loss: labels {:?} do not match logits {:?} (expected ({b}, {t}))",
            labels.shape(),
            logits.shape()
        )
    }
    if t < 2 {
        return Tensor::zeros((), DType::F32, logits.device());
    }
    let logits = logits.narrow(1, 0, t - 1)?;
    let labels = labels.narrow(1, 1, t - 1)?;
    token_loss(
        &logits.reshape((b * (t - 1), v))?,
        &labels.flatten_all()?,
        ignore_index,
    )
}

/// Mean cross-entropy of `logits` `(n, vocab)` against `labels` `(n)`, positions whose label is
/// `ignore_index` skipped (masked-LM heads, or logits already shifted): [`crate::nn::cross_entropy`],
/// one pass over the logits each way on the CPU.
pub fn token_loss(logits: &Tensor, labels: &Tensor, ignore_index: i64) -> Result<Tensor> {
    crate::nn::cross_entropy(logits, labels, ignore_index)
}
