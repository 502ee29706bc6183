//! RMS and layer normalisation over the last dimension, with a fused backward.
//!
//! On the CPU the forward is one custom op that normalises each row in one task (rows spread
//! over rayon's threads); its backward is a second custom op that recomputes the row's
//! statistics from `x` and writes the input's gradient row by row, while each of a fixed number
//! of row blocks sums its share of the weight gradients in f32 (the blocks' sums are added at the
//! end, so the result does not depend on the number of threads). Elsewhere the same maths is
//! composed of candle ops, whose backward candle records.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use super::elem::{self, Elem};

/// The number of row blocks whose weight-gradient sums the backward adds at the end.
const WEIGHT_GRAD_BLOCKS: usize = 64;

/// The fewest rows one rayon task takes in the forward, so that short rows are not one task each.
fn min_rows(d: usize) -> usize {
    (4096 / d.max(1)).max(1)
}

/// RMS-normalises `x` over its last dimension and scales by `alpha`: `x / sqrt(mean(x²) + eps) * alpha`.
///
/// The values are those of `candle_nn::ops::rms_norm`; unlike it, this records a backward pass,
/// giving the gradients of `x` and `alpha`. `x` is f32, bf16 or f16, `alpha` has the same dtype
/// and the shape `(d,)`, `d` being `x`'s last dimension; the arithmetic is f32. Second
/// derivatives are not recorded.
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::new(&[[3f32, 4.], [1., 1.]], &Device::Cpu)?;
/// let alpha = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let y = ivme::nn::rms_norm(&x, &alpha, 0.)?;
/// let y = y.to_vec2::<f32>()?;
/// assert!((y[1][1] - 2.).abs() < 1e-6);
/// # Ok(())
/// # }
/// ```
pub fn rms_norm(x: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
    const OP: &str = "rms_norm";
    check_dtype(OP, x.dtype())?;
    check_weight(OP, "alpha", x, alpha)?;
    if x.device().is_cpu() {
        let x = x.contiguous()?;
        let alpha = alpha.contiguous()?;
        x.apply_op2(&alpha, RmsNorm { eps })
    } else {
        rms_norm_composed(x, alpha, eps)
    }
}

/// Layer-normalises `x` over its last dimension: `(x - mean) / sqrt(var + eps) * alpha + beta`.
///
/// The values are those of `candle_nn::ops::layer_norm` (with `beta` `None`, no shift); unlike
/// it, this records a backward pass, giving the gradients of `x`, `alpha` and `beta`. `x` is f32,
/// bf16 or f16, `alpha` and `beta` have the same dtype and the shape `(d,)`, `d` being `x`'s last
/// dimension; `var` is the biased variance and the arithmetic is f32. Second derivatives are not
/// recorded.
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::new(&[[1f32, 3.]], &Device::Cpu)?;
/// let alpha = Tensor::new(&[1f32, 1.], &Device::Cpu)?;
/// let beta = Tensor::new(&[0f32, 10.], &Device::Cpu)?;
/// let y = ivme::nn::layer_norm(&x, &alpha, Some(&beta), 0.)?.to_vec2::<f32>()?;
/// assert!((y[0][0] + 1.).abs() < 1e-6 && (y[0][1] - 11.).abs() < 1e-6);
/// # Ok(())
/// # }
/// ```
pub fn layer_norm(x: &Tensor, alpha: &Tensor, beta: Option<&Tensor>, eps: f32) -> Result<Tensor> {
    const OP: &str = "layer_norm";
    check_dtype(OP, x.dtype())?;
    check_weight(OP, "alpha", x, alpha)?;
    if let Some(beta) = beta {
        check_weight(OP, "beta", x, beta)?;
    }
    if x.device().is_cpu() {
        let x = x.contiguous()?;
        let alpha = alpha.contiguous()?;
        match beta {
            Some(beta) => x.apply_op3(&alpha, &beta.contiguous()?, LayerNorm { eps }),
            None => x.apply_op2(&alpha, LayerNorm { eps }),
        }
    } else {
        layer_norm_composed(x, alpha, beta, eps)
    }
}

