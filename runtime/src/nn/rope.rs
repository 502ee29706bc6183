//! Rotary position embeddings in candle-nn's three layouts, with a fused backward.
//!
//! Each pair of elements `(x1, x2)` of a row is rotated by the angle whose cosine and sine the
//! tables hold for the row's position: `(x1·cos - x2·sin, x1·sin + x2·cos)`. A rotation's
//! transpose is the rotation by the opposite angle, so the backward is the same kernel run on the
//! incoming gradient with the sine negated. On the CPU both are one custom op, one task per group
//! of rows spread over rayon's threads; elsewhere the same maths is composed of candle ops.

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::elem::{self, Elem};

/// Where the pairs and the position lie in `x`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// `(b, h, t, d)`, pairs `(i, i + d/2)`.
    Half,
    /// `(b, h, t, d)`, pairs `(2i, 2i + 1)`.
    Interleaved,
    /// `(b, t, h, d)`, pairs `(i, i + d/2)`.
    HalfThd,
}

impl Variant {
    fn op(self) -> &'static str {
        match self {
            Variant::Half => "rope",
            Variant::Interleaved => "rope_i",
            Variant::HalfThd => "rope_thd",
        }
    }

    /// The sequence length of an `x` of dims `(b, n1, n2, d)`.
    fn seq_len(self, (_, n1, n2, _): (usize, usize, usize, usize)) -> usize {
        match self {
            Variant::HalfThd => n1,
            _ => n2,
        }
    }
}

/// Rotary embedding, half-split layout: `x` is `(b, h, t, d)`, `cos`/`sin` are `(t, d/2)`.
///
/// Element `i < d/2` of each row is paired with element `i + d/2`. The values are those of
/// `candle_nn::rotary_emb::rope`: `cos`/`sin` may also be `(b, t, d/2)` (one table per batch
/// element), and may hold more positions than `t`, of which the first `t` are used. Unlike
/// candle-nn's, this records a backward pass giving the gradient of `x`; `cos` and `sin` are
/// taken as constant tables and get no gradient (`None`), even when they are variables. `x`,
/// `cos` and `sin` share one dtype among f32, bf16 and f16; the arithmetic is f32.
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::new(&[1f32, 0.], &Device::Cpu)?.reshape((1, 1, 1, 2))?;
/// let (cos, sin) = (Tensor::new(&[[0f32]], &Device::Cpu)?, Tensor::new(&[[1f32]], &Device::Cpu)?);
/// let y = ivme::nn::rope(&x, &cos, &sin)?.flatten_all()?.to_vec1::<f32>()?;
/// assert_eq!(y, [0., 1.]); // a quarter turn
/// # Ok(())
/// # }
/// ```
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    apply(x, cos, sin, Variant::Half)
}

/// Rotary embedding, interleaved layout: `x` is `(b, h, t, d)`, `cos`/`sin` are `(t, d/2)`.
///
/// Element `2i` of each row is paired with element `2i + 1`. The values are those of
/// `candle_nn::rotary_emb::rope_i`; the tables' shapes, dtypes and gradients are as for [`rope`]
/// (`cos` and `sin` are constants and get no gradient).
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::new(&[1f32, 0.], &Device::Cpu)?.reshape((1, 1, 1, 2))?;
/// let (cos, sin) = (Tensor::new(&[[0f32]], &Device::Cpu)?, Tensor::new(&[[-1f32]], &Device::Cpu)?);
/// let y = ivme::nn::rope_i(&x, &cos, &sin)?.flatten_all()?.to_vec1::<f32>()?;
/// assert_eq!(y, [0., -1.]);
/// # Ok(())
/// # }
/// ```
pub fn rope_i(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    apply(x, cos, sin, Variant::Interleaved)
}

/// Rotary embedding, half-split layout over `(b, t, h, d)`; `cos`/`sin` are `(t, d/2)`.
///
/// The values are those of `candle_nn::rotary_emb::rope_thd`; the tables' shapes, dtypes and
/// gradients are as for [`rope`] (`cos` and `sin` are constants and get no gradient).
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::ones((1, 3, 2, 4), candle_core::DType::F32, &Device::Cpu)?;
/// let cos = Tensor::ones((3, 2), candle_core::DType::F32, &Device::Cpu)?;
/// let sin = cos.zeros_like()?;
/// let y = ivme::nn::rope_thd(&x, &cos, &sin)?; // no rotation
/// assert_eq!(y.sum_all()?.to_scalar::<f32>()?, 24.);
/// # Ok(())
/// # }
/// ```
pub fn rope_thd(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    apply(x, cos, sin, Variant::HalfThd)
}

/// [`rope`] composed of candle ops (its form off the CPU, and the tests' reference).
#[doc(hidden)]
pub fn rope_composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    composed(x, cos, sin, Variant::Half)
}

/// [`rope_i`] composed of candle ops (its form off the CPU, and the tests' reference).
#[doc(hidden)]
pub fn rope_i_composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    composed(x, cos, sin, Variant::Interleaved)
}

