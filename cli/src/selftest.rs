//! `ivme test`: trains a tiny model on the configured processes and checks the result.
//!
//! `ivme test` launches this same executable through the ordinary launch path (so the config
//! file, mpirun and the rank wrapper are all exercised), running the hidden `__selftest` on
//! every rank. Each rank prepares a model, optimizer and loader, takes a few accumulated and
//! synced steps, then checks that every rank holds the same weights and that they equal a plain
//! single-process computation of the same steps; then it saves the training state, trains on,
//! loads the state back and checks that training on from it retraces the first run exactly. Ranks leave their verdict in a scratch folder
//! the parent reads to say PASS or what failed.

use crate::cli::{self, Checked};
use crate::launch;
use crate::values;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap};
use clap::Parser;
use ivme::data::{DataLoader, TensorDataset};
use ivme::optim::{AcceleratedOptimizer, ParamsSgd, Sgd};
use ivme::state::EnvLayout;
use ivme::{Accelerator, Error, Precision, Result};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The subcommand's name.
pub const COMMAND: &str = "test";
/// The hidden subcommand every rank runs.
pub const RANK_COMMAND: &str = "__selftest";

/// Train a tiny model on the configured processes and check it end to end.
#[derive(Parser, Debug)]
#[command(
    rename_all = "snake_case",
    after_help = "It checks: prepare, accumulated steps with gradient sync, identical weights \
                  on every rank, equal to a single-process computation, save and load state."
)]
struct Flags {
    /// processes to test on (default: the config's, else 1)
    #[arg(long, value_name = "count", value_parser = Checked::new(values::positive))]
    num_processes: Option<usize>,
    /// the config file to test (default: $IVME_CONFIG, else ~/.config/ivme/default_config.toml)
    #[arg(long, value_name = "file", value_parser = Checked::new(values::text))]
    config_file: Option<String>,
    /// a folder every machine sees at the same path, to check save_state/load_state across machines (one machine: a temporary folder)
    #[arg(long, value_name = "folder", value_parser = Checked::new(values::text))]
    checkpoint_dir: Option<String>,
}

const BATCH: usize = 2;
const EPOCHS: usize = 3;
const LR: f64 = 0.1;
const PASS_FILE: &str = "pass";
/// Set to `desync` to nudge the last rank's weights, to see that the check catches it.
const FAULT_VAR: &str = "IVME_SELFTEST_FAULT";

/// Runs `ivme test` and returns the exit code.
pub fn main(words: &[String]) -> Result<i32> {
    let Some(flags) = cli::read_with::<Flags>(COMMAND, words, crate::flags::example)? else {
        return Ok(0);
    };
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("ivme-selftest-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let exe = std::env::current_exe().map_err(|e| Error::io("finding the ivme executable", e))?;
    let mut launch_words = Vec::new();
    if let Some(n) = flags.num_processes {
        launch_words.extend(["--num_processes".to_string(), n.to_string()]);
    }
    if let Some(file) = flags.config_file {
        launch_words.extend(["--config_file".to_string(), file]);
    }
    launch_words.extend([
        exe.display().to_string(),
        RANK_COMMAND.into(),
        dir.display().to_string(),
    ]);
    // The state round trip's own folder inside the shared one, removed afterwards.
    let shared = flags
        .checkpoint_dir
        .map(|d| Path::new(&d).join(format!("ivme-selftest-{}-{nanos}", std::process::id())));
    if let Some(shared) = &shared {
        launch_words.push(shared.display().to_string());
    }
    let launched = launch::main(&launch_words);
    let verdict = verdict(&dir, launched);
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(shared) = &shared {
        let _ = std::fs::remove_dir_all(shared);
    }
    match verdict {
        Ok(summary) => {
            println!("ivme test: PASS: {summary}");
            Ok(0)
        }
        Err(what) => {
            println!("ivme test: FAIL: {what}");
            Ok(1)
        }
    }
}

/// Reads the ranks' verdicts: the summary on success, what failed otherwise.
fn verdict(dir: &Path, launched: Result<i32>) -> std::result::Result<String, String> {
    let code = launched.map_err(|e| format!("could not launch the test: {e}"))?;
    let mut failures: Vec<(usize, String)> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let rank = name.strip_prefix("fail-rank")?.parse().ok()?;
                    Some((rank, std::fs::read_to_string(e.path()).unwrap_or_default()))
                })
                .collect()
        })
        .unwrap_or_default();
    // A rank's own error before the others' echoes of it ("failed on rank(s) [2]; see their
    // error messages"), then by rank.
    failures.sort_by_key(|(rank, msg)| (msg.contains("see their error messages"), *rank));
    if let Some((rank, msg)) = failures.first() {
        return Err(format!("rank {rank}: {}", msg.trim()));
    }
    if code != 0 {
        return Err(format!(
            "the launch ended with exit code {code}; the messages above say why"
        ));
    }
    std::fs::read_to_string(dir.join(PASS_FILE))
        .map(|s| s.trim().to_string())
        .map_err(|_| "no rank reported a result (did rank 0 start?)".to_string())
}

