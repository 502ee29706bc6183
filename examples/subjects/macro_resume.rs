//! A loop over a plain `Vec` of batches under `#[accelerate]`, stopped mid-epoch and resumed:
//! the attribute's sharded loop continues at the next batch, as a `DataLoader` does.
//!
//! ```text
//! cargo build --workspace --bins --examples
//! target/debug/ivme launch --num_processes 2 --cpu target/debug/examples/macro_resume \
//!     project=/tmp/run out=/tmp/out stop_at=5
//! target/debug/ivme launch --num_processes 2 --cpu target/debug/examples/macro_resume \
//!     project=/tmp/run out=/tmp/out
//! ```
//!
//! Arguments: `project=DIR` (checkpoints), `out=DIR` (each rank writes `rank{R}.json` with its
//! final weights and the batches it trained), `stop_at=K` (save after the K-th optimizer step of
//! this run and stop), `preempt_at=K` (rank 1 sends itself SIGTERM after its K-th optimizer step:
//! the ranks stop for a preemption after the next one, at the attribute's preemption point). It
//! saves after every second step and resumes from the newest checkpoint.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Optimizer, VarBuilder, VarMap};
use ivme::optim::{AdamW, ParamsAdamW};
use ivme::rng::Rng;
use ivme::Accelerator;
use std::collections::BTreeMap;

#[ivme::accelerate]
fn train(
    acc: &mut Accelerator,
    batches: Vec<(Tensor, Tensor)>,
    stop_at: Option<usize>,
    preempt_at: Option<usize>,
) -> candle_core::Result<(VarMap, usize)> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let model = linear(4, 1, VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
    {
        let mut rng = Rng::new(3);
        let data = varmap.data().lock().expect("varmap lock");
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        for name in names {
            let v = &data[name];
            v.set(&rng.randn(0.0, 0.5, v.shape(), &device)?)?;
        }
    }
    let params = ParamsAdamW {
        lr: 0.05,
        ..Default::default()
    };
    let mut opt = AdamW::new(varmap.all_vars(), params)?;
    if let Some(dir) = acc.load_state_if_any()? {
        acc.print(format!("resumed from {}", dir.display()));
    }
    let mut trained = 0;
    for _epoch in 0..3 {
        for (x, y) in &batches {
            let loss = candle_nn::loss::mse(&model.forward(&x.to_device(&device)?)?, &y)?;
            let grads = loss.backward()?;
            opt.step(&grads)?;
            trained += 1;
            if Some(trained) == preempt_at && acc.process_index() == 1 {
                // A scheduler's preemption, as a real signal to this rank alone.
                let pid = std::process::id().to_string();
                let _ = std::process::Command::new("kill")
                    .args(["-s", "TERM", &pid])
                    .status();
            }
            if trained % 2 == 0 || Some(trained) == stop_at {
                acc.save_state(None)?;
            }
            if Some(trained) == stop_at {
                return Ok((varmap, trained));
            }
        }
    }
    Ok((varmap, trained))
}

fn main() -> ivme::Result<()> {
    let args: BTreeMap<String, String> = std::env::args()
        .skip(1)
        .filter_map(|a| {
            a.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    let project = args
        .get("project")
        .cloned()
        .unwrap_or_else(|| "macro_resume_run".into());
    let out = args.get("out").cloned().unwrap_or_else(|| ".".into());
    let stop_at = args.get("stop_at").and_then(|v| v.parse().ok());
    let preempt_at = args.get("preempt_at").and_then(|v| v.parse().ok());
    let mut acc = Accelerator::builder().project_dir(project).build()?;
    // 10 batches of y = sum(x): 5 per rank per epoch on 2 ranks.
    let mut rng = Rng::new(11);
    let batches = (0..10)
        .map(|_| {
            let x = rng.randn(0.0, 1.0, (6, 4), &Device::Cpu)?;
            let y = x.sum_keepdim(1)?;
            Ok((x, y))
        })
        .collect::<ivme::Result<Vec<_>>>()?;
    let (varmap, trained) = train(&mut acc, batches, stop_at, preempt_at)?;
    let data = varmap.data().lock().expect("varmap lock");
    let params: BTreeMap<&String, Vec<f32>> = data
        .iter()
        .map(|(k, v)| Ok((k, v.as_tensor().flatten_all()?.to_vec1::<f32>()?)))
        .collect::<candle_core::Result<_>>()?;
    let report = serde_json::json!({ "params": params, "trained": trained });
    std::fs::create_dir_all(&out).map_err(|e| ivme::Error::io(format!("creating {out}"), e))?;
    let file = format!("{out}/rank{}.json", acc.process_index());
    std::fs::write(&file, report.to_string())
        .map_err(|e| ivme::Error::io(format!("writing {file}"), e))
}
