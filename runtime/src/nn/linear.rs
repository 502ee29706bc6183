//! A linear layer's product `x · Wᵀ` as one op, with a backward that writes both gradients.
//!
//! candle-nn's `Linear` is three graph nodes around the product: `x` reshaped to rows, `W`
//! transposed, the result reshaped back. candle's backward gives each node a zero-filled
//! gradient tensor and adds its input's gradient into it, so every linear layer costs, per
//! backward, two activation-sized zero fills and additions and a weight-sized one whose addend
//! is the transposed product (a strided addition, not vectorised). On the CPU this op reads
//! `x` and `W` where they lie (any evenly strided rows, `W` row-major) and runs gemm once
//! forward and twice backward (`dx = dy · W`, `dW = dyᵀ · x`), each product writing its own
//! output, which is never zero-filled first; bf16 and f16 are widened to f32 only over the
//! elements the product reads, in parallel, and the results rounded once. Elsewhere the same
//! product is composed of candle ops.

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::elem::{self, Elem};
use super::rows::Rows;

const OP: &str = "linear";

/// `x · weightᵀ (+ bias)`: `x` is `(.., in)`, `weight` `(out, in)`, `bias` `(out)`; the
/// result is `(.., out)`.
///
/// The values are those of `candle_nn::Linear` (f32: gemm's, summed in the same kernel; bf16
/// and f16: computed in f32 and rounded once, as candle's CPU product does). `x`, `weight`
/// and `bias` share a dtype (f32, bf16 or f16) and get gradients (not second derivatives).
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
/// let w = Tensor::new(&[[1f32, 0.], [1., 1.], [0., 2.]], &Device::Cpu)?;
/// let y = ivme::nn::linear(&x, &w, None)?;
/// assert_eq!(y.to_vec2::<f32>()?, [[1., 3., 4.], [3., 7., 8.]]);
/// # Ok(())
/// # }
/// ```
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    check(x, weight, bias)?;
    if !x.device().is_cpu() {
        return linear_composed(x, weight, bias);
    }
    let x = if Rows::of(x.layout()).is_some() {
        x.clone()
    } else {
        x.contiguous()?
    };
    let y = x.apply_op2(&weight.contiguous()?, Linear)?;
    match bias {
        None => Ok(y),
        Some(b) => y.broadcast_add(b),
    }
}

/// [`linear`] composed of candle ops, as `candle_nn::Linear` computes it (its form off the
/// CPU, and the tests' reference).
#[doc(hidden)]
pub fn linear_composed(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    check(x, weight, bias)?;
    let layer = candle_nn::Linear::new(weight.clone(), bias.cloned());
    // candle's batched product refuses some strided batches: copy those first.
    let x = &x.contiguous()?;
    if x.rank() == 1 {
        // candle-nn's layer takes rows: a vector is one.
        return candle_core::Module::forward(&layer, &x.unsqueeze(0)?)?.squeeze(0);
    }
    candle_core::Module::forward(&layer, x)
}

/// A product's weight as `(out, in)`, refusing a weight that is not a matrix or an `x` whose
/// last dimension is not `in` (for `op`'s messages; `out` names the weight's rows there).
pub(super) fn weight_dims(
    op: &str,
    out: &str,
    x: &Tensor,
    weight: &Tensor,
) -> Result<(usize, usize)> {
    let (o, inp) = match weight.dims() {
        &[o, i] => (o, i),
        d => candle_core::bail!("ivme::nn::{op}: weight must be ({out}, in), got shape {d:?}"),
    };
    if x.dims().last() != Some(&inp) {
        candle_core::bail!(
            "ivme::nn::{op}: x of shape {:?} does not end in the weight's input size {inp} (weight {:?})",
            x.dims(),
            weight.dims()
        )
    }
    Ok((o, inp))
}