/// Runs `__selftest DIR [SHARED]` on one rank and returns its exit code.
pub fn rank_main(words: &[String]) -> Result<i32> {
    let (dir, shared) = match words {
        [dir] => (dir, None),
        [dir, shared] => (dir, Some(PathBuf::from(shared))),
        _ => {
            return Err(Error::Usage(format!(
                "`ivme {RANK_COMMAND}` is started by `ivme test`; run `ivme test` instead"
            )))
        }
    };
    let dir = PathBuf::from(dir);
    let rank = EnvLayout::from_env().ok().flatten().map_or(0, |l| l.rank);
    match checks(&dir, shared.as_deref()) {
        Ok(Some(summary)) => {
            std::fs::write(dir.join(PASS_FILE), summary)
                .map_err(|e| Error::io("writing the test verdict", e))?;
            Ok(0)
        }
        Ok(None) => Ok(0),
        Err(msg) => {
            eprintln!("ivme test: rank {rank}: {msg}");
            let _ = std::fs::write(dir.join(format!("fail-rank{rank}")), &msg);
            Ok(1)
        }
    }
}

/// Tags an error with the step that failed.
fn during<T>(
    step: &str,
    r: impl Into<std::result::Result<T, Error>>,
) -> std::result::Result<T, String> {
    r.into().map_err(|e| format!("{step}: {e}"))
}

/// A tiny regression problem of `n` samples, computed from the index so every rank agrees.
fn data(n: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let x: Vec<f32> = (0..n * 4).map(|i| (i as f32 * 0.7).sin()).collect();
    let y: Vec<f32> = (0..n)
        .flat_map(|i| {
            let r = &x[i * 4..i * 4 + 4];
            [
                r[0] - r[1] + 0.5 * r[2] + 2.0 * r[3] + 0.3,
                (i as f32).cos(),
            ]
        })
        .collect();
    Ok((
        Tensor::from_vec(x, (n, 4), &Device::Cpu)?,
        Tensor::from_vec(y, (n, 2), &Device::Cpu)?,
    ))
}

/// Rank `rank`'s starting weights; they differ by rank so that prepare must make them agree.
fn initial(rank: usize) -> (Vec<f32>, Vec<f32>) {
    let s = 1.0 + rank as f32;
    let w = (0..8).map(|i| 0.1 * (i as f32 + 1.0) * s - 0.4).collect();
    let b = vec![0.05 * s, -0.05 * s];
    (w, b)
}

/// The same steps in plain candle on one process: `steps` of full-batch gradient descent from
/// rank 0's weights (a step skipped for an fp16 overflow leaves the weights, so the next one
/// repeats it exactly). Returns the final weights in name order (`l.bias`, `l.weight`).
fn reference(x: &Tensor, y: &Tensor, steps: usize) -> candle_core::Result<Vec<f32>> {
    let (w0, b0) = initial(0);
    let w = Var::from_tensor(&Tensor::from_vec(w0, (2, 4), &Device::Cpu)?)?;
    let b = Var::from_tensor(&Tensor::from_vec(b0, 2, &Device::Cpu)?)?;
    for _ in 0..steps {
        let out = x
            .matmul(&w.as_tensor().t()?)?
            .broadcast_add(b.as_tensor())?;
        let grads = candle_nn::loss::mse(&out, y)?.backward()?;
        for v in [&w, &b] {
            let g = grads
                .get(v.as_tensor())
                .ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?;
            v.set(&(v.as_tensor() - (g * LR)?)?)?;
        }
    }
    let mut out = b.as_tensor().to_vec1::<f32>()?;
    out.extend(w.as_tensor().flatten_all()?.to_vec1::<f32>()?);
    Ok(out)
}

