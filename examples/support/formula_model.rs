//! The fixed model and data of the `zero_buckets` subject, computed by formula so that its ranks
//! and the test's plain-candle reference build exactly the same tensors.
//!
//! Include it with `#[path = "../support/formula_model.rs"] mod formula_model;`.

use candle_core::{DType, Device, Tensor};

/// The input width.
pub const INPUT: usize = 64;
/// Each matrix's width before scaling: awkward, so buckets, rank slices and variables all cut
/// each other.
pub const WIDTHS: [usize; 8] = [1531, 977, 2003, 1409, 1201, 1733, 1091, 1877];

/// Matrix `i`'s starting value at `scale`: `0.1 · sin(0.001 · (i + 1) · k)` for element `k`.
pub fn init(i: usize, scale: usize) -> candle_core::Result<Tensor> {
    let cols = WIDTHS[i] * scale;
    Tensor::arange(0u32, (INPUT * cols) as u32, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .affine(0.001 * (i + 1) as f64, 0.0)?
        .sin()?
        .affine(0.1, 0.0)?
        .reshape((INPUT, cols))
}

/// Rows `from..from + n` of the global data: `sin(0.37 · row + 0.11 · column)`.
pub fn rows(from: usize, n: usize) -> candle_core::Result<Tensor> {
    let i = Tensor::arange(from as u32, (from + n) as u32, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .reshape((n, 1))?;
    let j = Tensor::arange(0u32, INPUT as u32, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .reshape((1, INPUT))?;
    (i * 0.37)?.broadcast_add(&(j * 0.11)?)?.sin()
}

/// The loss of a batch: the sum over the matrices of the mean of `(x·w − 0.5)²`, in f32.
pub fn loss(x: &Tensor, ws: &[Tensor]) -> candle_core::Result<Tensor> {
    let mut total = Tensor::new(0f32, x.device())?;
    for w in ws {
        let y = x.matmul(w)?.to_dtype(DType::F32)?;
        total = (total + (y - 0.5)?.sqr()?.mean_all()?)?;
    }
    Ok(total)
}
