//! The same training written three ways for the equivalence tests: under `#[accelerate]`
//! (over the `Vec` of batches, or `batches.iter().enumerate()`),
//! by hand against the runtime, and (in the test) as plain candle.
//!
//! `macro_check mode=macro|macro_enumerate|macro_zero2|hand accum=1|2 steps=K out=DIR` trains the harness's MLP on
//! consecutive batches of 4 samples and writes this rank's final weights to `DIR/rank{R}.json`.
//! `mode=seeded` writes the MLP's initial weights under `#[accelerate(seed = 5)]` instead.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap};
use ivme::optim::Sgd;
use ivme::rng::Rng;
use ivme::Accelerator;
use std::collections::BTreeMap;

struct Mlp {
    a: Linear,
    b: Linear,
}

impl Mlp {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Mlp {
            a: linear(4, 8, vb.pp("a"))?,
            b: linear(8, 1, vb.pp("b"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.b.forward(&self.a.forward(xs)?.tanh()?)
    }
}

/// Rank-dependent starting weights: preparing must replace them with rank 0's.
fn init(varmap: &VarMap, rank: usize) -> candle_core::Result<()> {
    let mut rng = Rng::new(1 + 1000 * rank as u64);
    let data = varmap.data().lock().expect("varmap lock");
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names {
        let v = &data[name];
        // In the variable's dtype: a launcher may make the weights 16-bit.
        v.set(
            &rng.randn(0.0, 0.5, v.shape(), v.device())?
                .to_dtype(v.dtype())?,
        )?;
    }
    Ok(())
}

fn batches(count: usize) -> candle_core::Result<Vec<(Tensor, Tensor)>> {
    let mut rng = Rng::new(42);
    let x = rng.randn(0.0, 1.0, (count * 4, 4), &Device::Cpu)?;
    let y = x.sum_keepdim(1)?.sin()?;
    (0..count)
        .map(|i| Ok((x.narrow(0, i * 4, 4)?, y.narrow(0, i * 4, 4)?)))
        .collect()
}

fn weights(varmap: &VarMap) -> candle_core::Result<BTreeMap<String, Vec<f32>>> {
    let data = varmap.data().lock().expect("varmap lock");
    data.iter()
        .map(|(k, v)| {
            let t = v.as_tensor().to_dtype(DType::F32)?.flatten_all()?;
            Ok((k.clone(), t.to_vec1::<f32>()?))
        })
        .collect()
}

fn write(out: &str, rank: usize, w: &BTreeMap<String, Vec<f32>>) -> candle_core::Result<()> {
    std::fs::create_dir_all(out)?;
    let json = serde_json::json!({ "params": w });
    std::fs::write(format!("{out}/rank{rank}.json"), json.to_string())?;
    Ok(())
}

#[ivme::accelerate]
fn train_macro(batches: Vec<(Tensor, Tensor)>, out: &str) -> candle_core::Result<()> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
    init(&varmap, accelerator.process_index())?;
    let mut opt = Sgd::new(
        varmap.all_vars(),
        ivme::optim::ParamsSgd {
            lr: 0.1,
            ..Default::default()
        },
    )?;
    for (inputs, targets) in batches {
        let outputs = model.forward(&inputs.to_device(&device)?)?;
        let loss = candle_nn::loss::mse(&outputs, &targets.to_device(&device)?)?;
        let grads = loss.backward()?;
        opt.step(&grads)?;
    }
    write(out, accelerator.process_index(), &weights(&varmap)?)
}

#[ivme::accelerate(grad_accum = 2)]
fn train_macro_accum(batches: Vec<(Tensor, Tensor)>, out: &str) -> candle_core::Result<()> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
    init(&varmap, accelerator.process_index())?;
    let mut opt = Sgd::new(
        varmap.all_vars(),
        ivme::optim::ParamsSgd {
            lr: 0.1,
            ..Default::default()
        },
    )?;
    for (inputs, targets) in batches {
        let outputs = model.forward(&inputs.to_device(&device)?)?;
        let loss = candle_nn::loss::mse(&outputs, &targets.to_device(&device)?)?;
        let grads = loss.backward()?;
        opt.step(&grads)?;
    }
    write(out, accelerator.process_index(), &weights(&varmap)?)
}