/// [`rms_norm`] composed of candle ops (its form off the CPU, and the tests' reference).
#[doc(hidden)]
pub fn rms_norm_composed(x: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let mean_sq = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (mean_sq + eps as f64)?.sqrt()?.recip()?;
    x.broadcast_mul(&inv)?
        .broadcast_mul(&alpha.to_dtype(DType::F32)?)?
        .to_dtype(dtype)
}

/// [`layer_norm`] composed of candle ops (its form off the CPU, and the tests' reference).
#[doc(hidden)]
pub fn layer_norm_composed(
    x: &Tensor,
    alpha: &Tensor,
    beta: Option<&Tensor>,
    eps: f32,
) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (var + eps as f64)?.sqrt()?.recip()?;
    let y = centred
        .broadcast_mul(&inv)?
        .broadcast_mul(&alpha.to_dtype(DType::F32)?)?;
    let y = match beta {
        Some(beta) => y.broadcast_add(&beta.to_dtype(DType::F32)?)?,
        None => y,
    };
    y.to_dtype(dtype)
}

/// An error unless `dtype` is one the kernels take.
fn check_dtype(op: &str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(()),
        _ => Err(elem::unsupported(op, dtype)),
    }
}

/// An error unless `w` is `(d,)` for `x`'s last dimension `d`, of `x`'s dtype and device.
fn check_weight(op: &str, name: &str, x: &Tensor, w: &Tensor) -> Result<()> {
    let d = match x.dims().last() {
        Some(&d) => d,
        None => {
            candle_core::bail!("ivme::nn::{op}: x must have at least one dimension, got a scalar")
        }
    };
    if w.dims() != [d] {
        candle_core::bail!(
            "ivme::nn::{op}: {name} has shape {:?}, expected [{d}] (the last dimension of x, of shape {:?})",
            w.dims(),
            x.dims()
        )
    }
    if w.dtype() != x.dtype() {
        candle_core::bail!(
            "ivme::nn::{op}: {name} is {:?} but x is {:?}; they must have the same dtype",
            w.dtype(),
            x.dtype()
        )
    }
    if !w.device().same_device(x.device()) {
        candle_core::bail!("ivme::nn::{op}: {name} and x are on different devices")
    }
    Ok(())
}

/// The error for storages of mixed or unsupported dtypes (the public functions rule both out).
fn dtype_error(op: &str, storages: &[&CpuStorage]) -> candle_core::Error {
    let first = elem::dtype_of(storages[0]);
    if storages.iter().all(|s| elem::dtype_of(s) == first) {
        elem::unsupported(op, first)
    } else {
        let dtypes: Vec<DType> = storages.iter().map(|s| elem::dtype_of(s)).collect();
        candle_core::Error::Msg(format!(
            "ivme::nn::{op}: inputs of mixed dtypes {dtypes:?}; they must have the same dtype"
        ))
    }
}

/// Calls `$body` with the slices of two or three CPU storages of one supported dtype bound to
/// the given names.
macro_rules! with_slices {
    ($op:expr, ($s1:expr, $s2:expr), |$a:ident, $b:ident| $body:expr) => {
        match ($s1, $s2) {
            (CpuStorage::F32($a), CpuStorage::F32($b)) => $body,
            (CpuStorage::BF16($a), CpuStorage::BF16($b)) => $body,
            (CpuStorage::F16($a), CpuStorage::F16($b)) => $body,
            (s1, s2) => Err(dtype_error($op, &[s1, s2])),
        }
    };
    ($op:expr, ($s1:expr, $s2:expr, $s3:expr), |$a:ident, $b:ident, $c:ident| $body:expr) => {
        match ($s1, $s2, $s3) {
            (CpuStorage::F32($a), CpuStorage::F32($b), CpuStorage::F32($c)) => $body,
            (CpuStorage::BF16($a), CpuStorage::BF16($b), CpuStorage::BF16($c)) => $body,
            (CpuStorage::F16($a), CpuStorage::F16($b), CpuStorage::F16($c)) => $body,
            (s1, s2, s3) => Err(dtype_error($op, &[s1, s2, s3])),
        }
    };
}