fn check(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<()> {
    let (out, _) = weight_dims(OP, "out", x, weight)?;
    if let Some(b) = bias {
        if b.dims() != [out] {
            candle_core::bail!(
                "ivme::nn::{OP}: bias has shape {:?}, expected [{out}] (weight {:?})",
                b.dims(),
                weight.dims()
            )
        }
    }
    let dtype = x.dtype();
    let others = [Some(weight), bias];
    if others.iter().flatten().any(|t| t.dtype() != dtype) {
        candle_core::bail!(
            "ivme::nn::{OP}: x ({dtype:?}), weight ({:?}) and bias ({:?}) must share a dtype",
            weight.dtype(),
            bias.map(|b| b.dtype())
        )
    }
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(elem::unsupported(OP, dtype));
    }
    if others
        .iter()
        .flatten()
        .any(|t| !t.device().same_device(x.device()))
    {
        candle_core::bail!("ivme::nn::{OP}: x, weight and bias are on different devices")
    }
    Ok(())
}

/// An f32 matrix in memory: element `(r, c)` at `ptr + r * rs + c * cs`.
#[derive(Clone, Copy)]
pub(super) struct Mat {
    ptr: *const f32,
    rs: isize,
    cs: isize,
}

impl Mat {
    /// A dense row-major matrix of `cols` columns starting at `data`'s first element.
    pub(super) fn dense(data: &[f32], cols: usize) -> Mat {
        Mat {
            ptr: data.as_ptr(),
            rs: cols as isize,
            cs: 1,
        }
    }

    pub(super) fn t(self) -> Mat {
        Mat {
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
}

/// `dst (m × n, row-major, every element written) = a (m × k) · b (k × n)`.
///
/// # Safety
/// `dst` holds `m × n` elements and `a`, `b` reach only elements of live f32 slices that
/// `dst` does not overlap.
unsafe fn product(dst: &mut [MaybeUninit<f32>], dims: [usize; 3], a: Mat, b: Mat) {
    debug_assert!(dst.len() >= dims[0] * dims[1]);
    if dims[2] == 0 {
        dst[..dims[0] * dims[1]].fill(MaybeUninit::new(0.));
        return;
    }
    gemm_into(dst.as_mut_ptr().cast::<f32>(), dims, a, b, false)
}

/// `dst (m × n, row-major) = a · b`, or `dst += a · b` when `acc`.
///
/// # Safety
/// As [`product`]'s.
pub(super) unsafe fn product_into(dst: &mut [f32], dims: [usize; 3], a: Mat, b: Mat, acc: bool) {
    assert!(dst.len() >= dims[0] * dims[1]);
    if dims[2] == 0 {
        if !acc {
            dst[..dims[0] * dims[1]].fill(0.);
        }
        return;
    }
    gemm_into(dst.as_mut_ptr(), dims, a, b, acc)
}

/// gemm on all of rayon's threads: `dst = a·b`, or `dst += a·b` when `acc` (only then is
/// `dst` read).
///
/// # Safety
/// As [`product`]'s, `k > 0`.
unsafe fn gemm_into(dst: *mut f32, [m, n, k]: [usize; 3], a: Mat, b: Mat, acc: bool) {
    if m == 0 || n == 0 {
        return;
    }
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        n as isize,
        acc,
        a.ptr,
        a.cs,
        a.rs,
        b.ptr,
        b.cs,
        b.rs,
        if acc { 1f32 } else { 0f32 },
        1f32,
        false,
        false,
        false,
        parallelism,
    )
}

/// An input as f32 rows: the f32 storage where it lies, or the rows widened into a new
/// dense buffer (in parallel).
pub(super) enum Wide<'a> {
    InPlace(&'a [f32], Rows),
    Widened(Vec<f32>, Rows),
}

impl Wide<'_> {
    pub(super) fn mat(&self) -> Mat {
        let (data, r): (&[f32], &Rows) = match self {
            Wide::InPlace(d, r) => (d, r),
            Wide::Widened(d, r) => (d, r),
        };
        assert!(r.rows == 0 || r.start + (r.rows - 1) * r.stride + r.width <= data.len());
        Mat {
            // SAFETY: `start` lies within the slice (checked above, or the slice is empty and
            // `start` is 0).
            ptr: unsafe { data.as_ptr().add(r.start.min(data.len())) },
            rs: r.stride as isize,
            cs: 1,
        }
    }
}

