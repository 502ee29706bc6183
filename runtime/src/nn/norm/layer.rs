//! The layer norm's fused CPU kernels: the forward (with or without a bias) and the backward.

use super::*;

/// The fused layer norm: `x`, `alpha` and maybe `beta` → `y`.
pub(super) struct LayerNorm {
    pub(super) eps: f32,
}

impl LayerNorm {
    fn fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        beta: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "layer_norm";
        let d = last_dim(l1);
        let shape = l1.shape().clone();
        match beta {
            Some((s3, l3)) => with_slices!(OP, (s1, s2, s3), |x, a, b| {
                let x = elem::contiguous(x, l1, OP)?;
                let a = elem::contiguous(a, l2, OP)?;
                let b = elem::contiguous(b, l3, OP)?;
                output(ln_fwd(x, a, Some(b), d, self.eps), shape)
            }),
            None => with_slices!(OP, (s1, s2), |x, a| {
                let x = elem::contiguous(x, l1, OP)?;
                let a = elem::contiguous(a, l2, OP)?;
                output(ln_fwd(x, a, None, d, self.eps), shape)
            }),
        }
    }

    /// `dx`, `dalpha` and `dbeta` from one backward kernel.
    fn grads(&self, x: &Tensor, alpha: &Tensor, grad: &Tensor) -> Result<(Tensor, Vec<Tensor>)> {
        let grad = grad.contiguous()?;
        let packed = x.apply_op3_no_bwd(alpha, &grad, &LayerNormBwd { eps: self.eps })?;
        unpack(&packed, x, 2)
    }
}

impl CustomOp2 for LayerNorm {
    fn name(&self) -> &'static str {
        "ivme-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.fwd(s1, l1, s2, l2, None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        alpha: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, mut dw) = self.grads(x, alpha, grad)?;
        dw.truncate(1);
        Ok((Some(dx), dw.pop()))
    }
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "ivme-layer-norm"
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
        self.fwd(s1, l1, s2, l2, Some((s3, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        alpha: &Tensor,
        _beta: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, mut dw) = self.grads(x, alpha, grad)?;
        let dbeta = dw.pop();
        Ok((Some(dx), dw.pop(), dbeta))
    }
}

/// A row's mean and `1/sqrt(var + eps)`, with the sums shifted by the row's first element (which
/// keeps `E[x²] - E[x]²` from cancelling when the mean is large against the spread); also
/// returns the shifted elements' sum over `d`, i.e. `mean - shift`.
#[inline(always)]
fn row_stats(sum: f32, sum_sq: f32, shift: f32, d: usize, eps: f32) -> (f32, f32, f32) {
    let m = sum / d as f32;
    let var = (sum_sq / d as f32 - m * m).max(0.);
    (shift + m, (var + eps).sqrt().recip(), m)
}

fn ln_fwd<T: Elem>(x: &[T], a: &[T], b: Option<&[T]>, d: usize, eps: f32) -> Vec<T> {
    let mut y = vec![T::of(0.); x.len()];
    if d == 0 {
        return y;
    }
    y.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .with_min_len(min_rows(d))
        .for_each(|(y, x)| {
            let shift = x[0].f32();
            let [sum, sum_sq] = row_sums(d, |i| {
                let v = x[i].f32() - shift;
                [v, v * v]
            });
            let (mean, inv, _) = row_stats(sum, sum_sq, shift, d, eps);
            match b {
                Some(b) => {
                    for (((y, x), a), b) in y.iter_mut().zip(x).zip(a).zip(b) {
                        *y = T::of((x.f32() - mean) * inv * a.f32() + b.f32());
                    }
                }
                None => {
                    for ((y, x), a) in y.iter_mut().zip(x).zip(a) {
                        *y = T::of((x.f32() - mean) * inv * a.f32());
                    }
                }
            }
        });
    y
}

/// Layer norm's backward: `x`, `alpha`, `grad` → `(rows + 2, d)`: `dx`'s rows, `dalpha`, `dbeta`.
struct LayerNormBwd {
    eps: f32,
}

impl CustomOp3 for LayerNormBwd {
    fn name(&self) -> &'static str {
        "ivme-layer-norm-bwd"
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
        const OP: &str = "layer_norm (backward)";
        let d = last_dim(l1);
        let rows = l1.shape().elem_count() / d.max(1);
        with_slices!(OP, (s1, s2, s3), |x, a, g| {
            let x = elem::contiguous(x, l1, OP)?;
            let a = elem::contiguous(a, l2, OP)?;
            let g = elem::contiguous(g, l3, OP)?;
            output(ln_bwd(x, a, g, d, self.eps), (rows + 2, d).into())
        })
    }
}

fn ln_bwd<T: Elem>(x: &[T], a: &[T], g: &[T], d: usize, eps: f32) -> Vec<T> {
    let rows = x.len().checked_div(d).unwrap_or(0);
    let mut out = vec![T::of(0.); (rows + 2) * d];
    let (dx, dw) = out.split_at_mut(rows * d);
    let sums = by_row_blocks(rows, d, dx, 2 * d, |first, dx, acc| {
        let (acc_a, acc_b) = acc.split_at_mut(d);
        for (r, dx) in dx.chunks_mut(d).enumerate() {
            let row = (first + r) * d..(first + r + 1) * d;
            let (x, g) = (&x[row.clone()], &g[row]);
            let shift = x[0].f32();
            let [sum, sum_sq, sum_ga, sum_gax] = row_sums(d, |i| {
                let (v, ga) = (x[i].f32() - shift, g[i].f32() * a[i].f32());
                [v, v * v, ga, ga * v]
            });
            let (mean, inv, m) = row_stats(sum, sum_sq, shift, d, eps);
            // Σ g·a·x̂ over the row, x̂ = (x - mean)·inv.
            let sum_gaxh = inv * (sum_gax - m * sum_ga);
            let (c1, c2) = (sum_ga / d as f32, sum_gaxh / d as f32);
            for (((((dx, x), g), a), acc_a), acc_b) in dx
                .iter_mut()
                .zip(x)
                .zip(g)
                .zip(a)
                .zip(acc_a.iter_mut())
                .zip(acc_b.iter_mut())
            {
                let (xh, g) = ((x.f32() - mean) * inv, g.f32());
                *dx = T::of(inv * (g * a.f32() - c1 - xh * c2));
                *acc_a += g * xh;
                *acc_b += g;
            }
        }
    });
    for (dw, s) in dw.iter_mut().zip(sums) {
        *dw = T::of(s);
    }
    out
}
