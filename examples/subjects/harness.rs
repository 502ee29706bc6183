//! A configurable training run used by the multi-process tests: trains a small MLP with the
//! runtime API and writes what happened (final weights, per-micro-step collectives, learning
//! rates) to `out/rank{R}.json` so a test can compare it with plain candle.
//!
//! Arguments are `key=value`: `opt=sgd|adamw steps=K batch=B n=N accum=A precision=no|fp16|bf16
//! cpu=0|1 lr=F momentum=F clip_norm=F clip_value=F sharding=no|optimizer|gradients shuffle=0|1 sched=none|step|warmup dropout=P project=DIR save_at=K save_every=K resume=1 resume_any=1 step_ms=MS resave=DIR model_in=FILE model_out=DIR async=0|1 ckpt=0|1 overlap=0|1 break=rng|loader|scheduler|optimizer loss_scale=F init_scale=F inject_inf_at=I out=DIR`.
//! `steps` counts micro-steps in all (a resumed run trains only the rest; none when the loaded
//! state is already there); `resave` saves the state again right after the load; `model_out`
//! saves the model (`save_model`) at the end; `model_in` loads one (`load_model`) after prepare.
//! `resume_any=1` resumes from the project's newest checkpoint when there is one (as a program
//! restarted by `--max_restarts` does, saying `resumed at step K on N processes`),
//! `save_every=K` saves every K micro-steps and trains on, `step_ms=MS` waits that long after
//! each micro-step (so a test can act mid-run).

use candle_core::{DType, Module, Tensor};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap};
use ivme::checkpoint::ProjectConfiguration;
use ivme::data::{DataLoader, TensorDataset};
use ivme::optim::{AdamW, LrScheduler, ParamsAdamW, ParamsSgd, Sgd, StepLr, WarmupLinear};
use ivme::optim::{Linked, StatefulOptimizer};
use ivme::rng::Rng;
use ivme::stateful::{Shared, StateDict, Stateful};
use ivme::{Accelerator, Gradients, Precision, Sharding};
use std::collections::BTreeMap;

/// The MLP every multi-process test trains: 4 → 8 (tanh, optional dropout) → 1.
pub struct Mlp {
    a: Linear,
    b: Linear,
    // Dropout draws from the Accelerator's saved generator, so a resumed run draws the same.
    dropout: Option<(f32, Shared<Rng>)>,
}

impl Mlp {
    fn new(vb: VarBuilder, dropout: Option<(f32, Shared<Rng>)>) -> candle_core::Result<Self> {
        Ok(Mlp {
            a: linear(4, 8, vb.pp("a"))?,
            b: linear(8, 1, vb.pp("b"))?,
            dropout,
        })
    }
}

impl Module for Mlp {
    // Each layer is a checkpointed segment: recomputed in backward under `ckpt=1`, run
    // directly otherwise.
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let (a, dropout) = (self.a.clone(), self.dropout.clone());
        // Under ZeRO-3 each layer's weights (`a.…`, `b.…`) are gathered for its segment.
        let h = ivme::activations::segment(xs, "a", move |x| {
            let mut h = a.forward(x)?.tanh()?;
            if let Some((p, rng)) = &dropout {
                h = rng.lock().dropout(&h, *p)?;
            }
            Ok(h)
        })?;
        let b = self.b.clone();
        ivme::activations::segment(&h, "b", move |h| b.forward(h))
    }
}

/// How many micro-steps this run has done, saved with the state so a resumed run knows.
struct Progress {
    micro: u64,
}

impl Stateful for Progress {
    fn state_dict(&self) -> ivme::Result<StateDict> {
        Ok(StateDict::json(serde_json::json!({ "micro": self.micro })))
    }
    fn load_state_dict(&mut self, state: &StateDict) -> ivme::Result<()> {
        self.micro = state.json["micro"].as_u64().unwrap_or(0);
        Ok(())
    }
}

struct Args(BTreeMap<String, String>);

impl Args {
    fn parse() -> Self {
        Args(
            std::env::args()
                .skip(1)
                .filter_map(|a| {
                    a.split_once('=')
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                })
                .collect(),
        )
    }
    fn get<T: std::str::FromStr>(&self, k: &str, default: T) -> T {
        self.0
            .get(k)
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    }
    fn str(&self, k: &str, default: &str) -> String {
        self.0
            .get(k)
            .cloned()
            .unwrap_or_else(|| default.to_string())
    }
}

