//! The LoRA fine-tune the multi-process tests run: the "pretrained" residual MLP of
//! `support/finetune_net.rs` (written by the test), LoRA on every block linear, a new head, an
//! AdamW over what trains, and writes each rank's trained weights and the bytes every
//! micro-step handed to collectives to `out/rank{R}.json`.
//!
//! Arguments are `key=value`: `base=DIR out=DIR layout=constant|subset precision=no|bf16
//! accum=A steps=K clip=F sharding=no|optimizer|gradients adapter_out=DIR base_rank1=DIR perturb_rank1=1 save=DIR save_after=K
//! resume=DIR resume_at=K`: rank 1 opens another base, or changes a frozen weight (tests of the
//! checks that every process opened the same base and holds the same frozen weights); the state is saved to `save` after K optimizer steps; a resumed run loads
//! `resume` (saved after `resume_at` steps) and trains the rest. `layout=constant`
//! reads the base as constants (`base_var_builder`); `layout=subset` makes every weight a
//! variable of one `VarMap`, loads the base into it and hands the optimizer the adapters and
//! the head only. `steps` counts optimizer steps; micro-batch `r + W·j` is rank r's j-th.

#[path = "../support/finetune_net.rs"]
mod finetune_net;

use candle_core::{DType, Module};
use candle_nn::{Optimizer, VarMap};
use finetune_net::{batch, flat, start_value, Net, SMALL};
use ivme::finetune::LoraConfig;
use ivme::optim::{AdamW, ParamsAdamW};
use ivme::{Accelerator, Precision, Sharding};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

fn trains(name: &str) -> bool {
    name.contains(".lora_") || name.starts_with("head.")
}

fn main() -> ivme::Result<()> {
    let args: HashMap<String, String> = std::env::args()
        .skip(1)
        .filter_map(|a| {
            a.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    let get = |k: &str, d: &str| args.get(k).cloned().unwrap_or_else(|| d.to_string());
    let mut base_dir = PathBuf::from(get("base", "base"));
    let out = PathBuf::from(get("out", "out"));
    let accum: usize = get("accum", "2").parse().expect("accum");
    let steps: usize = get("steps", "3").parse().expect("steps");
    let clip: f64 = get("clip", "0.05").parse().expect("clip");
    let precision = match get("precision", "no").as_str() {
        "bf16" => Precision::Bf16,
        _ => Precision::No,
    };
    let sharding = match get("sharding", "no").as_str() {
        "optimizer" => Sharding::Optimizer,
        "gradients" => Sharding::Gradients,
        _ => Sharding::No,
    };
    let mut acc = Accelerator::builder()
        .cpu(true)
        .grad_accum(accum)
        .clip_grad_norm(clip)
        .precision(precision)
        .sharding(sharding)
        .build()?;
    if let Some(other) = args.get("base_rank1").filter(|_| acc.process_index() == 1) {
        // A test of the check that every process opened the same base.
        base_dir = PathBuf::from(other);
    }
    let lora = acc.lora(LoraConfig::new(4, 8.0, &["fc1", "fc2"]))?;
    let varmap = VarMap::new();
    let net = match get("layout", "constant").as_str() {
        "constant" => {
            let base = acc.load_base(&base_dir)?;
            Net::new(
                acc.base_var_builder(&base, &varmap, DType::F32),
                &lora,
                SMALL,
            )?
        }
        _ => {
            let net = Net::new(acc.var_builder(&varmap, DType::F32), &lora, SMALL)?;
            finetune_net::load_into(&varmap, &base_dir)?;
            net
        }
    };
    // The same start as the reference: every trained variable set by name.
    let mut trained = Vec::new();
    {
        let data = varmap.data().lock().expect("varmap");
        let mut names: Vec<&String> = data.keys().filter(|n| trains(n)).collect();
        names.sort();
        for name in names {
            let v = &data[name];
            v.set(&start_value(name, v.dims()).to_dtype(v.dtype())?)?;
            trained.push(v.clone());
        }
    }
    let params = ParamsAdamW {
        lr: 0.02,
        ..Default::default()
    };
    if get("perturb_rank1", "0") == "1" && acc.process_index() == 1 {
        // A test of the check that frozen variables agree across processes.
        let data = varmap.data().lock().expect("varmap");
        let w = &data["blocks.0.fc1.weight"];
        w.set(&(w.as_tensor() * 1.001)?)?;
    }
    let before = acc.collective_bytes();
    let mut opt = acc.prepare_optimizer_of(AdamW::new(trained, params))?;
    let prepare_bytes = acc.collective_bytes() - before;
    let world = acc.num_processes();
    let rank = acc.process_index();
    let mut first = 0;
    if let Some(dir) = args.get("resume") {
        acc.load_state(Some(std::path::Path::new(dir)))?;
        first = get("resume_at", "0").parse::<usize>().expect("resume_at") * accum;
    }
    let save_after: usize = get("save_after", "0").parse().expect("save_after");
    let mut bytes = Vec::new();
    for j in first..steps * accum {
        let (x, y) = batch(rank + world * j, SMALL.d);
        let before = acc.collective_bytes();
        let outputs = acc.autocast(|ac| net.forward(&ac.input(&x)?))?;
        let loss = candle_nn::loss::mse(&outputs.to_dtype(DType::F32)?, &y)?;
        let grads = acc.backward(&loss)?;
        opt.step(&grads)?;
        bytes.push(acc.collective_bytes() - before);
        if j + 1 == save_after * accum {
            acc.save_state(Some(std::path::Path::new(&get("save", "ckpt"))))?;
        }
    }
    if let Some(dir) = args.get("adapter_out") {
        acc.save_adapter(std::path::Path::new(dir), &lora)?;
    }
    let mut values = BTreeMap::new();
    for (name, var) in acc.named_master_vars() {
        values.insert(name, flat(var.as_tensor()));
    }
    let report = serde_json::json!({
        "params": values,
        "bytes": bytes,
        "trained": acc.trained_names(),
        "frozen": acc.frozen_names(),
        "adapted": lora.adapted(),
        "prepare_bytes": prepare_bytes,
        "masters": acc.held_bytes()?.masters,
    });
    std::fs::create_dir_all(&out).expect("the report folder");
    std::fs::write(
        out.join(format!("rank{rank}.json")),
        serde_json::to_vec(&report)?,
    )
    .expect("the report");
    Ok(())
}
