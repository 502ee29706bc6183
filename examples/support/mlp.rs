//! The ReLU MLP the benchmark examples train: `linear` layers named `l0`, `l1`, … of the
//! given widths, ReLU between them.
//!
//! Include it with `#[path = "support/mlp.rs"] mod mlp;`.

use candle_core::{Module, Tensor};
use candle_nn::{linear, Linear, VarBuilder};

/// Linear layers with ReLU between them.
pub struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    /// Layers of `dims[0] → dims[1] → …`, their weights from `vb`.
    pub fn new(vb: VarBuilder, dims: &[usize]) -> candle_core::Result<Self> {
        let layers = dims
            .windows(2)
            .enumerate()
            .map(|(i, w)| linear(w[0], w[1], vb.pp(format!("l{i}"))))
            .collect::<candle_core::Result<_>>()?;
        Ok(Mlp { layers })
    }
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = xs.clone();
        for (i, l) in self.layers.iter().enumerate() {
            h = l.forward(&h)?;
            if i + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}
