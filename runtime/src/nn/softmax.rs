//! Softmax over the last dimension, with a fused backward.
//!
//! On the CPU the forward is one custom op that handles each row in one task (the row's max,
//! then the sum of `exp(x - max)`, then the outputs; rows spread over rayon's threads); the
//! backward is a second custom op over the forward's output `y` and the incoming gradient `g`:
//! `dx = y * (g - Σ g·y)`, again one task per row. Elsewhere the same maths is composed of candle
//! ops, whose backward candle records.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use super::elem::{self, Elem};
use super::norm::row_sums;

/// Softmax over the last dimension of `x`.
///
/// The values are those of `candle_nn::ops::softmax_last_dim`; unlike it, this records a
/// backward pass, giving the gradient of `x`. `x` is f32, bf16 or f16 and the arithmetic is f32.
/// Second derivatives are not recorded.
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::new(&[[0f32, 0., 0., 0.]], &Device::Cpu)?;
/// let y = ivme::nn::softmax_last_dim(&x)?.to_vec2::<f32>()?;
/// assert!(y[0].iter().all(|&p| (p - 0.25).abs() < 1e-7));
/// # Ok(())
/// # }
/// ```
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "softmax_last_dim";
    match x.dtype() {
        DType::F32 | DType::BF16 | DType::F16 => {}
        dtype => return Err(elem::unsupported(OP, dtype)),
    }
    if x.rank() == 0 {
        candle_core::bail!("ivme::nn::{OP}: x must have at least one dimension, got a scalar")
    }
    if x.device().is_cpu() {
        x.contiguous()?.apply_op1(SoftmaxLastDim)
    } else {
        softmax_last_dim_composed(x)
    }
}

/// [`softmax_last_dim`] composed of candle ops (its form off the CPU, and the tests' reference).
#[doc(hidden)]
pub fn softmax_last_dim_composed(x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    // Subtracting the max changes no value of the softmax: it needs no gradient.
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?.to_dtype(dtype)
}

/// The fewest rows one rayon task takes, so that short rows are not one task each.
fn min_rows(d: usize) -> usize {
    (4096 / d.max(1)).max(1)
}

/// The fused softmax: `x` → `y`.
struct SoftmaxLastDim;

impl CustomOp1 for SoftmaxLastDim {
    fn name(&self) -> &'static str {
        "ivme-softmax-last-dim"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "softmax_last_dim";
        fn run<T: Elem + candle_core::WithDType>(
            x: &[T],
            l: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let x = elem::contiguous(x, l, OP)?;
            let d = l.dims().last().copied().unwrap_or(1);
            Ok((T::to_cpu_storage_owned(fwd(x, d)), l.shape().clone()))
        }
        match s {
            CpuStorage::F32(x) => run(x, l),
            CpuStorage::BF16(x) => run(x, l),
            CpuStorage::F16(x) => run(x, l),
            s => Err(elem::unsupported(OP, elem::dtype_of(s))),
        }
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        Ok(Some(y.apply_op2_no_bwd(&grad, &SoftmaxBwd)?))
    }
}

fn fwd<T: Elem>(x: &[T], d: usize) -> Vec<T> {
    let mut y = vec![T::of(0.); x.len()];
    if d == 0 {
        return y;
    }
    y.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .with_min_len(min_rows(d))
        .for_each(|(y, x)| {
            let max = x.iter().fold(f32::NEG_INFINITY, |m, v| m.max(v.f32()));
            let [sum] = row_sums(d, |i| [(x[i].f32() - max).exp()]);
            let inv = sum.recip();
            for (y, x) in y.iter_mut().zip(x) {
                *y = T::of((x.f32() - max).exp() * inv);
            }
        });
    y
}

/// Softmax's backward: `y`, `grad` → `dx = y * (grad - Σ grad·y)` row by row.
struct SoftmaxBwd;

impl CustomOp2 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "ivme-softmax-last-dim-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "softmax_last_dim (backward)";
        fn run<T: Elem + candle_core::WithDType>(
            y: &[T],
            l1: &Layout,
            g: &[T],
            l2: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let y = elem::contiguous(y, l1, OP)?;
            let g = elem::contiguous(g, l2, OP)?;
            let d = l1.dims().last().copied().unwrap_or(1);
            Ok((T::to_cpu_storage_owned(bwd(y, g, d)), l1.shape().clone()))
        }
        match (s1, s2) {
            (CpuStorage::F32(y), CpuStorage::F32(g)) => run(y, l1, g, l2),
            (CpuStorage::BF16(y), CpuStorage::BF16(g)) => run(y, l1, g, l2),
            (CpuStorage::F16(y), CpuStorage::F16(g)) => run(y, l1, g, l2),
            (s1, s2) => candle_core::bail!(
                "ivme::nn::{OP}: output {:?} and gradient {:?} must be of one dtype among f32, bf16, f16",
                elem::dtype_of(s1),
                elem::dtype_of(s2)
            ),
        }
    }
}

fn bwd<T: Elem>(y: &[T], g: &[T], d: usize) -> Vec<T> {
    let mut dx = vec![T::of(0.); y.len()];
    if d == 0 {
        return dx;
    }
    dx.par_chunks_mut(d)
        .zip(y.par_chunks(d).zip(g.par_chunks(d)))
        .with_min_len(min_rows(d))
        .for_each(|(dx, (y, g))| {
            let [dot] = row_sums(d, |i| [y[i].f32() * g[i].f32()]);
            for ((dx, y), g) in dx.iter_mut().zip(y).zip(g) {
                *dx = T::of(y.f32() * (g.f32() - dot));
            }
        });
    dx
}