enum Opt {
    Sgd(ivme::optim::AcceleratedOptimizer<Sgd>),
    AdamW(ivme::optim::AcceleratedOptimizer<AdamW>),
}

impl Opt {
    fn step(&mut self, g: &Gradients) -> ivme::Result<()> {
        match self {
            Opt::Sgd(o) => o.step(g),
            Opt::AdamW(o) => o.step(g),
        }
    }
    fn lr(&self) -> f64 {
        match self {
            Opt::Sgd(o) => o.learning_rate(),
            Opt::AdamW(o) => o.learning_rate(),
        }
    }
    fn skipped(&self) -> bool {
        match self {
            Opt::Sgd(o) => o.optimizer_step_was_skipped(),
            Opt::AdamW(o) => o.optimizer_step_was_skipped(),
        }
    }
}

fn main() -> ivme::Result<()> {
    let args = Args::parse();
    let zero3 = args.str("sharding", "no").parse::<Sharding>()? == Sharding::Parameters;
    let precision: Precision = args.str("precision", "no").parse()?;
    let mut builder = Accelerator::builder()
        .grad_accum(args.get("accum", 1))
        .precision(precision)
        // The CPU unless `cpu=0` (scripts/gpu-check.sh compares a GPU's run with the CPU's).
        .cpu(args.get("cpu", 1u8) == 1);
    // Left to the launcher's environment (IVME_SHARDING) unless given.
    if let Some(s) = args.0.get("sharding") {
        builder = builder.sharding(s.parse::<Sharding>()?);
    }
    if let Some(v) = args.0.get("clip_norm").and_then(|v| v.parse().ok()) {
        builder = builder.clip_grad_norm(v);
    }
    if let Some(v) = args.0.get("clip_value").and_then(|v| v.parse().ok()) {
        builder = builder.clip_grad_value(v);
    }
    if let Some(v) = args.0.get("init_scale").and_then(|v| v.parse().ok()) {
        builder = builder.initial_loss_scale(v);
    }
    if args.get("async", 0u8) == 1 {
        builder = builder.async_checkpoints(true);
    }
    if args.get("ckpt", 0u8) == 1 {
        builder = builder.activation_checkpointing(true);
    }
    if args.get("overlap", 0u8) == 1 {
        builder = builder.overlap(true);
    }
    let mut acc = builder.build()?;
    let dev = acc.device().clone();
    let rank = acc.process_index();

    let varmap = VarMap::new();
    let dropout: f32 = args.get("dropout", 0.0);
    let dropout = (dropout > 0.0).then(|| (dropout, acc.rng()));
    let model = Mlp::new(
        VarBuilder::from_varmap(&varmap, acc.param_dtype(DType::F32), &dev),
        dropout,
    )?;
    // Each rank starts from different weights: prepare must make them all rank 0's.
    init_weights(&varmap, 1 + 1000 * rank as u64)?;

    let n: usize = args.get("n", 64);
    let data = dataset(n)?;
    let loss_mult: f64 = args.get("loss_scale", 1.0);
    let lr: f64 = args.get("lr", 0.05);
    let opt_name = args.str("opt", "sgd");
    let loader = DataLoader::new(data, args.get("batch", 4))
        .shuffle(args.get("shuffle", 0u8) == 1)
        .seed(11);
    let (varmap, mut loader) = acc.prepare((varmap, loader))?;
    let mut opt = match opt_name.as_str() {
        "adamw" => Opt::AdamW(acc.prepare(AdamW::new(
            varmap.all_vars(),
            ParamsAdamW {
                lr,
                weight_decay: 0.01,
                ..Default::default()
            },
        )?)?),
        _ => Opt::Sgd(acc.prepare(Sgd::new(
            varmap.all_vars(),
            ParamsSgd {
                lr,
                momentum: args.get("momentum", 0.0),
                ..Default::default()
            },
        )?)?),
    };
    let mut sched = match (args.str("sched", "none").as_str(), &opt) {
        ("step", Opt::Sgd(o)) => Some(LrScheduler::new(o, StepLr::new(1, 0.5)?)),
        ("step", Opt::AdamW(o)) => Some(LrScheduler::new(o, StepLr::new(1, 0.5)?)),
        ("warmup", Opt::Sgd(o)) => Some(LrScheduler::new(o, WarmupLinear::new(4, 30)?)),
        ("warmup", Opt::AdamW(o)) => Some(LrScheduler::new(o, WarmupLinear::new(4, 30)?)),
        _ => None,
    };

    if let Some(dir) = args.0.get("project") {
        acc.set_project_configuration(
            ProjectConfiguration::new(dir)
                .automatic_checkpoint_naming(true)
                .total_limit(2),
        )?;
    }
    if let Some(file) = args.0.get("model_in") {
        acc.load_model(std::path::Path::new(file))?;
    }
    let progress = acc.register_for_checkpointing(Progress { micro: 0 });
    // As a restartable program does: resume from the newest checkpoint when there is one.
    if args.get("resume_any", 0u8) == 1 && acc.load_state_if_any()?.is_some() {
        let line = format!(
            "resumed at step {} on {} processes",
            progress.lock().micro,
            acc.num_processes()
        );
        acc.print(line);
    }
    if args.get("resume", 0u8) == 1 {
        acc.load_state(None)?;
        // Negative controls: throw away one restored piece to show the tests would notice.
        match args.str("break", "none").as_str() {
            "rng" => *acc.rng().lock() = Rng::new(12345),
            "loader" => {
                let mut p = loader.position();
                p.consumed = 0;
                loader.set_position(p)?;
            }
            // The scheduler's whole state is the real-step count it reads from the optimizer.
            "scheduler" => match &opt {
                Opt::Sgd(o) => o.link().set_steps(0),
                Opt::AdamW(o) => o.link().set_steps(0),
            },
            "optimizer" => {
                if let Opt::AdamW(o) = &mut opt {
                    let fresh = AdamW::new(
                        o.inner().vars().to_vec(),
                        ParamsAdamW {
                            lr: o.learning_rate(),
                            weight_decay: 0.01,
                            ..Default::default()
                        },
                    )?;
                    let mut st = fresh.state_dict()?;
                    st.scalars["step"] = o.inner().state_dict()?.scalars["step"].clone();
                    o.inner().load_state_dict(&st)?;
                }
            }
            _ => {}
        }
    }
    // A copy of the state as loaded, saved at once (on this run's number of processes and
    // layout), for tests that compare it with the checkpoint it was loaded from.
    if let Some(dir) = args.0.get("resave") {
        acc.save_state(Some(std::path::Path::new(dir)))?;
    }
    let save_at: u64 = args.get("save_at", 0);
    let save_every: u64 = args.get("save_every", 0);
    let step_ms: u64 = args.get("step_ms", 0);
    let steps: usize = args.get("steps", 4);
    let already = progress.lock().micro as usize >= steps;
    let inject_inf_at: i64 = args.get("inject_inf_at", -1);
    let mut micro = Vec::new();
    let mut micro_index = 0i64;
    'outer: loop {
        if already {
            break;
        }
        for batch in loader.iter() {
            let (x, y) = batch?;
            let before = acc.collective_count();
            let out = acc.autocast(|ac| model.forward(&ac.input(&x)?))?;
            let mut loss = (candle_nn::loss::mse(&out, &y)? * loss_mult)?;
            if micro_index == inject_inf_at {
                loss = (loss * f64::INFINITY)?;
            }
            let grads = acc.backward(&loss)?;
            let norm = grads.grad_norm();
            opt.step(&grads)?;
            if let Some(s) = sched.as_mut() {
                s.step();
            }
            micro.push(serde_json::json!({
                "sync": grads.is_sync_step(),
                "collectives": acc.collective_count() - before,
                "lr": opt.lr(),
                "skipped": opt.skipped(),
                "overflow": grads.found_overflow(),
                "norm": norm,
                "out_dtype": format!("{:?}", out.dtype()),
                "loss": loss.to_dtype(DType::F32)?.to_scalar::<f32>()?,
                "param_sum": param_sum(&acc, zero3)?,
            }));
            micro_index += 1;
            let done = {
                let mut p = progress.lock();
                p.micro += 1;
                p.micro
            };
            if done == save_at {
                acc.save_state(None)?;
                // An asynchronous save is committed here.
                acc.wait_for_checkpoint()?;
                return Ok(());
            }
            if done as usize >= steps {
                break 'outer;
            }
            if save_every > 0 && done % save_every == 0 {
                acc.save_state(None)?;
            }
            std::thread::sleep(std::time::Duration::from_millis(step_ms));
        }
    }
    if let Some(dir) = args.0.get("model_out") {
        acc.save_model(std::path::Path::new(dir), None)?;
    }
    // Under ZeRO-3 the blocks' weights are read whole from every process's slice.
    let weights = weights(&acc, zero3)?;
    let params: BTreeMap<String, Vec<f32>> = weights
        .into_iter()
        .map(|(k, t)| {
            let t = t.to_dtype(DType::F32)?;
            Ok((k, t.flatten_all()?.to_vec1::<f32>()?))
        })
        .collect::<candle_core::Result<_>>()?;
    let compute_dtype = format!("{:?}", varmap.all_vars()[0].dtype());
    let held = acc.held_bytes()?;
    let report = serde_json::json!({
        "rank": rank, "world": acc.num_processes(), "params": params, "micro": micro,
        "held": { "weights": held.weights, "masters": held.masters,
                  "gradients": held.gradients, "optimizer": held.optimizer },
        "compute_dtype": compute_dtype,
        "scale": acc.scaler().map(|s| s.scale),
        "checkpointing": acc.activation_checkpointing(),
        "recompute_s": acc.step_times().recompute,
    });
    let out = args.str("out", ".");
    std::fs::create_dir_all(&out).map_err(|e| ivme::Error::io(format!("creating {out}"), e))?;
    let path = format!("{out}/rank{rank}.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&report)?)
        .map_err(|e| ivme::Error::io(format!("writing {path}"), e))?;
    // One line to compare runs by (scripts/gpu-check.sh: a GPU's result against the CPU's).
    let squares: f64 = params
        .values()
        .flatten()
        .map(|&x| f64::from(x).powi(2))
        .sum();
    acc.print(format!(
        "harness: trained on {:?}; sum of squared master weights {squares:.9}",
        dev.location()
    ));
    Ok(())
}

