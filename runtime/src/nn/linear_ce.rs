//! The output head and the cross-entropy in one op, over chunks of rows: the whole
//! `(rows × vocabulary)` logits and their gradient never exist at once.
//!
//! A language model's head computes `x · Wᵀ` for every position and the loss reads those
//! logits once; with candle the logits (rows × vocabulary, f32) and, in the backward, their
//! gradient and a zero-filled tensor it is added into are each a whole allocation: at 2048
//! tokens and a 32 K vocabulary, 256 MB apiece. Here, on the CPU, the forward takes a chunk
//! of rows at a time: their logits (one product into a buffer of at most [`CHUNK_ELEMS`]
//! f32), each row's `logsumexp` and loss, then in place the rows' gradient
//! `(softmax − onehot) / count`, from which two more products give the chunk's part of `dx`
//! and add its part of `dW`. The gradients are thus computed with the loss (when `x` or `W`
//! needs one) and kept for the backward, which only scales them by the loss's gradient.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::elem::{self, Elem};
use super::fastmath;
use super::rows::Rows;

const OP: &str = "linear_cross_entropy";

/// The most logits one chunk holds (f32): 4 MiB.
const CHUNK_ELEMS: usize = 1 << 20;

/// The mean cross-entropy of the logits `x · weightᵀ` against `labels`, without the whole
/// logits: `x` `(n, in)` (or any `(.., in)`, its rows taken in order), `weight`
/// `(classes, in)`, `labels` `n` integers; rows whose label is `ignore_index` are left out
/// (a loss of 0 when every row is). An f32 scalar.
///
/// The value is `cross_entropy(&linear(x, weight, None)?, labels, ignore_index)` within f32
/// rounding, and so are the gradients of `x` and `weight` (not second derivatives). `x` and
/// `weight` share a dtype (f32, bf16 or f16; the arithmetic is f32). A label outside
/// `0..classes` is an error naming its row. Off the CPU it is composed of those two ops.
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::new(&[[1f32, 0.], [0., 1.]], &Device::Cpu)?;
/// let w = Tensor::new(&[[0f32, 0.], [2., 0.], [0., 1.]], &Device::Cpu)?;
/// let labels = Tensor::new(&[1u32, 2], &Device::Cpu)?;
/// let fused = ivme::nn::linear_cross_entropy(&x, &w, &labels, -100)?;
/// let plain = ivme::nn::cross_entropy(&ivme::nn::linear(&x, &w, None)?, &labels, -100)?;
/// let diff = (fused.to_scalar::<f32>()? - plain.to_scalar::<f32>()?).abs();
/// assert!(diff < 1e-6);
/// # Ok(())
/// # }
/// ```
pub fn linear_cross_entropy(
    x: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
    ignore_index: i64,
) -> Result<Tensor> {
    let (classes, inp) = super::linear::weight_dims(OP, "classes", x, weight)?;
    if x.dtype() != weight.dtype() {
        candle_core::bail!(
            "ivme::nn::{OP}: x is {:?} but weight is {:?}; they must share a dtype",
            x.dtype(),
            weight.dtype()
        )
    }
    if !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return Err(elem::unsupported(OP, x.dtype()));
    }
    let rows = x.elem_count() / inp.max(1);
    let labels = labels
        .to_dtype(DType::I64)?
        .flatten_all()?
        .to_vec1::<i64>()?;
    if labels.len() != rows {
        candle_core::bail!(
            "ivme::nn::{OP}: {} labels for {rows} rows of x {:?}",
            labels.len(),
            x.dims()
        )
    }
    for (row, &l) in labels.iter().enumerate() {
        if l != ignore_index && !(0..classes as i64).contains(&l) {
            candle_core::bail!(
                "ivme::nn::{OP}: label {l} at row {row} is outside the classes (0..{classes})"
            )
        }
    }
    let x = x.reshape((rows, inp))?;
    if !x.device().is_cpu() || !weight.device().is_cpu() {
        let logits = super::linear(&x, weight, None)?;
        let labels = Tensor::from_vec(labels, rows, x.device())?;
        return super::cross_entropy(&logits, &labels, ignore_index);
    }
    let x = if Rows::of(x.layout()).is_some() {
        x
    } else {
        x.contiguous()?
    };
    let op = LinearCe {
        labels: Arc::new(labels),
        ignore_index,
        grads: x.track_op() || weight.track_op(),
        kept: Arc::new(Mutex::new(None)),
    };
    x.apply_op2(&weight.contiguous()?, op)
}

/// The fused op: `x`, `weight` → the mean loss, the gradients kept for the backward.
struct LinearCe {
    labels: Arc<Vec<i64>>,
    ignore_index: i64,
    /// Whether to compute the gradients with the loss.
    grads: bool,
    /// `dx` and `dW` for a loss gradient of 1, as the forward left them.
    kept: Arc<Mutex<Option<(CpuStorage, CpuStorage)>>>,
}

