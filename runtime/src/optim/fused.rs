//! Fused optimizer updates on the CPU: each f32 variable (or ZeRO slice) is updated in one pass
//! over its memory, in place, split across threads, with no tensor allocated per step.
//!
//! Every element goes through the same f32 operations, in the same order, as the op-by-op path
//! (candle's `affine` is `x * mul + add` with both constants rounded to f32), so the numbers
//! are bit for bit the same and a resume is exact whichever path ran before it. Variables that
//! are not f32, not on the CPU or not contiguous take the op-by-op path.

use candle_core::{CpuStorage, Layout, Storage, Tensor};
use rayon::prelude::*;
use std::sync::Mutex;

/// Elements per task when a pass is split across threads.
const CHUNK: usize = 1 << 15;

/// Whether the fused path is allowed (`IVME_FUSED_OPTIMIZER=0` turns it off, to compare).
pub(crate) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::env::FUSED_OPTIMIZER.get().is_none_or(|v| v != "0"))
}

/// Whether `t` can be updated by the fused path: f32, on the CPU, contiguous.
pub(crate) fn fits(t: &Tensor) -> bool {
    t.dtype() == candle_core::DType::F32
        && t.device().is_cpu()
        && t.is_contiguous()
        && t.layout().contiguous_offsets().is_some()
}

/// Runs `f` on the f32 elements of `t`, mutably, in place.
struct MutF32<F>(Mutex<Option<F>>);

impl<F> candle_core::InplaceOp1 for MutF32<F>
where
    F: FnOnce(&mut [f32]) -> candle_core::Result<()>,
{
    fn name(&self) -> &'static str {
        "ivme-fused-update"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("the fused update needs f32 storage");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("the fused update needs a contiguous tensor");
        };
        let f = self
            .0
            .lock()
            .map_err(|_| candle_core::Error::Msg("fused update lock poisoned".into()))?
            .take();
        match f {
            Some(f) => f(&mut data[start..end]),
            None => candle_core::bail!("the fused update ran twice"),
        }
    }
}

/// Calls `f` with the elements of `t` to change in place (`t` must [`fit`](fits)).
pub(crate) fn with_mut(
    t: &Tensor,
    f: impl FnOnce(&mut [f32]) -> candle_core::Result<()>,
) -> candle_core::Result<()> {
    t.inplace_op1(&MutF32(Mutex::new(Some(f))))
}

/// Calls `f` with the elements of `t` to read (`t` must [`fit`](fits)).
pub(crate) fn with_ref<R>(
    t: &Tensor,
    f: impl FnOnce(&[f32]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(data)) = &*storage else {
        candle_core::bail!("the fused update needs f32 CPU storage");
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("the fused update needs a contiguous tensor");
    };
    f(&data[start..end])
}

/// The constants of one AdamW step, rounded to f32 as candle's scalar ops round them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdamWStep {
    pub beta1: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub scale_m: f32,
    pub scale_v: f32,
    pub eps: f32,
    pub decay: f32,
    pub lr: f32,
}

impl AdamWStep {
    /// The step's constants from the f64 values the op-by-op path scales by.
    /// `betas` are (β₁, β₂), `scales` the bias corrections' (m, v) factors.
    pub(crate) fn new(
        (beta1, beta2): (f64, f64),
        (scale_m, scale_v): (f64, f64),
        eps: f64,
        decay: f64,
        lr: f64,
    ) -> Self {
        AdamWStep {
            beta1: beta1 as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            scale_m: scale_m as f32,
            scale_v: scale_v as f32,
            eps: eps as f32,
            decay: decay as f32,
            lr: lr as f32,
        }
    }

    /// One element, in the op-by-op path's order of f32 operations.
    #[inline(always)]
    fn apply(&self, theta: &mut f32, m: &mut f32, v: &mut f32, g: f32) {
        let next_m = (*m * self.beta1 + 0.0) + (g * self.one_minus_beta1 + 0.0);
        let next_v = (*v * self.beta2 + 0.0) + ((g * g) * self.one_minus_beta2 + 0.0);
        let m_hat = next_m * self.scale_m + 0.0;
        let v_hat = next_v * self.scale_v + 0.0;
        let update = m_hat / (v_hat.sqrt() * 1.0 + self.eps);
        *theta = (*theta * self.decay + 0.0) - (update * self.lr + 0.0);
        *m = next_m;
        *v = next_v;
    }
}