/// [`rope_thd`] composed of candle ops (its form off the CPU, and the tests' reference).
#[doc(hidden)]
pub fn rope_thd_composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    composed(x, cos, sin, Variant::HalfThd)
}

/// Checks the shapes and dtypes, then runs the fused op on the CPU or the composed one elsewhere.
fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor, variant: Variant) -> Result<Tensor> {
    check(x, cos, sin, variant)?;
    if x.device().is_cpu() {
        let t = variant.seq_len(x.dims4()?);
        let x = x.contiguous()?;
        // Detached: candle's backward expects a gradient for every tracked input of an op, and
        // the tables get none.
        let cos = table(&cos.detach(), t)?.contiguous()?;
        let sin = table(&sin.detach(), t)?.contiguous()?;
        x.apply_op3(
            &cos,
            &sin,
            Rope {
                variant,
                inverse: false,
            },
        )
    } else {
        match variant {
            Variant::Half => rope_composed(x, cos, sin),
            Variant::Interleaved => rope_i_composed(x, cos, sin),
            Variant::HalfThd => rope_thd_composed(x, cos, sin),
        }
    }
}

/// The first `t` positions of a `(t', d/2)` or `(b, t', d/2)` table.
fn table(cs: &Tensor, t: usize) -> Result<Tensor> {
    cs.narrow(cs.rank() - 2, 0, t)
}

/// An error unless `x` is 4-d with an even last dim `d`, and `cos`/`sin` are `(t', d/2)` or
/// `(b, t', d/2)` with `t' ≥ t`, all of one supported dtype on one device.
fn check(x: &Tensor, cos: &Tensor, sin: &Tensor, variant: Variant) -> Result<()> {
    let op = variant.op();
    let layout = if variant == Variant::HalfThd {
        "(b, t, h, d)"
    } else {
        "(b, h, t, d)"
    };
    let dims = match *x.dims() {
        [b, n1, n2, d] => (b, n1, n2, d),
        _ => candle_core::bail!(
            "ivme::nn::{op}: x must be {layout}, got shape {:?}",
            x.dims()
        ),
    };
    let (b, _, _, d) = dims;
    let t = variant.seq_len(dims);
    match x.dtype() {
        DType::F32 | DType::BF16 | DType::F16 => {}
        dtype => return Err(elem::unsupported(op, dtype)),
    }
    for (name, cs) in [("cos", cos), ("sin", sin)] {
        let ok = d % 2 == 0
            && match *cs.dims() {
                [tc, h] => tc >= t && h * 2 == d,
                [bc, tc, h] => bc == b && tc >= t && h * 2 == d,
                _ => false,
            };
        if !ok {
            candle_core::bail!(
                "ivme::nn::{op}: {name} has shape {:?}; for x of shape {:?} {layout} it must be \
                 (t', d/2) or (b, t', d/2) with t' >= t = {t}, d/2 = {} and b = {b} (d even)",
                cs.dims(),
                x.dims(),
                d as f64 / 2.
            )
        }
        if cs.dtype() != x.dtype() {
            candle_core::bail!(
                "ivme::nn::{op}: {name} is {:?} but x is {:?}; they must have the same dtype",
                cs.dtype(),
                x.dtype()
            )
        }
        if !cs.device().same_device(x.device()) {
            candle_core::bail!("ivme::nn::{op}: {name} and x are on different devices")
        }
    }
    if cos.dims() != sin.dims() {
        candle_core::bail!(
            "ivme::nn::{op}: cos has shape {:?} but sin has shape {:?}",
            cos.dims(),
            sin.dims()
        )
    }
    Ok(())
}

/// The composed form: the pairs split out with `narrow`, rotated in f32, put back with `cat`.
fn composed(x: &Tensor, cos: &Tensor, sin: &Tensor, variant: Variant) -> Result<Tensor> {
    let dtype = x.dtype();
    let dims = x.dims4()?;
    let (b, n1, n2, d) = dims;
    let (t, half) = (variant.seq_len(dims), d / 2);
    // The tables as constants broadcastable against the pairs' halves.
    let shape_of = |cs: &Tensor| -> Result<Tensor> {
        let cs = table(&cs.detach(), t)?.to_dtype(DType::F32)?;
        let bc = if cs.rank() == 3 { b } else { 1 };
        match variant {
            Variant::Half => cs.reshape((bc, 1, t, half)),
            Variant::Interleaved => cs.reshape((bc, 1, t, half, 1)),
            Variant::HalfThd => cs.reshape((bc, t, 1, half)),
        }
    };
    let (cos, sin) = (shape_of(cos)?, shape_of(sin)?);
    let x = x.to_dtype(DType::F32)?;
    let (x, last) = match variant {
        Variant::Interleaved => (x.reshape((b, n1, n2, half, 2))?, 4),
        _ => (x.reshape((b, n1, n2, 2, half))?.transpose(3, 4)?, 4),
    };
    // `x` is now (.., half, 2): the pairs' halves are its last dimension's two entries.
    let x1 = x.narrow(last, 0, 1)?;
    let x2 = x.narrow(last, 1, 1)?;
    let (cos, sin) = match variant {
        Variant::Interleaved => (cos, sin),
        _ => (cos.unsqueeze(4)?, sin.unsqueeze(4)?),
    };
    let y1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let y2 = (x1.broadcast_mul(&sin)? + x2.broadcast_mul(&cos)?)?;
    let y = Tensor::cat(&[y1, y2], last)?;
    let y = match variant {
        Variant::Interleaved => y,
        _ => y.transpose(3, 4)?,
    };
    y.reshape((b, n1, n2, d))?.to_dtype(dtype)
}