pub(super) fn wide<'a, T: Elem>(data: &'a [T], rows: Rows) -> Wide<'a> {
    if let Some(f) = as_f32(data) {
        return Wide::InPlace(f, rows);
    }
    let v = super::rows::write_rows(rows.rows, rows.width, |r, out| {
        for (o, x) in out.iter_mut().zip(rows.row(data, r)) {
            o.write(x.f32());
        }
    });
    let dense = Rows::dense(rows.rows, rows.width);
    Wide::Widened(v, dense)
}

/// `data` as f32 when `T` is f32.
fn as_f32<T: Elem>(data: &[T]) -> Option<&[f32]> {
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>()).then(|| {
        // SAFETY: `T` is `f32` (same type id), so the slice's elements are f32.
        unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<f32>(), data.len()) }
    })
}

/// A result of `n` elements written by `f` as f32: in place for f32, else through an f32
/// buffer rounded to `T` in parallel.
fn written<T: Elem>(n: usize, f: impl FnOnce(&mut [MaybeUninit<f32>])) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(n);
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() {
        // SAFETY: `T` is `f32`; the spare capacity holds `n` elements.
        let spare = unsafe {
            std::slice::from_raw_parts_mut(
                out.spare_capacity_mut()
                    .as_mut_ptr()
                    .cast::<MaybeUninit<f32>>(),
                n,
            )
        };
        f(spare);
        // SAFETY: `f` wrote all `n` elements (every caller's products cover their output).
        unsafe { out.set_len(n) };
        return out;
    }
    let mut buf: Vec<f32> = Vec::with_capacity(n);
    f(&mut buf.spare_capacity_mut()[..n]);
    // SAFETY: as above.
    unsafe { buf.set_len(n) };
    out.spare_capacity_mut()[..n]
        .par_chunks_mut(16_384)
        .zip(buf.par_chunks(16_384))
        .for_each(|(o, b)| {
            for (o, &b) in o.iter_mut().zip(b) {
                o.write(T::of(b));
            }
        });
    // SAFETY: every element was written by the loop above.
    unsafe { out.set_len(n) };
    out
}

/// The forward op: `x` `(.., in)`, `weight` `(out, in)` → `(.., out)`.
struct Linear;

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "ivme-linear"
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
        let mut dims = l1.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = rw.rows;
        }
        use CpuStorage::{BF16, F16, F32};
        let out = match (s1, s2) {
            (F32(x), F32(w)) => F32(fwd(x, rx, w, rw)),
            (BF16(x), BF16(w)) => BF16(fwd(x, rx, w, rw)),
            (F16(x), F16(w)) => F16(fwd(x, rx, w, rw)),
            _ => return Err(elem::mixed(OP, &[s1, s2])),
        };
        Ok((out, Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = if Rows::of(grad.layout()).is_some() {
            grad.clone()
        } else {
            grad.contiguous()?
        };
        if let Some(dw) = super::grad_sink::buffer_for(weight) {
            // ivme runs this backward: `dW` goes to the weight's f32 buffer, not the store.
            let dx = x.apply_op3_no_bwd(weight, &grad, &LinearBwd { dw: Some(dw) })?;
            return Ok((Some(dx.reshape(x.shape())?), None));
        }
        let packed = x.apply_op3_no_bwd(weight, &grad, &LinearBwd { dw: None })?;
        let (nx, nw) = (x.elem_count(), weight.elem_count());
        let dx = packed.narrow(0, 0, nx)?.reshape(x.shape())?;
        let dw = packed.narrow(0, nx, nw)?.reshape(weight.shape())?;
        Ok((Some(dx), Some(dw)))
    }
}

