//! The gated MLP's middle, `act(gate) · up`, with a fused backward.
//!
//! Composed of candle ops, SiLU's forward is a pass and a fresh tensor for the activation and
//! another for the product, and its backward about ten more (candle's SiLU gradient alone is
//! `neg`, `exp`, `+ 1`, `recip`, `1 − y`, two products and two sums over the whole
//! `(tokens × intermediate)` activation). On the CPU this is one custom op: the forward reads
//! `gate` and `up` once and writes the product; the backward reads `gate`, `up` and the
//! output's gradient once and writes both inputs' gradients into one allocation, never
//! zero-filled. `gate` and `up` may be views whose rows are strided, as the two halves of one
//! fused `gate_up` projection are: they are read where they lie, not copied first. Elsewhere
//! the same maths is composed of candle ops.

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::elem::{self, Elem};
use super::fastmath;
use super::rows::{write_rows, Rows};

const OP: &str = "gated";

/// The activation a gated MLP applies to its gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateAct {
    /// `x · sigmoid(x)` (SwiGLU: the Llama family, Mistral, Qwen2, Phi-3).
    Silu,
    /// GELU's tanh approximation, `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))` (GeGLU: Gemma 2;
    /// transformers' `gelu_pytorch_tanh`, candle's `gelu`).
    GeluTanh,
}

/// `act(gate) · up`, the gated MLP's middle, in one pass each way.
///
/// `gate` and `up` have one shape and dtype (f32, bf16 or f16; the arithmetic is f32); the
/// result has that shape, contiguous. Both inputs get gradients (not second derivatives).
/// Their values are those of `gate.silu()? * up` (or `gate.gelu()? * up`) within f32 rounding:
/// the exponential is computed inline (relative error below 1e-7), not by libm.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use ivme::nn::{gated, GateAct};
/// # fn main() -> candle_core::Result<()> {
/// let gate = Tensor::new(&[0f32, 2.], &Device::Cpu)?;
/// let up = Tensor::new(&[5f32, 3.], &Device::Cpu)?;
/// let y = gated(&gate, &up, GateAct::Silu)?.to_vec1::<f32>()?;
/// let silu2 = 2. / (1. + (-2f32).exp());
/// assert!(y[0].abs() < 1e-7 && (y[1] - 3. * silu2).abs() < 1e-5);
/// # Ok(())
/// # }
/// ```
pub fn gated(gate: &Tensor, up: &Tensor, act: GateAct) -> Result<Tensor> {
    check(gate, up)?;
    if !gate.device().is_cpu() {
        return gated_composed(gate, up, act);
    }
    let gate = rows_or_contiguous(gate)?;
    let up = rows_or_contiguous(up)?;
    gate.apply_op2(&up, Gated(act))
}

/// [`gated`] composed of candle ops (its form off the CPU, and the tests' reference).
#[doc(hidden)]
pub fn gated_composed(gate: &Tensor, up: &Tensor, act: GateAct) -> Result<Tensor> {
    check(gate, up)?;
    let a = match act {
        GateAct::Silu => gate.silu()?,
        GateAct::GeluTanh => gate.gelu()?,
    };
    a * up
}

fn check(gate: &Tensor, up: &Tensor) -> Result<()> {
    if gate.dims() != up.dims() {
        candle_core::bail!(
            "ivme::nn::{OP}: gate {:?} and up {:?} must have the same shape",
            gate.dims(),
            up.dims()
        )
    }
    if gate.dtype() != up.dtype() {
        candle_core::bail!(
            "ivme::nn::{OP}: gate is {:?} but up is {:?}; they must have the same dtype",
            gate.dtype(),
            up.dtype()
        )
    }
    if !matches!(gate.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return Err(elem::unsupported(OP, gate.dtype()));
    }
    if !gate.device().same_device(up.device()) {
        candle_core::bail!("ivme::nn::{OP}: gate and up are on different devices")
    }
    Ok(())
}

/// `t` itself when its rows are evenly strided with unit steps inside a row (a contiguous
/// tensor, or a narrow of the last dimension of one), else a contiguous copy.
fn rows_or_contiguous(t: &Tensor) -> Result<Tensor> {
    if Rows::of(t.layout()).is_some() {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// The forward op: `gate`, `up` → `act(gate) · up`.
struct Gated(GateAct);

impl CustomOp2 for Gated {
    fn name(&self) -> &'static str {
        "ivme-gated"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rg, ru) = (Rows::of_op(l1, OP, "gate")?, Rows::of_op(l2, OP, "up")?);
        let shape = l1.shape().clone();
        let act = self.0;
        use CpuStorage::{BF16, F16, F32};
        Ok(match (s1, s2) {
            (F32(g), F32(u)) => (F32(fwd(g, rg, u, ru, act)), shape),
            (BF16(g), BF16(u)) => (BF16(fwd(g, rg, u, ru, act)), shape),
            (F16(g), F16(u)) => (F16(fwd(g, rg, u, ru, act)), shape),
            _ => return Err(elem::mixed(OP, &[s1, s2])),
        })
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = rows_or_contiguous(grad)?;
        let packed = gate.apply_op3_no_bwd(up, &grad, &GatedBwd(self.0))?;
        let n = gate.elem_count();
        let dg = packed.narrow(0, 0, n)?.reshape(gate.shape())?;
        let du = packed.narrow(0, n, n)?.reshape(gate.shape())?;
        Ok((Some(dg), Some(du)))
    }
}