/// The last dimension of a layout (1 for a scalar, which the public functions rule out).
fn last_dim(layout: &Layout) -> usize {
    layout.dims().last().copied().unwrap_or(1)
}

/// Wraps a kernel's output as a storage of `shape`.
fn output<T: candle_core::WithDType>(v: Vec<T>, shape: Shape) -> Result<(CpuStorage, Shape)> {
    Ok((T::to_cpu_storage_owned(v), shape))
}

mod layer;
mod rms;

use layer::LayerNorm;
use rms::RmsNorm;

// ---------------------------------------------------------------------------------------------
// Shared by the kernels

/// The sums over `i < n` of each of the `K` terms `term(i)`, each kept in 8 lanes added at the
/// end: closer to the exact sum than one running sum (the error grows with `n / 8`, not `n`),
/// and open to vectorisation.
#[inline(always)]
pub(super) fn row_sums<const K: usize>(n: usize, term: impl Fn(usize) -> [f32; K]) -> [f32; K] {
    const LANES: usize = 8;
    let mut lanes = [[0f32; LANES]; K];
    let full = n - n % LANES;
    for start in (0..full).step_by(LANES) {
        for (l, i) in (start..start + LANES).enumerate() {
            for (lane, t) in lanes.iter_mut().zip(term(i)) {
                lane[l] += t;
            }
        }
    }
    let mut sums = lanes.map(|lane| {
        let [a, b, c, d, e, f, g, h] = lane;
        ((a + b) + (c + d)) + ((e + f) + (g + h))
    });
    for i in full..n {
        for (s, t) in sums.iter_mut().zip(term(i)) {
            *s += t;
        }
    }
    sums
}

/// Splits the `rows` rows of `dst` (`d` wide) into at most [`WEIGHT_GRAD_BLOCKS`] blocks run in
/// parallel: `f(first_row, block, acc)` writes a block and adds its rows' weight-gradient terms
/// to `acc` (`width` f32 zeros); returns the blocks' `acc`s summed in f32.
fn by_row_blocks<T: Send>(
    rows: usize,
    d: usize,
    dst: &mut [T],
    width: usize,
    f: impl Fn(usize, &mut [T], &mut [f32]) + Sync,
) -> Vec<f32> {
    let mut total = vec![0f32; width];
    if rows == 0 || d == 0 {
        return total;
    }
    let per_block = rows.div_ceil(WEIGHT_GRAD_BLOCKS);
    let partials: Vec<Vec<f32>> = dst
        .par_chunks_mut(per_block * d)
        .enumerate()
        .map(|(i, block)| {
            let mut acc = vec![0f32; width];
            f(i * per_block, block, &mut acc);
            acc
        })
        .collect();
    for acc in partials {
        for (t, v) in total.iter_mut().zip(acc) {
            *t += v;
        }
    }
    total
}

/// Splits a backward kernel's `(rows + n, d)` output into `dx` (shaped like `x`) and the `n`
/// weight gradients `(d,)`.
fn unpack(packed: &Tensor, x: &Tensor, n: usize) -> Result<(Tensor, Vec<Tensor>)> {
    let (rows_n, d) = packed.dims2()?;
    let rows = rows_n - n;
    let dx = packed.narrow(0, 0, rows)?.reshape(x.shape())?;
    let dw = (0..n)
        .map(|i| packed.narrow(0, rows + i, 1)?.reshape(d))
        .collect::<Result<Vec<_>>>()?;
    Ok((dx, dw))
}