/// The accumulating loop again, with ZeRO stage 2: every process keeps its slice of the
/// masters, optimizer state and gradients.
#[ivme::accelerate(grad_accum = 2, zero = 2)]
fn train_macro_zero2(batches: Vec<(Tensor, Tensor)>, out: &str) -> candle_core::Result<()> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
    init(&varmap, accelerator.process_index())?;
    let params = ivme::optim::ParamsSgd {
        lr: 0.1,
        ..Default::default()
    };
    let mut opt = Sgd::new(varmap.all_vars(), params)?;
    for (inputs, targets) in &batches {
        let loss = candle_nn::loss::mse(&model.forward(&inputs)?, &targets)?;
        opt.backward_step(&loss)?;
    }
    let rank = accelerator.process_index();
    write(out, rank, &weights(&varmap)?)?;
    // What this process holds, for the test to see the sharding took effect.
    let held = accelerator.held_bytes()?;
    let json = serde_json::json!({
        "masters": held.masters,
        "optimizer": held.optimizer,
        "gradients": held.gradients,
    });
    std::fs::write(format!("{out}/held{rank}.json"), json.to_string())?;
    Ok(())
}

/// The most common batch loop in candle code: by reference, numbered.
#[ivme::accelerate]
fn train_macro_enumerate(batches: Vec<(Tensor, Tensor)>, out: &str) -> candle_core::Result<()> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
    init(&varmap, accelerator.process_index())?;
    let mut opt = Sgd::new(
        varmap.all_vars(),
        ivme::optim::ParamsSgd {
            lr: 0.1,
            ..Default::default()
        },
    )?;
    let mut last = None;
    for (i, (inputs, targets)) in batches.iter().enumerate() {
        // `i` numbers this process's batches: 0, 1, 2, ...
        assert_eq!(
            i,
            last.map_or(0, |l| l + 1),
            "enumerate counts this process's batches"
        );
        last = Some(i);
        let outputs = model.forward(&inputs.to_device(&device)?)?;
        let loss = candle_nn::loss::mse(&outputs, &targets.to_device(&device)?)?;
        let grads = loss.backward()?;
        opt.step(&grads)?;
    }
    write(out, accelerator.process_index(), &weights(&varmap)?)
}

/// The same loop written by hand against the runtime.
fn train_hand(batches: Vec<(Tensor, Tensor)>, accum: usize, out: &str) -> ivme::Result<()> {
    let mut acc = Accelerator::builder().grad_accum(accum).build()?;
    let (rank, world) = (acc.process_index(), acc.num_processes());
    let varmap = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(
        &varmap,
        acc.param_dtype(DType::F32),
        acc.device(),
    ))?;
    init(&varmap, rank)?;
    let opt = Sgd::new(
        varmap.all_vars(),
        ivme::optim::ParamsSgd {
            lr: 0.1,
            ..Default::default()
        },
    )?;
    let (varmap, mut opt) = acc.prepare((varmap, opt))?;
    let mine: Vec<_> = batches.into_iter().skip(rank).step_by(world).collect();
    for (i, (inputs, targets)) in mine.iter().enumerate() {
        acc.micro_step(i, mine.len());
        let outputs = acc.autocast(|ac| model.forward(&ac.input(inputs)?))?;
        let loss = candle_nn::loss::mse(&outputs, targets)?;
        let grads = acc.backward(&loss)?;
        opt.step(&grads)?;
    }
    Ok(write(out, rank, &weights(&varmap)?)?)
}

/// The MLP as the attribute's `seed` initialises it, untrained.
#[ivme::accelerate(seed = 5)]
fn initial_macro(out: &str) -> candle_core::Result<()> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let _model = Mlp::new(VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
    write(out, accelerator.process_index(), &weights(&varmap)?)
}

fn main() -> ivme::Result<()> {
    let args: BTreeMap<String, String> = std::env::args()
        .skip(1)
        .filter_map(|a| {
            a.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    let get = |k: &str, d: &str| args.get(k).cloned().unwrap_or_else(|| d.to_string());
    let steps: usize = get("steps", "8").parse().unwrap_or(8);
    let accum: usize = get("accum", "1").parse().unwrap_or(1);
    let out = get("out", ".");
    let data = batches(steps)?;
    match (get("mode", "macro").as_str(), accum) {
        ("hand", _) => train_hand(data, accum, &out),
        ("seeded", _) => Ok(initial_macro(&out)?),
        ("macro_enumerate", _) => Ok(train_macro_enumerate(data, &out)?),
        ("macro_zero2", _) => Ok(train_macro_zero2(data, &out)?),
        (_, 1) => Ok(train_macro(data, &out)?),
        _ => Ok(train_macro_accum(data, &out)?),
    }
}