fn fwd<T: Elem>(g: &[T], rg: Rows, u: &[T], ru: Rows, act: GateAct) -> Vec<T> {
    write_rows(rg.rows, rg.width, |r, out| {
        row(Part::Out(act), out, rg.row(g, r), ru.row(u, r), &[]);
    })
}

/// The backward op: `gate`, `up`, the output's gradient → `dgate` then `dup`, flat.
struct GatedBwd(GateAct);

impl CustomOp3 for GatedBwd {
    fn name(&self) -> &'static str {
        "ivme-gated-bwd"
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
        let rg = Rows::of_op(l1, OP, "gate")?;
        let ru = Rows::of_op(l2, OP, "up")?;
        let rd = Rows::of_op(l3, OP, "the output's gradient")?;
        let act = self.0;
        let shape = Shape::from(2 * rg.rows * rg.width);
        use CpuStorage::{BF16, F16, F32};
        Ok(match (s1, s2, s3) {
            (F32(g), F32(u), F32(d)) => (F32(bwd(g, rg, u, ru, d, rd, act)), shape),
            (BF16(g), BF16(u), BF16(d)) => (BF16(bwd(g, rg, u, ru, d, rd, act)), shape),
            (F16(g), F16(u), F16(d)) => (F16(bwd(g, rg, u, ru, d, rd, act)), shape),
            _ => return Err(elem::mixed(OP, &[s1, s2, s3])),
        })
    }
}

fn bwd<T: Elem>(g: &[T], rg: Rows, u: &[T], ru: Rows, d: &[T], rd: Rows, act: GateAct) -> Vec<T> {
    let rows = rg.rows;
    // Row r < rows of the result is dgate's row r; row rows + r is dup's.
    write_rows(2 * rows, rg.width, |r, out| {
        let part = if r < rows {
            Part::GateGrad(act)
        } else {
            Part::UpGrad(act)
        };
        let r = r % rows.max(1);
        row(part, out, rg.row(g, r), ru.row(u, r), rd.row(d, r));
    })
}

/// What one row of a kernel writes.
#[derive(Clone, Copy)]
enum Part {
    /// `act(g) · u`.
    Out(GateAct),
    /// `d · u · act'(g)`.
    GateGrad(GateAct),
    /// `d · act(g)`.
    UpGrad(GateAct),
}

/// Writes one row of `part` from the rows of `g`, `u` and `d` (the output's gradient).
fn row<T: Elem>(part: Part, out: &mut [MaybeUninit<T>], g: &[T], u: &[T], d: &[T]) {
    #[cfg(target_arch = "x86_64")]
    if fastmath::avx2() {
        // SAFETY: the CPU has AVX2 and FMA, the features `row_avx2` is compiled for.
        return unsafe { row_avx2(part, out, g, u, d) };
    }
    row_any(part, out, g, u, d)
}

/// [`row_any`] compiled for AVX2 and FMA: the loops vectorise eight lanes wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_avx2<T: Elem>(part: Part, out: &mut [MaybeUninit<T>], g: &[T], u: &[T], d: &[T]) {
    row_any(part, out, g, u, d)
}

#[inline(always)]
fn row_any<T: Elem>(part: Part, out: &mut [MaybeUninit<T>], g: &[T], u: &[T], d: &[T]) {
    match part {
        Part::Out(GateAct::Silu) => {
            for ((o, g), u) in out.iter_mut().zip(g).zip(u) {
                let g = g.f32();
                o.write(T::of(g * fastmath::sigmoid(g) * u.f32()));
            }
        }
        Part::Out(GateAct::GeluTanh) => {
            for ((o, g), u) in out.iter_mut().zip(g).zip(u) {
                o.write(T::of(fastmath::gelu_tanh(g.f32()).0 * u.f32()));
            }
        }
        Part::GateGrad(GateAct::Silu) => {
            for (((o, g), u), d) in out.iter_mut().zip(g).zip(u).zip(d) {
                let g = g.f32();
                let s = fastmath::sigmoid(g);
                let da = s + g * s * (1. - s);
                o.write(T::of(d.f32() * u.f32() * da));
            }
        }
        Part::GateGrad(GateAct::GeluTanh) => {
            for (((o, g), u), d) in out.iter_mut().zip(g).zip(u).zip(d) {
                let (_, da) = fastmath::gelu_tanh(g.f32());
                o.write(T::of(d.f32() * u.f32() * da));
            }
        }
        Part::UpGrad(GateAct::Silu) => {
            for ((o, g), d) in out.iter_mut().zip(g).zip(d) {
                let g = g.f32();
                o.write(T::of(d.f32() * g * fastmath::sigmoid(g)));
            }
        }
        Part::UpGrad(GateAct::GeluTanh) => {
            for ((o, g), d) in out.iter_mut().zip(g).zip(d) {
                o.write(T::of(d.f32() * fastmath::gelu_tanh(g.f32()).0));
            }
        }
    }
}
