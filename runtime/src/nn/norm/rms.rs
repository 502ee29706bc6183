//! The RMS norm's fused CPU kernels: the forward and the backward.

use super::*;

/// The fused RMS norm: `x`, `alpha` → `y`.
pub(super) struct RmsNorm {
    pub(super) eps: f32,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "ivme-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "rms_norm";
        with_slices!(OP, (s1, s2), |x, a| {
            let x = elem::contiguous(x, l1, OP)?;
            let a = elem::contiguous(a, l2, OP)?;
            output(rms_fwd(x, a, last_dim(l1), self.eps), l1.shape().clone())
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        alpha: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let packed = x.apply_op3_no_bwd(alpha, &grad, &RmsNormBwd { eps: self.eps })?;
        let (dx, mut dw) = unpack(&packed, x, 1)?;
        Ok((Some(dx), dw.pop()))
    }
}

fn rms_fwd<T: Elem>(x: &[T], a: &[T], d: usize, eps: f32) -> Vec<T> {
    let mut y = vec![T::of(0.); x.len()];
    if d == 0 {
        return y;
    }
    y.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .with_min_len(min_rows(d))
        .for_each(|(y, x)| {
            let [sum_sq] = row_sums(d, |i| [x[i].f32() * x[i].f32()]);
            let inv = (sum_sq / d as f32 + eps).sqrt().recip();
            for ((y, x), a) in y.iter_mut().zip(x).zip(a) {
                *y = T::of(x.f32() * inv * a.f32());
            }
        });
    y
}

/// RMS norm's backward: `x`, `alpha`, `grad` → `(rows + 1, d)`: `dx`'s rows, then `dalpha`.
struct RmsNormBwd {
    eps: f32,
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "ivme-rms-norm-bwd"
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
        const OP: &str = "rms_norm (backward)";
        let d = last_dim(l1);
        let rows = l1.shape().elem_count() / d.max(1);
        with_slices!(OP, (s1, s2, s3), |x, a, g| {
            let x = elem::contiguous(x, l1, OP)?;
            let a = elem::contiguous(a, l2, OP)?;
            let g = elem::contiguous(g, l3, OP)?;
            output(rms_bwd(x, a, g, d, self.eps), (rows + 1, d).into())
        })
    }
}

fn rms_bwd<T: Elem>(x: &[T], a: &[T], g: &[T], d: usize, eps: f32) -> Vec<T> {
    let rows = x.len().checked_div(d).unwrap_or(0);
    let mut out = vec![T::of(0.); (rows + 1) * d];
    let (dx, da) = out.split_at_mut(rows * d);
    let sums = by_row_blocks(rows, d, dx, d, |first, dx, acc| {
        for (r, dx) in dx.chunks_mut(d).enumerate() {
            let row = (first + r) * d..(first + r + 1) * d;
            let (x, g) = (&x[row.clone()], &g[row]);
            let [sum_sq, sum_gax] = row_sums(d, |i| {
                let x = x[i].f32();
                [x * x, g[i].f32() * a[i].f32() * x]
            });
            let inv = (sum_sq / d as f32 + eps).sqrt().recip();
            let c = inv * inv * inv * sum_gax / d as f32;
            for ((((dx, x), g), a), acc) in dx.iter_mut().zip(x).zip(g).zip(a).zip(acc.iter_mut()) {
                let (x, g) = (x.f32(), g.f32());
                *dx = T::of(inv * a.f32() * g - c * x);
                *acc += g * x * inv;
            }
        }
    });
    for (da, s) in da.iter_mut().zip(sums) {
        *da = T::of(s);
    }
    out
}
