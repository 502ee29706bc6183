//! Test subject for buffers (tests/buffers.rs): trains the conv net of `support/cnn.rs`, whose
//! BatchNorm layers keep running statistics, through the runtime API, and writes each rank's
//! final variables, buffer names and eval-mode outputs to `out/rank{R}.json`.
//!
//! Arguments are `key=value`: `steps=K` micro-steps in all, `batch=B` samples per rank and
//! micro-step (micro-step k of rank r takes samples from `(k·W + r)·B`), `accum=A`,
//! `lr=F`, `sharding=no|optimizer|gradients|parameters`, `buffers=broadcast|average|local` (else the
//! launcher's), `precision=no|bf16|fp16`, `save_at=K dir=DIR` (save the state after micro-step
//! K), `resume=DIR` (load it first), `model_out=DIR` (`save_model` at the end), `out=DIR`,
//! `ema=1` (a moving average of the inputs, `ema.seen`, kept in the model's `VarMap` and never
//! declared a buffer: ivme must find it), `dropout=P` (dropout before the last layer, its masks
//! from `set_seed(7, true)`'s generator: each rank its own stream, saved with the state).

#[path = "../support/cnn.rs"]
mod cnn;

use candle_core::{DType, ModuleT, Var};
use candle_nn::{Optimizer, VarMap};
use ivme::optim::{AdamW, ParamsAdamW};
use ivme::stateful::{StateDict, Stateful};
use ivme::{Accelerator, BufferSync, Precision, Sharding};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The micro-steps done, saved with the state so a resumed run knows where it is.
struct Progress {
    micro: usize,
}

impl Stateful for Progress {
    fn state_dict(&self) -> ivme::Result<StateDict> {
        Ok(StateDict::json(serde_json::json!({ "micro": self.micro })))
    }
    fn load_state_dict(&mut self, state: &StateDict) -> ivme::Result<()> {
        self.micro = state.json["micro"].as_u64().unwrap_or(0) as usize;
        Ok(())
    }
}

fn main() -> ivme::Result<()> {
    let args: BTreeMap<String, String> = std::env::args()
        .skip(1)
        .filter_map(|a| a.split_once('=').map(|(k, v)| (k.into(), v.into())))
        .collect();
    let num = |k: &str, d: usize| args.get(k).map_or(d, |v| v.parse().expect("a number"));
    let (steps, batch, accum) = (num("steps", 8), num("batch", 4), num("accum", 2));
    let lr: f64 = args
        .get("lr")
        .map_or(0.01, |v| v.parse().expect("a number"));
    let mut builder = Accelerator::builder().cpu(true).grad_accum(accum);
    if let Some(s) = args.get("sharding") {
        builder = builder.sharding(s.parse::<Sharding>()?);
    }
    if let Some(b) = args.get("buffers") {
        builder = builder.buffers(b.parse::<BufferSync>()?);
    }
    if let Some(p) = args.get("precision") {
        builder = builder.precision(p.parse::<Precision>()?);
    }
    let mut acc = builder.build()?;
    let (rank, world) = (acc.process_index(), acc.num_processes());

    let p: f32 = args
        .get("dropout")
        .map_or(0.0, |v| v.parse().expect("a probability"));
    let dropout = (p > 0.0).then(|| {
        acc.set_seed(7, true);
        (p, acc.rng())
    });
    let varmap = VarMap::new();
    let vb = acc.var_builder(&varmap, DType::F32);
    let model = cnn::Cnn::new(vb.clone(), dropout)?;
    // Each rank starts from weights of its own: preparing must give every rank rank 0's.
    cnn::init(&varmap, 1 + 1000 * rank as u64)?;
    // Made after the weights are set, so it starts at 0.
    let ema = match args.get("ema").map(String::as_str) {
        Some("1") => Some(Var::from_tensor(&vb.get_with_hints(
            1,
            "ema.seen",
            candle_nn::Init::Const(0.0),
        )?)?),
        _ => None,
    };
    let params = ParamsAdamW {
        lr,
        ..Default::default()
    };
    let opt = AdamW::new(varmap.all_vars(), params)?;
    let progress = acc.register_for_checkpointing(Progress { micro: 0 });
    let (varmap, mut opt) = acc.prepare((varmap, opt))?;
    if let Some(dir) = args.get("resume") {
        acc.load_state(Some(PathBuf::from(dir).as_path()))?;
    }
    let start = progress.lock().micro;
    for k in start..steps {
        let (x, y) = cnn::images((k * world + rank) * batch, batch)?;
        if let Some(ema) = &ema {
            ema.set(&cnn::ema_step(ema.as_tensor(), &x)?)?;
        }
        let out = acc.autocast(|ac| model.forward_t(&ac.input(&x)?, true))?;
        let loss = candle_nn::loss::mse(&out, &y)?;
        let grads = acc.backward(&loss)?;
        opt.step(&grads)?;
        progress.lock().micro = k + 1;
        if num("save_at", usize::MAX) == k + 1 {
            let dir = PathBuf::from(args.get("dir").expect("save_at needs dir="));
            acc.save_state(Some(dir.as_path()))?;
        }
    }
    if let Some(dir) = args.get("model_out") {
        acc.save_model(&PathBuf::from(dir), None)?;
    }
    // Eval mode reads the running statistics.
    let (x, _) = cnn::images(10_000, 6)?;
    let eval = acc.autocast(|ac| model.forward_t(&ac.input(&x)?, false));
    let eval: Vec<f32> = match eval {
        Ok(t) => t.flatten_all()?.to_vec1()?,
        // candle 0.11's BatchNorm cannot evaluate with 16-bit weights (docs/buffers.md).
        Err(_) if acc.precision() != Precision::No => Vec::new(),
        Err(e) => return Err(e.into()),
    };
    // Under ZeRO-3 the layers' weights exist only inside their segments: read them whole
    // from every process's slice.
    let params: BTreeMap<String, Vec<f32>> = match acc.sharding() {
        Sharding::Parameters => acc
            .whole_masters()?
            .into_iter()
            .map(|(k, t)| Ok((k, t.flatten_all()?.to_vec1::<f32>()?)))
            .collect::<candle_core::Result<_>>()?,
        _ => cnn::values(&varmap)?,
    };
    if let Some(out) = args.get("out") {
        std::fs::create_dir_all(out).expect("creating the report folder");
        let report = serde_json::json!({
            "rank": rank,
            "params": params,
            "buffers": acc.buffer_names(),
            "eval": eval,
        });
        std::fs::write(
            PathBuf::from(out).join(format!("rank{rank}.json")),
            serde_json::to_vec(&report)?,
        )
        .expect("writing the report");
    }
    Ok(())
}
