//! Two models with their own optimizers, each with its own loss and backward in the same
//! micro-step, accumulating over windows of 2: each must train exactly as plain candle would.

mod common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Optimizer, VarBuilder, VarMap, SGD};
use ivme::optim::{ParamsSgd, Sgd};
use ivme::Accelerator;

fn data() -> Vec<(Tensor, Tensor)> {
    let mut rng = ivme::rng::Rng::new(3);
    (0..8)
        .map(|_| {
            let x = rng.randn(0.0, 1.0, (4, 3), &Device::Cpu).unwrap();
            let y = x.sum_keepdim(1).unwrap().cos().unwrap();
            (x, y)
        })
        .collect()
}

fn model(seed: u64) -> (VarMap, candle_nn::Linear) {
    let vm = VarMap::new();
    let l = linear(3, 1, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu)).unwrap();
    let mut rng = ivme::rng::Rng::new(seed);
    let data = vm.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for n in names {
        data[n]
            .set(&rng.randn(0.0, 0.5, data[n].shape(), &Device::Cpu).unwrap())
            .unwrap();
    }
    drop(data);
    (vm, l)
}

fn weights(vm: &VarMap) -> Vec<f32> {
    common::flat_weights(vm)
}

#[test]
fn two_models_in_one_loop_each_train_like_plain_candle() {
    let batches = data();
    // The reference: each model steps on the concatenation of each window's two batches.
    let mut expected = Vec::new();
    for (seed, scale) in [(1u64, 1.0f64), (2, 3.0)] {
        let (vm, l) = model(seed);
        let mut opt = SGD::new(vm.all_vars(), 0.1).unwrap();
        for w in batches.chunks(2) {
            let x = Tensor::cat(&[&w[0].0, &w[1].0], 0).unwrap();
            let y = Tensor::cat(&[&w[0].1, &w[1].1], 0).unwrap();
            let loss =
                (candle_nn::loss::mse(&l.forward(&x).unwrap(), &y).unwrap() * scale).unwrap();
            opt.backward_step(&loss).unwrap();
        }
        expected.push(weights(&vm));
    }

    let mut acc = Accelerator::builder()
        .grad_accum(2)
        .cpu(true)
        .build()
        .unwrap();
    let (vm1, l1) = model(1);
    let (vm2, l2) = model(2);
    let p = ParamsSgd {
        lr: 0.1,
        ..Default::default()
    };
    let o1 = Sgd::new(vm1.all_vars(), p).unwrap();
    let o2 = Sgd::new(vm2.all_vars(), p).unwrap();
    let (vm1, vm2, mut o1, mut o2) = acc.prepare((vm1, vm2, o1, o2)).unwrap();
    for (i, (x, y)) in batches.iter().enumerate() {
        acc.micro_step(i, batches.len());
        let loss1 = candle_nn::loss::mse(&l1.forward(x).unwrap(), y).unwrap();
        let g1 = acc.backward(&loss1).unwrap();
        o1.step(&g1).unwrap();
        let loss2 = (candle_nn::loss::mse(&l2.forward(x).unwrap(), y).unwrap() * 3.0).unwrap();
        let g2 = acc.backward(&loss2).unwrap();
        o2.step(&g2).unwrap();
    }
    for (got, want) in [weights(&vm1), weights(&vm2)].iter().zip(&expected) {
        let d = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(d <= 1e-6, "max abs diff {d}");
    }
}
