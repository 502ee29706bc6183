//! Gradients inside an accumulation window, before the sync: what a micro-step has added so far.

use candle_core::{Tensor, Var};

use crate::accelerator::Accelerator;
use crate::error::Result;

impl Accelerator {
    /// This rank's gradient of `var` accumulated so far in the current window, as the part of
    /// the window's mean it makes up: after `k` of `n` micro-batches, `(g₁ + … + g_k) / n`,
    /// with any fp16 loss scale undone. It is not yet averaged across processes.
    ///
    /// `var` may be the variable the model computes with or its f32 master. Returns `None`
    /// when no backward of the current window reached `var`, in particular right after a
    /// sync step (whose gradients [`backward`](Self::backward) returned). The result is a new
    /// f32 tensor: reading it changes nothing in the window.
    ///
    /// ```no_run
    /// # fn main() -> ivme::Result<()> {
    /// # let mut accelerator = ivme::Accelerator::builder().grad_accum(4).build()?;
    /// # let varmap = candle_nn::VarMap::new();
    /// # let w = varmap.get(3, "w", candle_nn::Init::Const(1.0), candle_core::DType::F32, accelerator.device())?;
    /// # let loss = w.sum_all()?;
    /// let grads = accelerator.backward(&loss)?;
    /// if !grads.is_sync_step() {
    ///     if let Some(g) = accelerator.accumulated_gradient(&candle_core::Var::from_tensor(&w)?)? {
    ///         accelerator.print(format!("partial gradient norm {}", g.sqr()?.sum_all()?.sqrt()?));
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub fn accumulated_gradient(&self, var: &Var) -> Result<Option<Tensor>> {
        let id = var.as_tensor().id();
        let scale = self.mixed.loss_scale();
        for m in self.training.models() {
            let found = m
                .compute
                .iter()
                .zip(&m.master)
                .position(|(c, ms)| c.as_tensor().id() == id || ms.as_tensor().id() == id);
            if let Some(i) = found {
                return Ok(match &m.sums[i] {
                    None => None,
                    Some(sum) if scale == 1.0 => Some(sum.copy()?),
                    Some(sum) => Some((sum / scale)?),
                });
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};
    use candle_nn::VarMap;

    use crate::{Accelerator, Precision};

    /// Gradient of `sum(w * x)` with respect to `w`, by hand: `x`.
    fn batch(i: usize) -> Tensor {
        Tensor::new(&[i as f32 + 1.0, -2.0 * i as f32, 0.5], &Device::Cpu).unwrap()
    }

    fn run(precision: Precision, tol: f32) {
        let mut acc = Accelerator::builder()
            .cpu(true)
            .grad_accum(3)
            .precision(precision)
            .build()
            .unwrap();
        let varmap = VarMap::new();
        let dtype = acc.param_dtype(DType::F32);
        varmap
            .get(3, "w", candle_nn::Init::Const(0.0), dtype, &Device::Cpu)
            .unwrap();
        let varmap = acc.prepare(varmap).unwrap();
        let w: Var = varmap.data().lock().unwrap()["w"].clone();
        let mut expected = vec![0f32; 3];
        for i in 0..3 {
            let x = batch(i).to_dtype(dtype).unwrap();
            let loss = (w.as_tensor() * &x).unwrap().sum_all().unwrap();
            let grads = acc.backward(&loss).unwrap();
            for (e, x) in expected.iter_mut().zip(batch(i).to_vec1::<f32>().unwrap()) {
                *e += x / 3.0;
            }
            let got = acc.accumulated_gradient(&w).unwrap();
            if i < 2 {
                assert!(!grads.is_sync_step());
                let got = got.expect("a partial gradient").to_vec1::<f32>().unwrap();
                for (g, e) in got.iter().zip(&expected) {
                    assert!(
                        (g - e).abs() <= tol,
                        "{precision:?} micro-step {i}: {got:?} vs {expected:?}"
                    );
                }
            } else {
                assert!(grads.is_sync_step());
                assert!(got.is_none(), "the sync step took the window's sums");
            }
        }
    }

    #[test]
    fn the_partial_window_gradient_is_the_running_share_of_the_mean() {
        run(Precision::No, 1e-6);
        // Under fp16 the loss scale is undone.
        run(Precision::Fp16, 2e-3);
    }
}