/// The fused rotation: `x`, `cos`, `sin` → `y`; `inverse` rotates by the opposite angles (the
/// backward).
struct Rope {
    variant: Variant,
    inverse: bool,
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        match (self.variant, self.inverse) {
            (Variant::Half, false) => "ivme-rope",
            (Variant::Half, true) => "ivme-rope-bwd",
            (Variant::Interleaved, false) => "ivme-rope-i",
            (Variant::Interleaved, true) => "ivme-rope-i-bwd",
            (Variant::HalfThd, false) => "ivme-rope-thd",
            (Variant::HalfThd, true) => "ivme-rope-thd-bwd",
        }
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.variant.op();
        let kernel = Kernel {
            dims: l1.shape().dims4()?,
            batched: l2.dims().len() == 3,
            variant: self.variant,
            inverse: self.inverse,
        };
        let shape = l1.shape().clone();
        match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(c), CpuStorage::F32(s)) => {
                let (x, c, s) = slices(op, (x, l1), (c, l2), (s, l3))?;
                Ok((CpuStorage::F32(kernel.run(x, c, s)), shape))
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(c), CpuStorage::BF16(s)) => {
                let (x, c, s) = slices(op, (x, l1), (c, l2), (s, l3))?;
                Ok((CpuStorage::BF16(kernel.run(x, c, s)), shape))
            }
            (CpuStorage::F16(x), CpuStorage::F16(c), CpuStorage::F16(s)) => {
                let (x, c, s) = slices(op, (x, l1), (c, l2), (s, l3))?;
                Ok((CpuStorage::F16(kernel.run(x, c, s)), shape))
            }
            (x, c, s) => {
                let dtypes = [elem::dtype_of(x), elem::dtype_of(c), elem::dtype_of(s)];
                if dtypes.iter().all(|&t| t == dtypes[0]) {
                    Err(elem::unsupported(op, dtypes[0]))
                } else {
                    candle_core::bail!("ivme::nn::{op}: x, cos, sin of mixed dtypes {dtypes:?}")
                }
            }
        }
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let back = Rope {
            variant: self.variant,
            inverse: !self.inverse,
        };
        let dx = grad.contiguous()?.apply_op3_no_bwd(cos, sin, &back)?;
        // The tables are constants: no gradient for them.
        Ok((Some(dx), None, None))
    }
}

/// The contiguous slices of the three inputs.
fn slices<'a, T>(
    op: &str,
    x: (&'a [T], &Layout),
    c: (&'a [T], &Layout),
    s: (&'a [T], &Layout),
) -> Result<(&'a [T], &'a [T], &'a [T])> {
    Ok((
        elem::contiguous(x.0, x.1, op)?,
        elem::contiguous(c.0, c.1, op)?,
        elem::contiguous(s.0, s.1, op)?,
    ))
}

/// One rotation's geometry.
struct Kernel {
    dims: (usize, usize, usize, usize),
    batched: bool,
    variant: Variant,
    inverse: bool,
}

impl Kernel {
    fn run<T: Elem>(&self, x: &[T], cos: &[T], sin: &[T]) -> Vec<T> {
        let (_, n1, n2, d) = self.dims;
        let mut y = vec![T::of(0.); x.len()];
        if d == 0 {
            return y;
        }
        let half = d / 2;
        let t = self.variant.seq_len(self.dims);
        let sign = if self.inverse { -1f32 } else { 1f32 };
        let (variant, batched) = (self.variant, self.batched);
        y.par_chunks_mut(d)
            .zip(x.par_chunks(d))
            .enumerate()
            .with_min_len((4096 / d).max(1))
            .for_each(|(row, (y, x))| {
                // The row's batch element and position.
                let (bi, ti) = match variant {
                    Variant::HalfThd => (row / (n1 * n2), (row / n2) % n1),
                    _ => (row / (n1 * n2), row % n2),
                };
                let off = if batched { bi * t * half } else { 0 } + ti * half;
                let (cos, sin) = (&cos[off..off + half], &sin[off..off + half]);
                for (i, (c, s)) in cos.iter().zip(sin).enumerate() {
                    let (c, s) = (c.f32(), sign * s.f32());
                    let (i1, i2) = match variant {
                        Variant::Interleaved => (2 * i, 2 * i + 1),
                        _ => (i, i + half),
                    };
                    let (x1, x2) = (x[i1].f32(), x[i2].f32());
                    y[i1] = T::of(x1 * c - x2 * s);
                    y[i2] = T::of(x1 * s + x2 * c);
                }
            });
        y
    }
}