/// Updates `theta` and its moments `m`, `v` from `grad` in one pass (all four must
/// [`fit`](fits) and have the same number of elements).
pub(crate) fn adamw(
    theta: &Tensor,
    m: &Tensor,
    v: &Tensor,
    grad: &Tensor,
    step: AdamWStep,
) -> candle_core::Result<()> {
    with_ref(grad, |g| {
        with_mut(m, |m| {
            with_mut(v, |v| {
                with_mut(theta, |th| {
                    if th.len() != g.len() || m.len() != g.len() || v.len() != g.len() {
                        candle_core::bail!("the fused AdamW update got tensors of other sizes");
                    }
                    th.par_chunks_mut(CHUNK)
                        .zip(m.par_chunks_mut(CHUNK))
                        .zip(v.par_chunks_mut(CHUNK))
                        .zip(g.par_chunks(CHUNK))
                        .for_each(|(((th, m), v), g)| {
                            for i in 0..th.len() {
                                step.apply(&mut th[i], &mut m[i], &mut v[i], g[i]);
                            }
                        });
                    Ok(())
                })
            })
        })
    })
}

/// The constants of one SGD step, rounded to f32 as candle's scalar ops round them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SgdStep {
    pub weight_decay: Option<f32>,
    pub momentum: f32,
    pub one_minus_dampening: f32,
    pub nesterov: bool,
    pub lr: f32,
}

impl SgdStep {
    /// One element, in the op-by-op path's order; `buf` is the momentum buffer (when momentum
    /// is on; it already holds a value).
    #[inline(always)]
    fn apply(&self, theta: &mut f32, buf: Option<&mut f32>, g: f32) {
        let mut g = match self.weight_decay {
            Some(wd) => g + (*theta * wd + 0.0),
            None => g,
        };
        if let Some(buf) = buf {
            let next = (*buf * self.momentum + 0.0) + (g * self.one_minus_dampening + 0.0);
            *buf = next;
            g = if self.nesterov {
                g + (next * self.momentum + 0.0)
            } else {
                next
            };
        }
        *theta -= g * self.lr + 0.0;
    }
}