/// The weights by name: under ZeRO-3 (`zero3`) the f32 masters put together from every
/// process's slice (a collective), otherwise the variables the model computes with.
fn weights(acc: &Accelerator, zero3: bool) -> ivme::Result<Vec<(String, Tensor)>> {
    Ok(match zero3 {
        true => acc.whole_masters()?,
        false => acc
            .named_master_vars()
            .into_iter()
            .map(|(k, v)| (k, v.as_tensor().clone()))
            .collect(),
    })
}

/// A fingerprint of the master weights, to see on which micro-steps they change.
/// Under ZeRO-3 (`zero3`) they are put together from every process's slice.
fn param_sum(acc: &Accelerator, zero3: bool) -> ivme::Result<f64> {
    let weights = weights(acc, zero3)?;
    let mut s = 0f64;
    for (_, t) in weights {
        let t = t.to_dtype(DType::F32)?;
        s += t.abs()?.sum_all()?.to_scalar::<f32>()? as f64;
    }
    Ok(s)
}

/// Sets every variable, in name order, from a generator seeded with `seed`.
fn init_weights(varmap: &VarMap, seed: u64) -> ivme::Result<()> {
    let mut rng = Rng::new(seed);
    let data = varmap.data().lock().expect("varmap lock");
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names {
        let var = &data[name];
        let t = rng
            .randn(0.0, 0.5, var.shape(), var.device())?
            .to_dtype(var.dtype())?;
        var.set(&t)?;
    }
    Ok(())
}

/// n samples of 4 features with a smooth target, the same on every rank.
fn dataset(n: usize) -> ivme::Result<TensorDataset<(Tensor, Tensor)>> {
    let mut rng = Rng::new(42);
    let x = rng.randn(0.0, 1.0, (n, 4), &candle_core::Device::Cpu)?;
    let y = x.sum_keepdim(1)?.sin()?;
    TensorDataset::new((x, y))
}
