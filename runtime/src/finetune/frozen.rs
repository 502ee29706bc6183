//! A linear layer over a frozen weight whose backward computes the input's gradient only.
//!
//! candle 0.11's backward of a matmul computes both operands' gradients, a constant's too: a
//! base weight handed out as a plain tensor still costs its weight-gradient matmul (and holds
//! its result until the gradients are dropped). [`frozen_linear`] computes `x Wᵀ` on a detached
//! input, which records nothing, and adds the output of an op that is zero going forward and
//! passes `grad · W` back to `x`: the gradient `x` needs, and no other.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, Layout, MetalStorage, Result, Shape, Tensor,
};

/// Zero going forward, `grad · weight` going back: the input-gradient path of `x Wᵀ`.
struct InputGradient {
    weight: Tensor,
}

impl InputGradient {
    /// The output's shape: `x`'s with its last dimension the weight's rows.
    fn shape(&self, layout: &Layout) -> Shape {
        let mut dims = layout.shape().dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = self.weight.dim(0).unwrap_or(0);
        }
        Shape::from(dims)
    }
}

impl CustomOp1 for InputGradient {
    fn name(&self) -> &'static str {
        "ivme-frozen-linear"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let shape = self.shape(layout);
        Ok((storage.device().zeros_impl(&shape, storage.dtype())?, shape))
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let shape = self.shape(layout);
        Ok((storage.device().zeros_impl(&shape, storage.dtype())?, shape))
    }

    fn metal_fwd(&self, storage: &MetalStorage, layout: &Layout) -> Result<(MetalStorage, Shape)> {
        let shape = self.shape(layout);
        Ok((storage.device().zeros_impl(&shape, storage.dtype())?, shape))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.broadcast_matmul(&self.weight)?))
    }
}

/// `x Wᵀ + b` for a frozen `weight` (out × in) and `bias`: the same values as candle's
/// `Linear`, with a backward that computes `x`'s gradient and never the weight's. With a
/// `weight` that is a variable (or computed from one), candle's own linear is used, so its
/// gradient is computed as usual.
pub fn frozen_linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let plain = candle_nn::Linear::new(weight.clone(), bias.cloned());
    if weight.track_op() || bias.is_some_and(Tensor::track_op) || !x.track_op() {
        // Something here trains (or nothing does): candle's linear is exact and no slower.
        return candle_core::Module::forward(&plain, x);
    }
    let value = candle_core::Module::forward(&plain, &x.detach())?;
    value
        + x.apply_op1(InputGradient {
            weight: weight.clone(),
        })?
}

#[cfg(test)]
mod tests {
    use super::frozen_linear;
    use candle_core::{Device, Module, Tensor, Var};

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn a_frozen_linear_gives_candles_values_and_input_gradient_without_the_weights() {
        let dev = Device::Cpu;
        let w = Tensor::arange(0f32, 12.0, &dev)
            .unwrap()
            .reshape((3, 4))
            .unwrap();
        let w = (w * 0.1).unwrap().sin().unwrap();
        let b = Tensor::new(&[0.1f32, -0.2, 0.3], &dev).unwrap();
        let x0 = Tensor::arange(0f32, 8.0, &dev)
            .unwrap()
            .reshape((2, 4))
            .unwrap()
            .cos()
            .unwrap();
        let run = |frozen: bool| {
            let x = Var::from_tensor(&x0).unwrap();
            // A variable upstream, as an adapter or an earlier layer would be.
            let h = (x.as_tensor() * 2.0).unwrap();
            let y = if frozen {
                frozen_linear(&h, &w, Some(&b)).unwrap()
            } else {
                candle_nn::Linear::new(w.clone(), Some(b.clone()))
                    .forward(&h)
                    .unwrap()
            };
            let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            let gx = values(grads.get(x.as_tensor()).unwrap());
            (values(&y), gx, grads.get_ids().count())
        };
        let (y, gx, held) = run(true);
        let (want_y, want_gx, want_held) = run(false);
        assert_eq!(y, want_y);
        for (a, b) in gx.iter().zip(&want_gx) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        }
        // candle's linear leaves the constant weight's gradient (and its bias's) in the store.
        assert!(
            held < want_held,
            "{held} gradients held, candle's linear {want_held}"
        );
    }
}
