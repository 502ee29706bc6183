//! A small training run that survives a crash: it saves its state every few optimizer steps,
//! and when `ivme launch --max_restarts N` starts it again after a rank died, it continues from
//! the newest checkpoint instead of starting over, ending with the same weights, bit for bit, as
//! a run that never stopped.
//!
//! ```text
//! cargo build --workspace --bins --examples
//! IVME_TEST_DIE_AT=10 target/debug/ivme launch --num_processes 2 --cpu --max_restarts 1 \
//!     target/debug/examples/restartable /tmp/project /tmp/out
//! ```
//!
//! Arguments: `PROJECT_DIR OUT_DIR [epochs=3] [save_every=4] [hold_ms=0] [step_ms=0] [async=0]
//! [point=1] [ballast_mb=0] [slow_rank=R] [prefetch=0]`. The model is a plain
//! candle-nn `linear` layer, trained with ivme's `AdamW` on a shuffled `TensorDataset`; state
//! is saved under `PROJECT_DIR/checkpoints` every `save_every` optimizer steps. At the end rank 0
//! writes `OUT_DIR/params.json`: the final weights by name, the attempt (`IVME_RESTART_COUNT`)
//! and the step this attempt started from.
//!
//! `IVME_TEST_DIE_AT=S` makes rank 1 of the first attempt kill itself with SIGKILL once it has
//! taken optimizer step S, to play a crashed machine. `hold_ms=MS` keeps every rank waiting
//! that long after preparing, with MPI up, and first writes `OUT_DIR/ready-rank{R}`, so a test
//! can look at the running job. `step_ms=MS` makes each micro-batch take that much longer (a
//! slower model), so a test can signal the job mid-run; `async=1` saves in the background;
//! `point=0` leaves out the loop's preemption point; `ballast_mb=N` adds an N MB variable the
//! loss never reaches, so the state to save and load is about 3 × N MB larger; `slow_rank=R`
//! makes only rank R take `step_ms` longer (a straggler); `prefetch=N` builds batches N ahead
//! on a background thread.
//!
//! A preemption (SIGTERM or SIGUSR1 to `ivme launch` or to a rank) stops the loop at the
//! `preemption_point` after the optimizer step every rank agreed on: the state is saved there
//! and the launcher exits with 75; run it again and it continues from that step.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Optimizer, VarBuilder, VarMap};
use ivme::checkpoint::ProjectConfiguration;
use ivme::data::{DataLoader, TensorDataset};
use ivme::optim::{AdamW, ParamsAdamW};
use ivme::rng::Rng;
use ivme::stateful::{StateDict, Stateful};
use ivme::{Accelerator, Error};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Optimizer steps taken so far, saved with the training state.
struct Steps {
    done: u64,
}

impl Stateful for Steps {
    fn state_dict(&self) -> ivme::Result<StateDict> {
        Ok(StateDict::json(serde_json::json!({ "done": self.done })))
    }
    fn load_state_dict(&mut self, state: &StateDict) -> ivme::Result<()> {
        self.done = state.json["done"].as_u64().unwrap_or(0);
        Ok(())
    }
}

/// The command line: two folders, then `key=value` settings.
struct Args {
    project: PathBuf,
    out: PathBuf,
    epochs: u64,
    save_every: u64,
    hold_ms: u64,
    step_ms: u64,
    async_saves: bool,
    point: bool,
    ballast_mb: u64,
    slow_rank: Option<u64>,
    prefetch: usize,
}

impl Args {
    fn parse() -> ivme::Result<Args> {
        let usage = || {
            Error::Usage(
                "usage: restartable PROJECT_DIR OUT_DIR [epochs=N] [save_every=K] [hold_ms=MS] \
                 [step_ms=MS] [async=0|1] [point=0|1] [ballast_mb=N] [slow_rank=R] \
                 [prefetch=N]"
                    .into(),
            )
        };
        let words: Vec<String> = std::env::args().skip(1).collect();
        let [project, out, settings @ ..] = words.as_slice() else {
            return Err(usage());
        };
        let mut args = Args {
            project: project.into(),
            out: out.into(),
            epochs: 3,
            save_every: 4,
            hold_ms: 0,
            step_ms: 0,
            async_saves: false,
            point: true,
            ballast_mb: 0,
            slow_rank: None,
            prefetch: 0,
        };
        for word in settings {
            let (key, value) = word.split_once('=').ok_or_else(usage)?;
            let value: u64 = value.parse().map_err(|_| usage())?;
            match key {
                "epochs" => args.epochs = value,
                "save_every" => args.save_every = value.max(1),
                "hold_ms" => args.hold_ms = value,
                "step_ms" => args.step_ms = value,
                "async" => args.async_saves = value != 0,
                "point" => args.point = value != 0,
                "ballast_mb" => args.ballast_mb = value,
                "slow_rank" => args.slow_rank = Some(value),
                "prefetch" => args.prefetch = value as usize,
                _ => return Err(usage()),
            }
        }
        Ok(args)
    }
}

/// A whole-number setting from the environment.
fn env_number(var: &str) -> Option<u64> {
    std::env::var(var).ok()?.trim().parse().ok()
}

