//! The fine-tune the LoRA tests, example and benchmark share: a "pretrained" residual MLP
//! (`blocks.{i}.fc1`, `blocks.{i}.fc2`) saved as a Hugging Face folder, LoRA on both linears of
//! every block, and a new head; its data; and the deterministic starting values both ivme's run
//! and the plain-candle reference give the adapters, so they start from the same weights.
//!
//! Include it with `#[path = "support/finetune_net.rs"] mod finetune_net;`.
#![allow(dead_code)]

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, VarBuilder};
use ivme::finetune::{Lora, LoraLinear};
use std::collections::HashMap;
use std::path::Path;

/// The residual MLP with LoRA wherever `lora`'s targets say, and a new one-output head.
pub struct Net {
    blocks: Vec<(LoraLinear, LoraLinear)>,
    head: Linear,
}

impl Net {
    /// The model of `dims`, its weights from `vb`.
    pub fn new(vb: VarBuilder, lora: &Lora, dims: Dims) -> candle_core::Result<Net> {
        let (d, h) = (dims.d, dims.h);
        let blocks = (0..dims.blocks)
            .map(|b| {
                let vb = vb.pp(format!("blocks.{b}"));
                Ok((
                    lora.linear(d, h, vb.pp("fc1"))?,
                    lora.linear(h, d, vb.pp("fc2"))?,
                ))
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Net {
            blocks,
            head: linear(d, 1, vb.pp("head"))?,
        })
    }
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for (fc1, fc2) in &self.blocks {
            h = (&h + fc2.forward(&fc1.forward(&h)?.tanh()?)?)?;
        }
        self.head.forward(&h)
    }
}

/// The model's sizes.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    /// Width of the residual stream.
    pub d: usize,
    /// Width inside a block.
    pub h: usize,
    /// Number of blocks.
    pub blocks: usize,
}

/// The tests' small model.
pub const SMALL: Dims = Dims {
    d: 16,
    h: 32,
    blocks: 2,
};

/// A value that depends on `k` and `i` only, in [-scale, scale].
fn wave(k: usize, i: usize, scale: f32) -> f32 {
    scale * ((k as f32 * 1.37 + i as f32 * 0.61).sin())
}

fn filled(k: usize, shape: &[usize], scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| wave(k, i, scale)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).expect("shape matches")
}

/// The pretrained weights, by name.
pub fn base_tensors(dims: Dims) -> HashMap<String, Tensor> {
    let mut t = HashMap::new();
    for b in 0..dims.blocks {
        let s1 = 1.0 / (dims.d as f32).sqrt();
        let s2 = 1.0 / (dims.h as f32).sqrt();
        t.insert(
            format!("blocks.{b}.fc1.weight"),
            filled(10 * b + 1, &[dims.h, dims.d], s1),
        );
        t.insert(
            format!("blocks.{b}.fc1.bias"),
            filled(10 * b + 2, &[dims.h], 0.1),
        );
        t.insert(
            format!("blocks.{b}.fc2.weight"),
            filled(10 * b + 3, &[dims.d, dims.h], s2),
        );
        t.insert(
            format!("blocks.{b}.fc2.bias"),
            filled(10 * b + 4, &[dims.d], 0.1),
        );
    }
    t
}

/// Sets every variable of `varmap` the base folder `dir` holds to the base's value: the
/// one-`VarMap` layout, where the base's weights are variables too.
pub fn load_into(varmap: &candle_nn::VarMap, dir: &Path) -> candle_core::Result<()> {
    let data = varmap.data().lock().expect("varmap");
    let device = data
        .values()
        .next()
        .map_or(Device::Cpu, |v| v.device().clone());
    for (name, value) in candle_core::safetensors::load(dir.join("model.safetensors"), &device)? {
        data[&name].set(&value.to_dtype(data[&name].dtype())?)?;
    }
    Ok(())
}

/// Writes the pretrained model as a Hugging Face folder: `model.safetensors` and `config.json`.
pub fn write_base(dir: &Path, dims: Dims) {
    std::fs::create_dir_all(dir).expect("base folder");
    candle_core::safetensors::save(&base_tensors(dims), dir.join("model.safetensors"))
        .expect("base weights");
    let config = format!(
        "{{\"model_type\": \"residual_mlp\", \"d\": {}, \"h\": {}, \"blocks\": {}}}",
        dims.d, dims.h, dims.blocks
    );
    std::fs::write(dir.join("config.json"), config).expect("base config");
}

/// The starting value of a trained variable (an adapter factor, the head), by name and shape:
/// B is not zero, so the first steps move A too.
pub fn start_value(name: &str, shape: &[usize]) -> Tensor {
    let k = name.bytes().map(usize::from).sum::<usize>();
    filled(k, shape, 0.2)
}

/// Micro-batch `j` of the run: 4 rows of `d` inputs and one target each.
pub fn batch(j: usize, d: usize) -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..4 * d)
        .map(|i| ((i + 7 * j) as f32 * 0.37).sin())
        .collect();
    let x = Tensor::from_vec(x, (4, d), &Device::Cpu).expect("batch");
    let y = x.sum_keepdim(1).expect("sum").cos().expect("cos");
    (x, y)
}

/// Every value of `t` as f32, flattened.
pub fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .expect("a tensor's values")
}
