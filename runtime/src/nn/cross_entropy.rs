//! Mean cross-entropy of logits against class labels, with a fused backward.
//!
//! A language model's loss reads logits of `tokens × vocabulary`: composed of candle ops
//! (log-softmax, gather, mask, mean) it makes about a dozen passes over them forward and as many
//! backward, each allocating a logits-sized tensor. On the CPU this is one custom op: the
//! forward takes each row's max and sum of `exp(x − max)` in one pass and gives the mean of
//! `logsumexp − x[label]` over the rows whose label is not ignored; the backward writes
//! `(softmax(x) − onehot(label)) · g / count` in one more pass per row (ignored rows get zeros).
//! Elsewhere the same maths is composed of candle ops.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;
use std::sync::Arc;

use super::elem::{self, Elem};

const OP: &str = "cross_entropy";

/// Rows a block of the forward's loss sum takes: a number fixed by the shapes, so that the
/// sum's order, and with it the loss's bits, does not depend on the number of threads.
const ROWS_PER_BLOCK: usize = 64;

/// The mean cross-entropy of `logits` `(n, classes)` against `labels` `(n)` (integers),
/// leaving out the rows whose label is `ignore_index`; an f32 scalar (0 when every row is
/// ignored). `logits` may be f32, bf16 or f16 (the arithmetic is f32) and gets a gradient;
/// a label outside `0..classes` (other than `ignore_index`) is an error naming its row.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// # fn main() -> candle_core::Result<()> {
/// let logits = Var::new(&[[0f32, 0.], [2., 0.]], &Device::Cpu)?;
/// let labels = Tensor::new(&[1i64, -100], &Device::Cpu)?;
/// let loss = ivme::nn::cross_entropy(&logits, &labels, -100)?;
/// assert!((loss.to_scalar::<f32>()? - 2f32.ln()).abs() < 1e-6);
/// let grads = loss.backward()?;
/// assert_eq!(grads.get(&logits).unwrap().to_vec2::<f32>()?, [[0.5, -0.5], [0., 0.]]);
/// # Ok(())
/// # }
/// ```
pub fn cross_entropy(logits: &Tensor, labels: &Tensor, ignore_index: i64) -> Result<Tensor> {
    let (n, classes) = logits.dims2()?;
    match logits.dtype() {
        DType::F32 | DType::BF16 | DType::F16 => {}
        dtype => return Err(elem::unsupported(OP, dtype)),
    }
    let labels = labels
        .to_dtype(DType::I64)?
        .flatten_all()?
        .to_vec1::<i64>()?;
    if labels.len() != n {
        candle_core::bail!(
            "ivme::nn::{OP}: {} labels for {n} rows of logits",
            labels.len()
        )
    }
    for (row, &l) in labels.iter().enumerate() {
        if l != ignore_index && !(0..classes as i64).contains(&l) {
            candle_core::bail!(
                "ivme::nn::{OP}: label {l} at row {row} is outside the classes (0..{classes})"
            )
        }
    }
    let labels = Labels {
        labels: Arc::new(labels),
        ignore_index,
    };
    if logits.device().is_cpu() {
        logits.contiguous()?.apply_op1(CrossEntropy(labels))
    } else {
        composed(logits, &labels)
    }
}

/// [`cross_entropy`] composed of candle ops (its form off the CPU, and the tests' reference).
#[doc(hidden)]
pub fn cross_entropy_composed(
    logits: &Tensor,
    labels: &Tensor,
    ignore_index: i64,
) -> Result<Tensor> {
    let labels = labels
        .to_dtype(DType::I64)?
        .flatten_all()?
        .to_vec1::<i64>()?;
    composed(
        logits,
        &Labels {
            labels: Arc::new(labels),
            ignore_index,
        },
    )
}

fn composed(logits: &Tensor, labels: &Labels) -> Result<Tensor> {
    let dev = logits.device();
    let n = labels.labels.len();
    let index: Vec<u32> = labels
        .labels
        .iter()
        .map(|&l| {
            if l == labels.ignore_index {
                0
            } else {
                l as u32
            }
        })
        .collect();
    let keep: Vec<f32> = labels
        .labels
        .iter()
        .map(|&l| f32::from(u8::from(l != labels.ignore_index)))
        .collect();
    let count = keep.iter().sum::<f32>().max(1.0);
    let logp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
    let picked = logp
        .gather(&Tensor::from_vec(index, (n, 1), dev)?, 1)?
        .squeeze(1)?;
    (picked * Tensor::from_vec(keep, n, dev)?)?
        .sum_all()?
        .neg()?
        / f64::from(count)
}

