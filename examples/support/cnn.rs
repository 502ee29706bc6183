//! A small conv net with BatchNorm (conv → batch norm → ReLU → pooling → linear → batch norm
//! → ReLU → dropout → linear), its deterministic weights and data: what `bn_harness` trains through
//! ivme and what tests/buffers.rs trains in plain candle as the reference.

#![allow(dead_code)]

use candle_core::{DType, Device, Module, ModuleT, Result, Tensor};
use candle_nn::{batch_norm, conv2d_no_bias, linear, linear_no_bias, BatchNorm, Conv2d};
use candle_nn::{Conv2dConfig, Linear};
use candle_nn::{VarBuilder, VarMap};
use ivme::rng::Rng;
use ivme::stateful::Shared;

/// Side of the square one-channel images.
pub const SIDE: usize = 8;

/// The net: 1×8×8 images to one output.
pub struct Cnn {
    conv: Conv2d,
    bn1: BatchNorm,
    fc1: Linear,
    bn2: BatchNorm,
    fc2: Linear,
    /// Dropout in training mode: its probability and the generator its masks come from.
    dropout: Option<(f32, Shared<Rng>)>,
}

impl Cnn {
    /// Builds the net's variables through `vb`, with dropout drawn from `dropout`'s generator.
    pub fn new(vb: VarBuilder, dropout: Option<(f32, Shared<Rng>)>) -> Result<Self> {
        let cfg = Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        Ok(Cnn {
            // No bias before a BatchNorm, which removes it: its gradient would be rounding
            // noise that AdamW amplifies into steps of the learning rate's size.
            conv: conv2d_no_bias(1, 4, 3, cfg, vb.pp("conv"))?,
            bn1: batch_norm(4, 1e-5, vb.pp("bn1"))?,
            fc1: linear_no_bias(4 * (SIDE / 2) * (SIDE / 2), 8, vb.pp("fc1"))?,
            bn2: batch_norm(8, 1e-5, vb.pp("bn2"))?,
            fc2: linear(8, 1, vb.pp("fc2"))?,
            dropout,
        })
    }
}

impl ModuleT for Cnn {
    /// Each layer is a segment named by its variables' prefix: checkpointed when ivme runs
    /// with activation checkpointing, and under ZeRO-3 its weights gathered for it; plain
    /// layers otherwise (plain candle, the reference).
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        use ivme::activations::segment;
        let (conv, bn1) = (self.conv.clone(), self.bn1.clone());
        let h = segment(x, "conv", move |x| conv.forward(x))?;
        let h = segment(&h, "bn1", move |h| {
            let h = bn1.forward_t(h, train)?.relu()?;
            h.avg_pool2d(2)?.flatten_from(1)
        })?;
        let (fc1, bn2, dropout) = (self.fc1.clone(), self.bn2.clone(), self.dropout.clone());
        let h = segment(&h, "fc1", move |h| fc1.forward(h))?;
        let h = segment(&h, "bn2", move |h| {
            let mut h = bn2.forward_t(h, train)?.relu()?;
            if let (true, Some((p, rng))) = (train, &dropout) {
                h = rng.lock().dropout(&h, *p)?;
            }
            Ok(h)
        })?;
        let fc2 = self.fc2.clone();
        segment(&h, "fc2", move |h| fc2.forward(h))
    }
}

/// Sets every parameter (not BatchNorm's statistics), in name order, from a formula of
/// `seed`: the same weights in any process, without a generator.
pub fn init(varmap: &VarMap, seed: u64) -> Result<()> {
    let data = varmap.data().lock().expect("varmap lock");
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for (k, name) in names.into_iter().enumerate() {
        if name.ends_with("running_mean") || name.ends_with("running_var") {
            continue;
        }
        let var = &data[name];
        let n = var.elem_count();
        let values: Vec<f32> = (0..n)
            .map(|i| 0.4 * ((seed as f32) * 0.91 + k as f32 * 1.3 + i as f32 * 0.37).sin())
            .collect();
        let t = Tensor::from_vec(values, var.shape(), var.device())?.to_dtype(var.dtype())?;
        var.set(&t)?;
    }
    Ok(())
}

/// Samples `from..from + n`: images `(n, 1, 8, 8)` whose scale and offset change from sample
/// to sample (so batches have statistics of their own) and a target `(n, 1)`.
pub fn images(from: usize, n: usize) -> Result<(Tensor, Tensor)> {
    let mut x = Vec::with_capacity(n * SIDE * SIDE);
    let mut y = Vec::with_capacity(n);
    for s in from..from + n {
        let s = s as f32;
        let scale = 1.0 + 0.8 * (s * 0.61).sin();
        let offset = 0.5 * (s * 0.23).cos();
        let mut sum = 0.0;
        for a in 0..SIDE {
            for b in 0..SIDE {
                let v = offset + scale * (0.7 * a as f32 + 0.3 * b as f32 + 0.13 * s).sin();
                sum += v;
                x.push(v);
            }
        }
        y.push((sum / (SIDE * SIDE) as f32).tanh());
    }
    Ok((
        Tensor::from_vec(x, (n, 1, SIDE, SIDE), &Device::Cpu)?,
        Tensor::from_vec(y, (n, 1), &Device::Cpu)?,
    ))
}

/// The next value of a moving average of the inputs' mean (the `ema=1` buffer).
pub fn ema_step(ema: &Tensor, x: &Tensor) -> Result<Tensor> {
    (ema * 0.9)? + (x.mean_all()?.reshape(1)? * 0.1)?
}

/// Every variable of `varmap` by name, flattened to f32 values.
pub fn values(varmap: &VarMap) -> Result<std::collections::BTreeMap<String, Vec<f32>>> {
    let data = varmap.data().lock().expect("varmap lock");
    data.iter()
        .map(|(k, v)| {
            let t = v.as_tensor().to_dtype(DType::F32)?.flatten_all()?;
            Ok((k.clone(), t.to_vec1::<f32>()?))
        })
        .collect()
}
