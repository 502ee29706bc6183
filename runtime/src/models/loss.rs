//! The causal language-modelling loss: each position predicts the next token.

use candle_core::{DType, Result, Tensor, D};

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
/// `ignore_index` skipped (masked-LM heads, or logits already shifted).
pub fn token_loss(logits: &Tensor, labels: &Tensor, ignore_index: i64) -> Result<Tensor> {
    let (n, v) = logits.dims2()?;
    let labels = labels.to_dtype(DType::I64)?.to_vec1::<i64>()?;
    if labels.len() != n {
        candle_core::bail!("token_loss: {} labels for {n} rows of logits", labels.len())
    }
    let mut index = Vec::with_capacity(n);
    let mut keep = Vec::with_capacity(n);
    for (i, &l) in labels.iter().enumerate() {
        if l == ignore_index {
            index.push(0u32);
            keep.push(0f32);
        } else if l < 0 || l as usize >= v {
            candle_core::bail!("label {l} at row {i} is outside the vocabulary (0..{v})")
        } else {
            index.push(l as u32);
            keep.push(1f32);
        }
    }
    let count: f32 = keep.iter().sum();
    let dev = logits.device();
    let index = Tensor::from_vec(index, (n, 1), dev)?;
    let keep = Tensor::from_vec(keep, n, dev)?;
    let logp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
    let picked = logp.gather(&index, 1)?.squeeze(1)?;
    (picked * keep)?.sum_all()?.neg()? / f64::from(count.max(1.0))
}