/// The rows' labels and the label that leaves a row out.
#[derive(Clone)]
struct Labels {
    labels: Arc<Vec<i64>>,
    ignore_index: i64,
}

impl Labels {
    /// The rows that count.
    fn count(&self) -> usize {
        self.labels
            .iter()
            .filter(|&&l| l != self.ignore_index)
            .count()
    }

    /// Row `i`'s label, `None` when it is ignored.
    fn of(&self, i: usize) -> Option<usize> {
        let l = self.labels[i];
        (l != self.ignore_index).then_some(l as usize)
    }
}

/// A row's max and `ln Σ exp(x − max)`, in f32.
fn row_stats<T: Elem>(row: &[T]) -> (f32, f32) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, x| m.max(x.f32()));
    let sum: f32 = row.iter().map(|x| (x.f32() - max).exp()).sum();
    (max, sum.ln())
}

/// The fused loss: `logits` → the mean cross-entropy (a scalar).
struct CrossEntropy(Labels);

impl CustomOp1 for CrossEntropy {
    fn name(&self) -> &'static str {
        "ivme-cross-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: Elem>(x: &[T], l: &Layout, labels: &Labels) -> Result<(CpuStorage, Shape)> {
            let x = elem::contiguous(x, l, OP)?;
            let c = l.dims()[1];
            let blocks: Vec<f32> = x
                .par_chunks(ROWS_PER_BLOCK * c.max(1))
                .enumerate()
                .map(|(b, block)| {
                    let mut sum = 0f32;
                    for (j, row) in block.chunks(c.max(1)).enumerate() {
                        if let Some(label) = labels.of(b * ROWS_PER_BLOCK + j) {
                            let (max, lse) = row_stats(row);
                            sum += max + lse - row[label].f32();
                        }
                    }
                    sum
                })
                .collect();
            let total: f32 = blocks.iter().sum();
            let mean = total / labels.count().max(1) as f32;
            Ok((CpuStorage::F32(vec![mean]), Shape::from(())))
        }
        match s {
            CpuStorage::F32(x) => run(x, l, &self.0),
            CpuStorage::BF16(x) => run(x, l, &self.0),
            CpuStorage::F16(x) => run(x, l, &self.0),
            other => Err(elem::unsupported(OP, elem::dtype_of(other))),
        }
    }

    fn bwd(&self, logits: &Tensor, _loss: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let g = grad.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let op = CrossEntropyBwd {
            labels: self.0.clone(),
            factor: g / self.0.count().max(1) as f32,
        };
        Ok(Some(logits.apply_op1_no_bwd(&op)?))
    }
}

/// The fused loss's backward: `logits` → `(softmax − onehot) · factor` per counted row.
struct CrossEntropyBwd {
    labels: Labels,
    factor: f32,
}

impl CustomOp1 for CrossEntropyBwd {
    fn name(&self) -> &'static str {
        "ivme-cross-entropy-bwd"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: Elem + candle_core::WithDType>(
            x: &[T],
            l: &Layout,
            op: &CrossEntropyBwd,
        ) -> Result<(CpuStorage, Shape)> {
            let x = elem::contiguous(x, l, OP)?;
            let c = l.dims()[1].max(1);
            let zero = T::of(0.0);
            let mut out = vec![zero; x.len()];
            out.par_chunks_mut(c)
                .zip(x.par_chunks(c))
                .enumerate()
                .for_each(|(i, (dst, row))| {
                    let Some(label) = op.labels.of(i) else {
                        return;
                    };
                    let (max, lse) = row_stats(row);
                    let shift = max + lse;
                    for (j, (d, x)) in dst.iter_mut().zip(row).enumerate() {
                        let p = (x.f32() - shift).exp();
                        let onehot = if j == label { 1.0 } else { 0.0 };
                        *d = T::of((p - onehot) * op.factor);
                    }
                });
            Ok((T::to_cpu_storage_owned(out), l.shape().clone()))
        }
        match s {
            CpuStorage::F32(x) => run(x, l, self),
            CpuStorage::BF16(x) => run(x, l, self),
            CpuStorage::F16(x) => run(x, l, self),
            other => Err(elem::unsupported(OP, elem::dtype_of(other))),
        }
    }
}
