//! A fine-tune whose optimizer holds only the head of the model's `VarMap`: clipping by the
//! global norm measures the trained gradients only, as PyTorch's `clip_grad_norm_` over the
//! optimizer's parameters does (candle computes the frozen backbone's gradients all the same).
//! Against plain candle clipping the head's gradients and stepping candle-nn's AdamW.

#[path = "reference/mod.rs"]
mod reference;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{linear, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use reference::clipped_window_step;

const MAX_NORM: f64 = 0.05;

fn data(step: usize) -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..16)
        .map(|i| ((i + 16 * step) as f32 * 0.37).sin())
        .collect();
    let x = Tensor::from_vec(x, (4, 4), &Device::Cpu).unwrap();
    let y = x.sum_keepdim(1).unwrap().cos().unwrap();
    (x, y)
}

struct Net {
    backbone: candle_nn::Linear,
    head: candle_nn::Linear,
}

impl Net {
    fn new(varmap: &VarMap) -> Net {
        let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
        let net = Net {
            backbone: linear(4, 8, vb.pp("backbone")).unwrap(),
            head: linear(8, 1, vb.pp("head")).unwrap(),
        };
        // The same weights in both runs, without a generator.
        let data = varmap.data().lock().unwrap();
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        for (k, name) in names.into_iter().enumerate() {
            let v = &data[name];
            let values: Vec<f32> = (0..v.elem_count())
                .map(|i| 0.5 * (k as f32 * 1.3 + i as f32 * 0.71).sin())
                .collect();
            v.set(&Tensor::from_vec(values, v.shape(), &Device::Cpu).unwrap())
                .unwrap();
        }
        drop(data);
        net
    }
    fn forward(&self, x: &Tensor) -> Tensor {
        let h = self.backbone.forward(x).unwrap().tanh().unwrap();
        self.head.forward(&h).unwrap()
    }
}

fn head_vars(varmap: &VarMap) -> Vec<Var> {
    let data = varmap.data().lock().unwrap();
    let mut head: Vec<(String, Var)> = data
        .iter()
        .filter(|(k, _)| k.starts_with("head."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    head.sort_by(|a, b| a.0.cmp(&b.0));
    head.into_iter().map(|(_, v)| v).collect()
}

fn flat(varmap: &VarMap) -> Vec<(String, Vec<f32>)> {
    let data = varmap.data().lock().unwrap();
    let mut out: Vec<(String, Vec<f32>)> = data
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Plain candle: the window's mean gradient, clipped over the head's gradients alone.
fn reference(accum: usize, steps: usize) -> (Vec<(String, Vec<f32>)>, Vec<f64>) {
    let varmap = VarMap::new();
    let net = Net::new(&varmap);
    let head = head_vars(&varmap);
    let mut opt = candle_nn::AdamW::new(head.clone(), ParamsAdamW::default()).unwrap();
    let mut norms = Vec::new();
    for s in 0..steps {
        let losses = (0..accum).map(|j| {
            let (x, y) = data(s * accum + j);
            (candle_nn::loss::mse(&net.forward(&x), &y).unwrap() / accum as f64).unwrap()
        });
        norms.push(clipped_window_step(&mut opt, &head, losses, MAX_NORM));
    }
    (flat(&varmap), norms)
}

fn ivme_run(accum: usize, steps: usize) -> (Vec<(String, Vec<f32>)>, Vec<f64>) {
    let mut acc = ivme::Accelerator::builder()
        .cpu(true)
        .grad_accum(accum)
        .clip_grad_norm(MAX_NORM)
        .build()
        .unwrap();
    let varmap = VarMap::new();
    let net = Net::new(&varmap);
    let frozen_before: Vec<_> = flat(&varmap)
        .into_iter()
        .filter(|(k, _)| k.starts_with("backbone."))
        .collect();
    let opt =
        ivme::optim::AdamW::new(head_vars(&varmap), ivme::optim::ParamsAdamW::default()).unwrap();
    let (varmap, mut opt) = acc.prepare((varmap, opt)).unwrap();
    let mut norms = Vec::new();
    for k in 0..steps * accum {
        let (x, y) = data(k);
        let loss = candle_nn::loss::mse(&net.forward(&x), &y).unwrap();
        let grads = acc.backward(&loss).unwrap();
        if let Some(n) = grads.grad_norm() {
            norms.push(n);
        }
        opt.step(&grads).unwrap();
    }
    let after = flat(&varmap);
    for (k, v) in &frozen_before {
        let now = &after.iter().find(|(n, _)| n == k).unwrap().1;
        assert_eq!(now, v, "the frozen `{k}` moved");
    }
    (after, norms)
}

#[test]
fn clipping_measures_only_what_the_optimizer_trains() {
    // One micro-batch per step (candle's gradients handed through) and two (window sums).
    for accum in [1, 2] {
        let (ours, our_norms) = ivme_run(accum, 4);
        let (want, norms) = reference(accum, 4);
        assert!(
            norms.iter().all(|n| *n > MAX_NORM),
            "the reference must clip: {norms:?}"
        );
        for (a, b) in our_norms.iter().zip(&norms) {
            assert!(
                (a - b).abs() <= 1e-6 * b.max(1.0),
                "accum {accum}: norm {a} vs {b}"
            );
        }
        assert_eq!(
            our_norms.len(),
            norms.len(),
            "accum {accum}: one norm per step"
        );
        for ((k, a), (_, b)) in ours.iter().zip(&want) {
            let d = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            assert!(
                d <= 1e-6,
                "accum {accum}: `{k}` is {d} away from plain candle"
            );
        }
    }
}