impl CustomOp2 for LinearCe {
    fn name(&self) -> &'static str {
        "ivme-linear-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let rx = Rows::of_op(l1, OP, "x")?;
        let rw = Rows::of_op(l2, OP, "weight")?;
        use CpuStorage::{BF16, F16, F32};
        let (loss, kept) = match (s1, s2) {
            (F32(x), F32(w)) => self.run(x, rx, w, rw, F32),
            (BF16(x), BF16(w)) => self.run(x, rx, w, rw, BF16),
            (F16(x), F16(w)) => self.run(x, rx, w, rw, F16),
            _ => return Err(elem::mixed(OP, &[s1, s2])),
        };
        *self.kept.lock().expect("the kept gradients' lock") = kept;
        Ok((F32(vec![loss]), Shape::from(())))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let kept = self.kept.lock().expect("the kept gradients' lock").take();
        let Some((dx, dw)) = kept else {
            candle_core::bail!(
                "ivme::nn::{OP}: no gradients kept for this backward (a second backward of one \
                 loss is not supported; compute the loss again)"
            )
        };
        let g = grad.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
        let tensor = |s: CpuStorage, t: &Tensor| {
            let none = candle_core::op::BackpropOp::none();
            Tensor::from_storage(candle_core::Storage::Cpu(s), t.shape(), none, false)
        };
        let (dx, dw) = (tensor(dx, x), tensor(dw, weight));
        let scale = |t: Tensor| if g == 1.0 { Ok(t) } else { t.affine(g, 0.) };
        Ok((Some(scale(dx)?), Some(scale(dw)?)))
    }
}

impl LinearCe {
    /// The loss and, when asked for, `dx` and `dW` (each as `wrap` makes a storage of `T`).
    fn run<T: Elem>(
        &self,
        x: &[T],
        rx: Rows,
        w: &[T],
        rw: Rows,
        wrap: fn(Vec<T>) -> CpuStorage,
    ) -> (f32, Option<(CpuStorage, CpuStorage)>) {
        let (n, k, c) = (rx.rows, rx.width, rw.rows);
        let labels = &self.labels;
        let count = labels.iter().filter(|&&l| l != self.ignore_index).count();
        let inv_count = 1. / count.max(1) as f32;
        let w = super::linear::wide(w, rw);
        let chunk = (CHUNK_ELEMS / c.max(1)).clamp(1, n.max(1));
        let mut logits = vec![0f32; chunk * c];
        let mut dx = vec![0f32; if self.grads { n * k } else { 0 }];
        let mut dw = vec![0f32; if self.grads { c * k } else { 0 }];
        let mut total = 0f64;
        for first in (0..n).step_by(chunk) {
            let m = chunk.min(n - first);
            let xs = super::linear::wide(x, rx.skip(first, m));
            let block = &mut logits[..m * c];
            // SAFETY: `xs` is m × k and `w` c × k inside their slices; `block` is m × c.
            unsafe { super::linear::product_into(block, [m, c, k], xs.mat(), w.mat().t(), false) };
            let ignore = self.ignore_index;
            let losses: Vec<f32> = block
                .par_chunks_mut(c.max(1))
                .zip(&labels[first..first + m])
                .map(|(row, &label)| softmax_grad(row, label, ignore, inv_count, self.grads))
                .collect();
            total += losses.iter().map(|&l| l as f64).sum::<f64>();
            if self.grads {
                let lm = super::linear::Mat::dense(block, c);
                // SAFETY: the gradient block is m × c, `w` c × k, `xs` m × k; `dx`'s rows
                // `first..first + m` are m × k and `dw` c × k, in buffers of their own.
                unsafe {
                    super::linear::product_into(
                        &mut dx[first * k..(first + m) * k],
                        [m, k, c],
                        lm,
                        w.mat(),
                        false,
                    );
                    super::linear::product_into(&mut dw, [c, k, m], lm.t(), xs.mat(), first > 0);
                }
            }
        }
        let loss = if count == 0 {
            0.
        } else {
            (total / count as f64) as f32
        };
        let kept = self.grads.then(|| (wrap(narrowed(dx)), wrap(narrowed(dw))));
        (loss, kept)
    }
}

/// `v` as `T`: itself for f32, else rounded in parallel.
fn narrowed<T: Elem>(v: Vec<f32>) -> Vec<T> {
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() {
        let mut v = std::mem::ManuallyDrop::new(v);
        // SAFETY: `T` is `f32` (same type id): the allocation, length and capacity are a
        // `Vec<T>`'s, and `v` is not dropped.
        return unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<T>(), v.len(), v.capacity()) };
    }
    v.par_iter().map(|&x| T::of(x)).collect()
}

/// One row's loss `logsumexp − logit[label]` (0 when ignored); when `grads`, the row becomes
/// `(softmax − onehot(label)) · scale` (zeros when ignored).
fn softmax_grad(row: &mut [f32], label: i64, ignore: i64, scale: f32, grads: bool) -> f32 {
    if label == ignore {
        if grads {
            row.fill(0.);
        }
        return 0.;
    }
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = row.iter().map(|&v| fastmath::exp(v - max)).sum();
    let lse = max + sum.ln();
    let loss = lse - row[label as usize];
    if grads {
        for v in row.iter_mut() {
            *v = fastmath::exp(*v - lse) * scale;
        }
        row[label as usize] -= scale;
    }
    loss
}
