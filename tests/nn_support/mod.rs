//! Helpers the `ivme::nn` op tests share: deterministic inputs and a relative error.
//!
//! Include it with `#[path = "nn_support/mod.rs"] mod nn_support;`.

#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor};

/// Deterministic values in about [-2, 2].
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4. - 2.
        })
        .collect()
}

pub fn tensor(shape: &[usize], seed: u64) -> Result<Tensor> {
    let n = shape.iter().product();
    Tensor::from_vec(values(n, seed), shape, &Device::Cpu)
}

/// `max |a - b| / max |b|`, in f32.
pub fn rel_err(a: &Tensor, b: &Tensor) -> Result<f32> {
    assert_eq!(a.dims(), b.dims());
    let a = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let b = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let scale = b.iter().map(|y| y.abs()).fold(1e-6f32, f32::max);
    Ok(diff / scale)
}

pub fn assert_close(a: &Tensor, b: &Tensor, tol: f32, what: &str) -> Result<()> {
    let e = rel_err(a, b)?;
    assert!(e <= tol, "{what}: relative error {e:e} > {tol:e}");
    Ok(())
}