fn fwd<T: Elem>(x: &[T], rx: Rows, w: &[T], rw: Rows) -> Vec<T> {
    let (n, k, o) = (rx.rows, rx.width, rw.rows);
    let (x, w) = (wide(x, rx), wide(w, rw));
    written(n * o, |dst| {
        // SAFETY: `x` is n × k and `w` o × k inside their slices (`Wide::mat` checks), `dst`
        // is a fresh buffer of n × o.
        unsafe { product(dst, [n, o, k], x.mat(), w.mat().t()) }
    })
}

/// The backward op: `x`, `weight`, the output's gradient → `dx` then `dW`, flat; or, while
/// ivme runs the backward, `dx` alone, with `dW` written into (after the weight's first use,
/// added to) the weight's f32 buffer (`grad_sink.rs`).
struct LinearBwd {
    dw: Option<super::grad_sink::Buffer>,
}

impl CustomOp3 for LinearBwd {
    fn name(&self) -> &'static str {
        "ivme-linear-bwd"
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
        let rx = Rows::of_op(l1, OP, "x")?;
        let rw = Rows::of_op(l2, OP, "weight")?;
        let rd = Rows::of_op(l3, OP, "the output's gradient")?;
        let mut sink = self
            .dw
            .as_ref()
            .map(|b| b.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        let len = rx.rows * rx.width
            + if sink.is_some() {
                0
            } else {
                rw.rows * rw.width
            };
        let dw = sink.as_deref_mut();
        use CpuStorage::{BF16, F16, F32};
        let out = match (s1, s2, s3) {
            (F32(x), F32(w), F32(d)) => F32(bwd(x, rx, w, rw, d, rd, dw)),
            (BF16(x), BF16(w), BF16(d)) => BF16(bwd(x, rx, w, rw, d, rd, dw)),
            (F16(x), F16(w), F16(d)) => F16(bwd(x, rx, w, rw, d, rd, dw)),
            _ => return Err(elem::mixed(OP, &[s1, s2, s3])),
        };
        Ok((out, Shape::from(len)))
    }
}

/// `dx`, then `dW` unless `sink` takes it: empty (then o × k are reserved and every one
/// written) or holding the weight's gradient from an earlier use (then added to).
fn bwd<T: Elem>(
    x: &[T],
    rx: Rows,
    w: &[T],
    rw: Rows,
    d: &[T],
    rd: Rows,
    sink: Option<&mut Vec<f32>>,
) -> Vec<T> {
    let (n, k, o) = (rx.rows, rx.width, rw.rows);
    let (x, w, d) = (wide(x, rx), wide(w, rw), wide(d, rd));
    let own_dw = if sink.is_some() { 0 } else { o * k };
    let out = written(n * k + own_dw, |dst| {
        let (dx, dw) = dst.split_at_mut(n * k);
        // SAFETY: `d` is n × o, `w` o × k and `x` n × k inside their slices; `dx` (n × k)
        // and `dw` (o × k, or nothing) are the two disjoint parts of a fresh buffer.
        unsafe {
            product(dx, [n, k, o], d.mat(), w.mat());
            if own_dw > 0 {
                product(dw, [o, k, n], d.mat().t(), x.mat());
            }
        }
    });
    match sink {
        None => {}
        Some(dw) if dw.is_empty() => {
            dw.reserve_exact(o * k);
            // SAFETY: as above; the o × k reserved elements are every one written.
            unsafe {
                product(
                    &mut dw.spare_capacity_mut()[..o * k],
                    [o, k, n],
                    d.mat().t(),
                    x.mat(),
                );
                dw.set_len(o * k);
            }
        }
        Some(dw) => {
            assert_eq!(dw.len(), o * k, "a weight's gradient buffer has its size");
            // SAFETY: as above; `dw` holds o × k elements.
            unsafe { product_into(dw, [o, k, n], d.mat().t(), x.mat(), true) };
        }
    }
    out
}
