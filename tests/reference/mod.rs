//! Plain candle doing the maths the multi-process tests expect: the harness's model, data and
//! initial weights, trained with candle-nn's own optimizers on whole global batches.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap, SGD};
use std::collections::BTreeMap;

pub struct Mlp {
    a: Linear,
    b: Linear,
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.b.forward(&self.a.forward(xs)?.tanh()?)
    }
}

/// The harness's model with rank 0's initial weights, in plain candle.
#[allow(dead_code)]
pub fn model() -> (VarMap, Mlp) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let m = Mlp {
        a: linear(4, 8, vb.pp("a")).unwrap(),
        b: linear(8, 1, vb.pp("b")).unwrap(),
    };
    let mut rng = ivme::rng::Rng::new(1);
    let data = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names {
        let v = &data[name];
        v.set(&rng.randn(0.0, 0.5, v.shape(), &Device::Cpu).unwrap())
            .unwrap();
    }
    drop(data);
    (varmap, m)
}

/// The harness's data set.
#[allow(dead_code)]
pub fn data(n: usize) -> (Tensor, Tensor) {
    let mut rng = ivme::rng::Rng::new(42);
    let x = rng.randn(0.0, 1.0, (n, 4), &Device::Cpu).unwrap();
    let y = x.sum_keepdim(1).unwrap().sin().unwrap();
    (x, y)
}

/// Gradients of the mean squared error of `m` on samples `idx`.
#[allow(dead_code)]
pub fn loss_on(m: &Mlp, x: &Tensor, y: &Tensor, idx: &[usize]) -> Tensor {
    let i = Tensor::new(
        idx.iter().map(|&i| i as u32).collect::<Vec<_>>(),
        &Device::Cpu,
    )
    .unwrap();
    let out = m.forward(&x.index_select(&i, 0).unwrap()).unwrap();
    candle_nn::loss::mse(&out, &y.index_select(&i, 0).unwrap()).unwrap()
}

/// Trains with candle-nn's optimizer `O` on each global batch in `batches`.
#[allow(dead_code)]
pub fn train<O: Optimizer>(
    n: usize,
    batches: &[Vec<usize>],
    cfg: O::Config,
) -> BTreeMap<String, Vec<f32>> {
    let (varmap, m) = model();
    let (x, y) = data(n);
    let mut opt = O::new(varmap.all_vars(), cfg).unwrap();
    for b in batches {
        opt.backward_step(&loss_on(&m, &x, &y, b)).unwrap();
    }
    params(&varmap)
}

/// Every variable's values by name.
#[allow(dead_code)]
pub fn params(varmap: &VarMap) -> BTreeMap<String, Vec<f32>> {
    varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            )
        })
        .collect()
}

/// Consecutive global batches of `size` from `order`.
#[allow(dead_code)]
pub fn chunks(order: &[usize], size: usize, count: usize) -> Vec<Vec<usize>> {
    order.chunks(size).take(count).map(|c| c.to_vec()).collect()
}

/// The largest absolute difference between two sets of parameters with the same names.
#[allow(dead_code)]
pub fn max_diff(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f32 {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "different variables"
    );
    a.iter()
        .flat_map(|(k, va)| va.iter().zip(&b[k]).map(|(x, y)| (x - y).abs()))
        .fold(0.0, f32::max)
}

#[allow(dead_code)]
/// PyTorch's clip_grad_norm_ on plain candle gradients, then one SGD step per batch.
pub fn clipped(
    n: usize,
    batches: &[Vec<usize>],
    lr: f64,
    max_norm: f64,
) -> (BTreeMap<String, Vec<f32>>, Vec<f64>) {
    let (varmap, m) = model();
    let (x, y) = data(n);
    let vars = varmap.all_vars();
    let mut opt = SGD::new(vars.clone(), lr).unwrap();
    let mut norms = Vec::new();
    for b in batches {
        let mut grads = loss_on(&m, &x, &y, b).backward().unwrap();
        let total = global_norm(vars.iter().map(|v| grads.get(v).unwrap()));
        norms.push(total);
        let coef = (max_norm / (total + 1e-6)).min(1.0);
        for v in &vars {
            let g = grads.remove(v).unwrap();
            grads.insert(v, (g * coef).unwrap());
        }
        opt.step(&grads).unwrap();
    }
    (params(&varmap), norms)
}

#[allow(dead_code)]
pub fn initial() -> BTreeMap<String, Vec<f32>> {
    params(&model().0)
}

#[allow(dead_code)]
pub fn update(after: &BTreeMap<String, Vec<f32>>) -> Vec<f32> {
    let init = initial();
    after
        .iter()
        .flat_map(|(k, v)| {
            v.iter()
                .zip(&init[k])
                .map(|(a, b)| a - b)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[allow(dead_code)]
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let num: f32 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).powi(2))
        .sum::<f32>()
        .sqrt();
    let den: f32 = b.iter().map(|y| y * y).sum::<f32>().sqrt();
    num / den
}

/// One optimizer step of plain candle over a window: the gradients of `losses` (each already
/// divided by the window's length) summed per variable of `vars`, clipped by their global L2
/// norm to `max_norm` as PyTorch's `clip_grad_norm_` over the optimizer's parameters does
/// (coefficient `max_norm / (norm + 1e-6)`, at most 1), and handed to `opt`. Returns the norm.
#[allow(dead_code)]
pub fn clipped_window_step<O: Optimizer>(
    opt: &mut O,
    vars: &[candle_core::Var],
    losses: impl IntoIterator<Item = Tensor>,
    max_norm: f64,
) -> f64 {
    let mut sums: Vec<Option<Tensor>> = vec![None; vars.len()];
    for loss in losses {
        let g = loss.backward().unwrap();
        for (sum, v) in sums.iter_mut().zip(vars) {
            let gv = g.get(v.as_tensor()).unwrap().clone();
            *sum = Some(match sum.take() {
                Some(s) => (s + gv).unwrap(),
                None => gv,
            });
        }
    }
    let sums: Vec<Tensor> = sums.into_iter().map(Option::unwrap).collect();
    let norm = global_norm(sums.iter());
    let coef = (max_norm / (norm + 1e-6)).min(1.0);
    let mut store = candle_core::backprop::GradStore::default();
    for (v, g) in vars.iter().zip(sums) {
        store.insert(v.as_tensor(), (g * coef).unwrap());
    }
    opt.step(&store).unwrap();
    norm
}

/// The L2 norm of all of `grads` together, in f64.
#[allow(dead_code)]
pub fn global_norm<'a>(grads: impl Iterator<Item = &'a Tensor>) -> f64 {
    grads
        .map(|g| {
            g.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64
        })
        .sum::<f64>()
        .sqrt()
}