/// Updates `theta` (and its momentum buffer `buf`, which already holds a value) from `grad` in
/// one pass (every tensor must [`fit`](fits) and have as many elements).
pub(crate) fn sgd(
    theta: &Tensor,
    buf: Option<&Tensor>,
    grad: &Tensor,
    step: SgdStep,
) -> candle_core::Result<()> {
    with_ref(grad, |g| {
        let update = |th: &mut [f32], buf: Option<&mut [f32]>| {
            if th.len() != g.len() || buf.as_ref().is_some_and(|b| b.len() != g.len()) {
                candle_core::bail!("the fused SGD update got tensors of other sizes");
            }
            match buf {
                Some(buf) => th
                    .par_chunks_mut(CHUNK)
                    .zip(buf.par_chunks_mut(CHUNK))
                    .zip(g.par_chunks(CHUNK))
                    .for_each(|((th, buf), g)| {
                        for i in 0..th.len() {
                            step.apply(&mut th[i], Some(&mut buf[i]), g[i]);
                        }
                    }),
                None => th
                    .par_chunks_mut(CHUNK)
                    .zip(g.par_chunks(CHUNK))
                    .for_each(|(th, g)| {
                        for i in 0..th.len() {
                            step.apply(&mut th[i], None, g[i]);
                        }
                    }),
            }
            Ok(())
        };
        match buf {
            Some(buf) => with_mut(buf, |b| with_mut(theta, |th| update(th, Some(b)))),
            None => with_mut(theta, |th| update(th, None)),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use candle_core::{Device, Var};
    use candle_nn::{Optimizer, ParamsAdamW};

    /// ivme's AdamW (this fused pass: f32, contiguous, on the CPU; large enough to be split
    /// across threads) against candle-nn's, bit for bit, over a few steps with weight decay.
    #[test]
    fn the_fused_adamw_step_is_candle_nns_bit_for_bit() -> crate::Result<()> {
        let mut rng = Rng::new(4);
        let n = 3 * CHUNK + 17;
        let init = rng.randn(0.0, 1.0, n, &Device::Cpu)?;
        let small = rng.randn(0.0, 1.0, (3, 5), &Device::Cpu)?;
        let (ours, theirs) = (
            [Var::from_tensor(&init)?, Var::from_tensor(&small)?],
            [Var::from_tensor(&init)?, Var::from_tensor(&small)?],
        );
        assert!(ours.iter().all(|v| fits(v.as_tensor())));
        let p = ParamsAdamW {
            lr: 0.01,
            weight_decay: 0.1,
            ..Default::default()
        };
        let mut a = crate::optim::AdamW::new(ours.to_vec(), p.clone())?;
        let mut b = candle_nn::AdamW::new(theirs.to_vec(), p)?;
        for step in 0..4 {
            let x = rng.randn(0.0, 1.0, n, &Device::Cpu)?;
            let y = rng.randn(0.0, 1.0, (3, 5), &Device::Cpu)?;
            let loss = |vs: &[Var; 2]| -> candle_core::Result<Tensor> {
                (vs[0].as_tensor() * &x)?.sqr()?.sum_all()? + (vs[1].as_tensor() * &y)?.sum_all()?
            };
            a.backward_step(&loss(&ours)?)?;
            b.backward_step(&loss(&theirs)?)?;
            for (o, t) in ours.iter().zip(&theirs) {
                let bits = |v: &Var| -> candle_core::Result<Vec<u32>> {
                    Ok(v.as_tensor()
                        .flatten_all()?
                        .to_vec1::<f32>()?
                        .iter()
                        .map(|f| f.to_bits())
                        .collect())
                };
                assert!(bits(o)? == bits(t)?, "step {step}: the weights differ");
            }
        }
        Ok(())
    }

    /// SGD with weight decay, momentum and dampening (plain and Nesterov) through the fused
    /// pass, against the same update written with candle's tensor ops, bit for bit.
    #[test]
    fn the_fused_sgd_step_is_the_op_by_op_step_bit_for_bit() -> crate::Result<()> {
        use crate::optim::{ParamsSgd, Sgd};
        for nesterov in [false, true] {
            let mut rng = Rng::new(6);
            let n = 2 * CHUNK + 5;
            let init = rng.randn(0.0, 1.0, n, &Device::Cpu)?;
            let w = Var::from_tensor(&init)?;
            let p = ParamsSgd {
                lr: 0.05,
                momentum: 0.9,
                // Nesterov needs no dampening.
                dampening: if nesterov { 0.0 } else { 0.1 },
                weight_decay: 0.01,
                nesterov,
            };
            let mut opt = Sgd::new(vec![w.clone()], p)?;
            let (mut theta, mut buf): (Tensor, Option<Tensor>) = (init.copy()?, None);
            for step in 0..4 {
                let x = rng.randn(0.0, 1.0, n, &Device::Cpu)?;
                opt.backward_step(&(w.as_tensor() * &x)?.sum_all()?)?;
                // The reference: candle's ops in the optimizer's order.
                let g = (&x + (&theta * p.weight_decay)?)?;
                let b = match &buf {
                    Some(b) => ((b * p.momentum)? + (&g * (1.0 - p.dampening))?)?,
                    None => g.clone(),
                };
                let g = if nesterov {
                    (&g + (&b * p.momentum)?)?
                } else {
                    b.clone()
                };
                buf = Some(b);
                theta = theta.sub(&(g * p.lr)?)?;
                let bits = |t: &Tensor| -> candle_core::Result<Vec<u32>> {
                    Ok(t.to_vec1::<f32>()?.iter().map(|f| f.to_bits()).collect())
                };
                assert!(
                    bits(w.as_tensor())? == bits(&theta)?,
                    "nesterov {nesterov}, step {step}: the weights differ"
                );
            }
        }
        Ok(())
    }
}