fn weights(acc: &Accelerator) -> candle_core::Result<Vec<f32>> {
    let mut out = Vec::new();
    for (_, v) in acc.named_master_vars() {
        out.extend(
            v.as_tensor()
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_device(&Device::Cpu)?
                .to_vec1::<f32>()?,
        );
    }
    Ok(out)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// What one rank trains.
struct Run {
    acc: Accelerator,
    model: Linear,
    opt: AcceleratedOptimizer<Sgd>,
    loader: DataLoader<TensorDataset<(Tensor, Tensor)>>,
}

impl Run {
    /// Trains one epoch; returns the optimizer steps ended and those not skipped for overflow.
    fn epoch(&mut self) -> Result<(usize, usize)> {
        let (mut steps, mut applied) = (0, 0);
        for batch in self.loader.iter() {
            let (xb, yb) = batch?;
            let out = self
                .acc
                .autocast(|ac| self.model.forward(&ac.input(&xb)?))?;
            let loss = candle_nn::loss::mse(&out, &yb)?;
            let grads = self.acc.backward(&loss)?;
            self.opt.step(&grads)?;
            let sync = grads.is_sync_step();
            steps += usize::from(sync);
            applied += usize::from(sync && !self.opt.optimizer_step_was_skipped());
        }
        Ok((steps, applied))
    }

    /// Saves the state, trains on, loads it back and trains again: the reload must restore the
    /// saved weights exactly and the second try must retrace the first bit for bit.
    fn state_round_trip(&mut self, dir: &Path) -> std::result::Result<(), String> {
        let folder = dir.join("state");
        during("save_state", self.acc.save_state(Some(&folder)))?;
        let saved = during(
            "reading the weights",
            weights(&self.acc).map_err(Error::from),
        )?;
        during("training after save_state", self.epoch())?;
        let straight_on = during(
            "reading the weights",
            weights(&self.acc).map_err(Error::from),
        )?;
        during("load_state", self.acc.load_state(Some(&folder)))?;
        let restored = during(
            "reading the weights",
            weights(&self.acc).map_err(Error::from),
        )?;
        if restored != saved {
            return Err(format!(
                "load_state: the weights differ from those saved by {:.2e}",
                max_diff(&restored, &saved)
            ));
        }
        during("training after load_state", self.epoch())?;
        let resumed = during(
            "reading the weights",
            weights(&self.acc).map_err(Error::from),
        )?;
        if resumed != straight_on {
            return Err(format!(
                "load_state: training on from the loaded state differs from training on without \
                 stopping by {:.2e}",
                max_diff(&resumed, &straight_on)
            ));
        }
        Ok(())
    }
}

/// The checks one rank runs in `dir`; rank 0 returns the summary.
fn checks(dir: &Path, shared: Option<&Path>) -> std::result::Result<Option<String>, String> {
    // A loss scale that suits this tiny model, so fp16 mostly steps rather than skips.
    let builder = Accelerator::builder().seed(7).initial_loss_scale(256.0);
    let mut acc = during("building the Accelerator", builder.build())?;
    let (rank, world, accum) = (
        acc.process_index(),
        acc.num_processes(),
        acc.gradient_accumulation_steps(),
    );
    let dev = acc.device().clone();
    // Every rank gets `accum` batches per epoch, so each epoch is exactly one optimizer step
    // over the whole data set: the plain full-batch computation is the reference.
    let n = world * accum * BATCH;
    let (x, y) = during("making the data", data(n).map_err(Error::from))?;
    let varmap = VarMap::new();
    let model: Linear = during(
        "building the model",
        linear(
            4,
            2,
            VarBuilder::from_varmap(&varmap, acc.param_dtype(DType::F32), &dev).pp("l"),
        )
        .map_err(Error::from),
    )?;
    let set_initial = || -> candle_core::Result<()> {
        let (w, b) = initial(rank);
        let data = varmap
            .data()
            .lock()
            .map_err(|_| candle_core::Error::Msg("poisoned".into()))?;
        for (name, values, shape) in [("l.weight", w, vec![2, 4]), ("l.bias", b, vec![2])] {
            let var = &data[name];
            var.set(&Tensor::from_vec(values, shape, &dev)?.to_dtype(var.dtype())?)?;
        }
        Ok(())
    };
    during(
        "setting the starting weights",
        set_initial().map_err(Error::from),
    )?;
    let dataset = during(
        "making the data set",
        TensorDataset::new((x.clone(), y.clone())),
    )?;
    let (varmap, loader) = during(
        "preparing the model and loader",
        acc.prepare((varmap, DataLoader::new(dataset, BATCH))),
    )?;
    let sgd = during(
        "making the optimizer",
        Sgd::new(
            varmap.all_vars(),
            ParamsSgd {
                lr: LR,
                ..Default::default()
            },
        )
        .map_err(Error::from),
    )?;
    let opt = during("preparing the optimizer", acc.prepare(sgd))?;
    let start = during("reading the weights", weights(&acc).map_err(Error::from))?;
    let mut run = Run {
        acc,
        model,
        opt,
        loader,
    };
    let (mut steps, mut applied) = (0, 0);
    for _ in 0..EPOCHS {
        let (sync, done) = during("training with gradient sync", run.epoch())?;
        steps += sync;
        applied += done;
    }
    if steps != EPOCHS {
        return Err(format!(
            "gradient accumulation: {steps} optimizer steps were taken over {EPOCHS} epochs of {accum} \
             micro-batches each; expected one per epoch"
        ));
    }
    let acc = &run.acc;
    let mut mine = during("reading the weights", weights(acc).map_err(Error::from))?;
    // Lets the tests of `ivme test` itself show that a rank out of step is caught.
    if rank + 1 == world && world > 1 && std::env::var(FAULT_VAR).is_ok_and(|v| v == "desync") {
        mine[0] += 1e-3;
    }
    if applied == 0 || max_diff(&mine, &start) == 0.0 {
        return Err(format!(
            "training: the weights did not change ({steps} steps, {applied} applied)"
        ));
    }
    let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
    let all = during(
        "gathering every rank's weights",
        acc.comm().all_gather_bytes(&bytes),
    )?;
    if let Some(r) = all.iter().position(|b| *b != all[0]) {
        return Err(format!(
            "gradient sync: rank {r}'s weights differ from rank 0's after {EPOCHS} steps; the \
             ranks did not average the same gradients"
        ));
    }
    let want = during(
        "the single-process reference",
        reference(&x, &y, applied).map_err(Error::from),
    )?;
    let precision = acc.precision();
    let tolerance = match precision {
        Precision::No => 1e-4,
        Precision::Fp16 => 2e-2,
        Precision::Bf16 => 6e-2,
    };
    let diff = max_diff(&mine, &want);
    if diff.is_nan() || diff > tolerance {
        return Err(format!(
            "the trained weights differ from a single-process computation of the same {applied} \
             steps by {diff:.2e} (more than {tolerance:.0e} for precision {precision})"
        ));
    }
    // Every rank writes its part of the state into one folder, which several machines share
    // only if it is on a shared file system: across machines, only in the folder given.
    let machines: usize = std::env::var(ivme::env::NUM_MACHINES.name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let state = match shared {
        None if machines > 1 => {
            "save_state/load_state not checked (several machines need a shared folder: give \
             one with `ivme test --checkpoint_dir DIR`)"
        }
        folder => {
            run.state_round_trip(folder.unwrap_or(dir))?;
            "save_state then load_state restored the weights exactly and training resumed bit \
             for bit"
        }
    };
    Ok((rank == 0).then(|| {
        format!(
            "{world} process(es) on {}, precision {precision}, {accum} micro-batch(es) per step: \
             {EPOCHS} synced optimizer steps ({applied} applied); every rank holds the same weights, within {diff:.1e} \
             of a single-process computation; {state}",
            if dev.is_cpu() { "the CPU" } else { "the GPU" }
        )
    }))
}
