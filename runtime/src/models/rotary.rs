//! Rotary position tables (cos and sin per position and frequency), with Llama 3's scaling.

use candle_core::{DType, Device, Result, Tensor};

/// Llama 3's rotary frequency scaling (`rope_scaling` with `rope_type: "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    /// How much the low frequencies are divided by.
    pub factor: f32,
    /// Wavelengths above `original / low_freq_factor` are scaled fully.
    pub low_freq_factor: f32,
    /// Wavelengths below `original / high_freq_factor` are kept.
    pub high_freq_factor: f32,
    /// The context length the model was first trained with.
    pub original_max_position_embeddings: usize,
}

/// The cos and sin tables of a rotary embedding, `(positions, head_dim / 2)` each, in f32.
#[derive(Debug, Clone)]
pub struct RotaryTables {
    cos: Tensor,
    sin: Tensor,
}

impl RotaryTables {
    /// Tables for `positions` positions of heads `head_dim` wide with base `theta`, the
    /// frequencies scaled as Llama 3 does when `scaling` is given.
    pub fn new(
        head_dim: usize,
        positions: usize,
        theta: f64,
        scaling: Option<&Llama3Scaling>,
        device: &Device,
    ) -> Result<RotaryTables> {
        let freqs: Vec<f32> = (0..head_dim / 2)
            .map(|i| {
                let f = (1.0 / theta.powf(2.0 * i as f64 / head_dim as f64)) as f32;
                scaling.map_or(f, |s| llama3(f, s))
            })
            .collect();
        let freqs = Tensor::from_vec(freqs, (1, head_dim / 2), device)?;
        let pos = Tensor::arange(0u32, positions as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((positions, 1))?;
        let angles = pos.broadcast_mul(&freqs)?;
        Ok(RotaryTables {
            cos: angles.cos()?,
            sin: angles.sin()?,
        })
    }

    /// The positions the tables cover.
    pub fn positions(&self) -> usize {
        self.cos.dim(0).unwrap_or(0)
    }

    /// The first `t` positions' tables in `dtype`.
    pub fn first(&self, t: usize, dtype: DType) -> Result<(Tensor, Tensor)> {
        if t > self.positions() {
            candle_core::bail!(
                "a sequence of {t} tokens is longer than the rotary tables ({} positions, \
                 max_position_embeddings)",
                self.positions()
            )
        }
        Ok((
            self.cos.narrow(0, 0, t)?.to_dtype(dtype)?,
            self.sin.narrow(0, 0, t)?.to_dtype(dtype)?,
        ))
    }
}

/// One frequency under Llama 3's scaling: long wavelengths divided by the factor, short ones
/// kept, those between blended linearly in `original / wavelength`.
fn llama3(freq: f32, s: &Llama3Scaling) -> f32 {
    let original = s.original_max_position_embeddings as f32;
    let wavelength = 2.0 * std::f32::consts::PI / freq;
    if wavelength < original / s.high_freq_factor {
        freq
    } else if wavelength > original / s.low_freq_factor {
        freq / s.factor
    } else {
        let smooth =
            (original / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * freq / s.factor + smooth * freq
    }
}