fn main() -> ivme::Result<()> {
    let args = Args::parse()?;
    let restart = env_number("IVME_RESTART_COUNT").unwrap_or(0);
    let die_at = env_number("IVME_TEST_DIE_AT");
    let mut acc = Accelerator::builder()
        .cpu(true)
        .async_checkpoints(args.async_saves)
        .build()?;
    let rank = acc.process_index();

    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, acc.param_dtype(DType::F32), acc.device());
    // `IVME_TEST_OUT_FEATURES=3` builds another model than the checkpoints hold: a test of a
    // failure that a restart cannot get past.
    let outputs = env_number("IVME_TEST_OUT_FEATURES").unwrap_or(2) as usize;
    let model = linear(4, outputs, vb.pp("linear"))?;
    // candle's own initialisation draws from a thread RNG; seeded weights make runs comparable.
    if args.ballast_mb > 0 {
        // A variable the loss never reaches: its weights and AdamW moments only make the
        // state to save, snapshot and load larger (3 × ballast_mb MB in all).
        let n = (args.ballast_mb as usize) << 18;
        vb.get_with_hints(n, "ballast", candle_nn::Init::Const(0.5))?;
    }
    init_weights(&varmap, 3)?;
    let loader = DataLoader::new(dataset(48)?, 4)
        .shuffle(true)
        .seed(7)
        .prefetch(args.prefetch);
    let (varmap, mut loader) = acc.prepare((varmap, loader))?;
    let params = ParamsAdamW {
        lr: 0.05,
        weight_decay: 0.01,
        ..Default::default()
    };
    let mut opt = acc.prepare(AdamW::new(varmap.all_vars(), params)?)?;
    acc.set_project_configuration(
        ProjectConfiguration::new(&args.project)
            .automatic_checkpoint_naming(true)
            .total_limit(3),
    )?;
    let steps = acc.register_for_checkpointing(Steps { done: 0 });
    let resumed = acc.load_state_if_any()?;
    let start_step = steps.lock().done;
    match &resumed {
        Some(dir) => println!(
            "restartable: rank {rank}, attempt {restart}: resumed from {} at step {start_step}",
            dir.display()
        ),
        None => println!("restartable: rank {rank}, attempt {restart}: starting afresh"),
    }
    if args.hold_ms > 0 || args.step_ms > 0 {
        let pid = format!("{}\n", std::process::id());
        write(&args.out.join(format!("ready-rank{rank}")), pid.as_bytes())?;
        std::thread::sleep(std::time::Duration::from_millis(args.hold_ms));
    }

    // A checkpoint taken after an epoch's last batch resumes at the next epoch's start.
    let position = loader.position();
    let finished = !loader.is_empty() && position.consumed >= loader.len();
    let mut epoch = position.epoch + u64::from(finished);
    while epoch < args.epochs {
        // Naming the current epoch keeps a restored mid-epoch position.
        loader.set_epoch(epoch);
        for batch in loader.iter() {
            let (x, y) = batch?;
            if args.slow_rank.is_none_or(|r| r == rank as u64) {
                std::thread::sleep(std::time::Duration::from_millis(args.step_ms));
            }
            let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
            let grads = acc.backward(&loss)?;
            opt.step(&grads)?;
            let done = {
                let mut s = steps.lock();
                s.done += 1;
                s.done
            };
            if rank == 1 && restart == 0 && die_at == Some(done) {
                die();
            }
            if done % args.save_every == 0 {
                acc.save_state(None)?;
            }
            // Saves and ends the run here once the ranks agreed to stop for a preemption.
            if args.point {
                acc.preemption_point()?;
            }
        }
        epoch += 1;
    }

    if rank == 0 {
        let params: BTreeMap<String, Vec<f32>> = acc
            .named_master_vars()
            .into_iter()
            .map(|(k, v)| Ok((k, v.as_tensor().flatten_all()?.to_vec1::<f32>()?)))
            .collect::<candle_core::Result<_>>()?;
        let report = serde_json::json!({
            "params": params,
            "restart_count": restart,
            "start_step": start_step,
            "steps": steps.lock().done,
            "resumed_from": resumed.map(|p| p.display().to_string()),
        });
        write(
            &args.out.join("params.json"),
            &serde_json::to_vec_pretty(&report)?,
        )?;
    }
    Ok(())
}

/// Ends this process the way the kernel's out-of-memory killer or a lost machine would.
fn die() -> ! {
    eprintln!("restartable: rank 1 kills itself with SIGKILL (IVME_TEST_DIE_AT)");
    let pid = std::process::id().to_string();
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &pid])
        .status();
    // `kill` delivers the signal before it exits; this only covers a missing `kill`.
    std::process::abort()
}

fn write(path: &Path, bytes: &[u8]) -> ivme::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    }
    std::fs::write(path, bytes).map_err(|e| Error::io(format!("writing {}", path.display()), e))
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

/// `n` samples of 4 features with 2 targets, a fixed linear map of the features plus noise.
fn dataset(n: usize) -> ivme::Result<TensorDataset<(Tensor, Tensor)>> {
    let mut rng = Rng::new(42);
    let x = rng.randn(0.0, 1.0, (n, 4), &Device::Cpu)?;
    let map = Tensor::new(
        &[[0.5f32, -1.0], [1.5, 0.25], [-0.75, 2.0], [1.0, -0.5]],
        &Device::Cpu,
    )?;
    let noise = rng.randn(0.0, 0.1, (n, 2), &Device::Cpu)?;
    let y = (x.matmul(&map)? + noise)?;
    TensorDataset::new((x, y))
}
