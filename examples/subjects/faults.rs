//! Injects one failure into a small data-parallel training run, to see how the job ends.
//!
//! ```text
//! cargo build --workspace --bins --examples
//! target/debug/ivme launch --num_processes 2 --cpu target/debug/examples/faults mode=err rank=1
//! ```
//!
//! Arguments (`key=value`): `mode` is one of `none`, `err` (return an error from `main`),
//! `macro_err` (return an error from a `#[accelerate]` function), `panic`, `kill` (SIGKILL),
//! `stop` (SIGSTOP: the others wait until their collective timeout), `sleep` (7 s of work
//! outside any collective: the others warn that it is late, then go on), `late_leave` (5.5 s of
//! work, then the program ends early, while the others ask where it is), `skip` (skip one
//! backward: the ranks' gradient syncs drift apart), `barrier` (one extra
//! `wait_for_everyone`); `rank` is the rank that fails (default 1), `at` the step it fails at
//! (default 3), `steps` the run's length (default 8), `timeout` the collective timeout in seconds
//! (default: the launcher's or ivme's), `debug=1` checks every collective across ranks. Each rank
//! prints `rank R done` when it finishes.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Optimizer, VarBuilder, VarMap};
use ivme::optim::{ParamsSgd, Sgd};
use ivme::rng::Rng;
use ivme::{Accelerator, Error};
use std::time::Duration;

#[derive(Debug, Clone)]
struct Plan {
    mode: String,
    rank: usize,
    at: usize,
    steps: usize,
    timeout: Option<f64>,
    debug: bool,
}

impl Plan {
    fn from_args() -> Plan {
        let mut plan = Plan {
            mode: "none".into(),
            rank: 1,
            at: 3,
            steps: 8,
            timeout: None,
            debug: false,
        };
        for arg in std::env::args().skip(1) {
            let Some((k, v)) = arg.split_once('=') else {
                continue;
            };
            match k {
                "mode" => plan.mode = v.to_string(),
                "rank" => plan.rank = v.parse().expect("rank=N"),
                "at" => plan.at = v.parse().expect("at=N"),
                "steps" => plan.steps = v.parse().expect("steps=N"),
                "timeout" => plan.timeout = Some(v.parse().expect("timeout=SECONDS")),
                "debug" => plan.debug = v == "1",
                // Anything else (a tag that tells the test's processes apart) is ignored.
                _ => {}
            }
        }
        plan
    }

    fn fails_here(&self, rank: usize, step: usize) -> bool {
        rank == self.rank && step == self.at
    }
}

/// Sends `signal` to this process (the standard library has no `raise`).
fn signal_self(signal: &str) {
    let pid = std::process::id().to_string();
    let _ = std::process::Command::new("kill")
        .args([signal, &pid])
        .status();
}

fn batch(rng: &mut Rng) -> ivme::Result<(Tensor, Tensor)> {
    let x = rng.randn(0.0, 1.0, (8, 4), &Device::Cpu)?;
    let y = x.sum_keepdim(1)?;
    Ok((x, y))
}

fn train(plan: &Plan) -> ivme::Result<()> {
    let mut builder = Accelerator::builder().debug_sync(plan.debug);
    if let Some(t) = plan.timeout {
        builder = builder.collective_timeout(Duration::from_secs_f64(t));
    }
    let mut accelerator = builder.build()?;
    let rank = accelerator.process_index();
    let varmap = VarMap::new();
    let model = linear(
        4,
        1,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )?;
    let opt = Sgd::new(
        varmap.all_vars(),
        ParamsSgd {
            lr: 0.05,
            ..Default::default()
        },
    )?;
    let mut opt = accelerator.prepare_optimizer(&varmap, Ok::<_, Error>(opt))?;
    let mut rng = Rng::new(rank as u64 + 1);
    for step in 0..plan.steps {
        let (x, y) = batch(&mut rng)?;
        // Hand-made data says where it stands, as a DataLoader does by itself.
        accelerator.micro_step(step, plan.steps);
        if plan.fails_here(rank, step) {
            match plan.mode.as_str() {
                "err" => {
                    return Err(Error::Usage(format!(
                        "injected failure on rank {rank} at step {step}: the data shard is missing"
                    )))
                }
                "panic" => panic!("injected panic on rank {rank} at step {step}"),
                "kill" => signal_self("-KILL"),
                "stop" => signal_self("-STOP"),
                "sleep" => std::thread::sleep(Duration::from_secs(7)),
                "late_leave" => {
                    // Late enough to be warned about, then gone: the program ends early.
                    std::thread::sleep(Duration::from_millis(5500));
                    break;
                }
                "skip" => continue,
                "barrier" => accelerator.wait_for_everyone()?,
                _ => {}
            }
        }
        let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
        let grads = accelerator.backward(&loss)?;
        opt.step(&grads)?;
    }
    println!("rank {rank} done");
    Ok(())
}

#[ivme::accelerate(seed = 1)]
fn train_with_macro(
    batches: Vec<(Tensor, Tensor)>,
    at: usize,
    fail_rank: usize,
) -> candle_core::Result<()> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let model = linear(4, 1, VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
    let mut opt = Sgd::new(
        varmap.all_vars(),
        ParamsSgd {
            lr: 0.05,
            ..Default::default()
        },
    )?;
    let rank = accelerator.process_index();
    let mut step = 0;
    // A counter, not `enumerate()`: the attribute shards plain collection loops.
    #[allow(clippy::explicit_counter_loop)]
    for (x, y) in batches {
        if rank == fail_rank && step == at {
            return Err(candle_core::Error::Msg(format!(
                "injected failure on rank {rank} at step {step} in a macro-written loop"
            )));
        }
        step += 1;
        let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
        let grads = loss.backward()?;
        opt.step(&grads)?;
    }
    println!("rank {rank} done");
    Ok(())
}

fn main() -> ivme::Result<()> {
    let plan = Plan::from_args();
    if plan.mode == "macro_err" {
        // The attribute gives each process its share of the batches.
        let mut rng = Rng::new(7);
        let batches = (0..4 * plan.steps)
            .map(|_| batch(&mut rng))
            .collect::<ivme::Result<Vec<_>>>()?;
        return train_with_macro(batches, plan.at, plan.rank).map_err(Error::from);
    }
    train(&plan)
}
