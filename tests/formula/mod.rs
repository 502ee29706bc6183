//! What the tests that run the `zero_buckets` subject share: plain candle's weights for its
//! model and data, each rank's saved weights, and how far apart two sets are.
//!
//! Include it with `mod formula;`.

#[path = "../../examples/support/formula_model.rs"]
mod formula_model;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use formula_model::{init, loss, rows, WIDTHS};
use std::collections::HashMap;
use std::path::Path;

/// Plain candle on one process, each step on the whole global batch (`world × batch` rows).
pub fn reference(scale: usize, steps: usize, batch: usize, world: usize) -> Vec<Vec<f32>> {
    let vars: Vec<Var> = (0..WIDTHS.len())
        .map(|i| Var::from_tensor(&init(i, scale).unwrap()).unwrap())
        .collect();
    let ws: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let mut opt = AdamW::new(vars.clone(), ParamsAdamW::default()).unwrap();
    for step in 0..steps {
        let x = rows(step * batch * world, batch * world).unwrap();
        opt.backward_step(&loss(&x, &ws).unwrap()).unwrap();
    }
    vars.iter()
        .map(|v| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap())
        .collect()
}

/// Each rank's weights as the subject saved them to `out/rank{R}.safetensors`, `w0..w7`
/// flattened.
pub fn weights(out: &Path, rank: usize) -> Vec<Vec<f32>> {
    let file = out.join(format!("rank{rank}.safetensors"));
    let mut t: HashMap<String, Tensor> = candle_core::safetensors::load(&file, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    (0..WIDTHS.len())
        .map(|i| {
            let w = t.remove(&format!("w{i}")).expect("every matrix saved");
            let w = w.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            w.to_vec1().unwrap()
        })
        .collect()
}

/// The largest difference between two sets of weights, element by element.
pub fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
