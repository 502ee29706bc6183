//! Async-checkpoint test subject: a small training run whose saves go to the background
//! (`async_checkpoints(true)` or `save_state_async`), so tests can resume from them, kill it
//! mid-write and make a background write fail on one rank.
//!
//! Usage: `ckpt_async <project> <steps> <every>`: `load_state_if_any` (prints `loaded
//! <dir|none> <fp>`), then trains until the optimizer has made `<steps>` steps, saving after
//! every `<every>`-th step (prints `pending <dir> <fp>` once the save returned). At the end it
//! prints `final <fp>`; the Accelerator's drop commits the last save. `<fp>` is a fingerprint
//! of the whole training state: optimizer step, loader position, RNG position and every
//! weight's bits. Only the main process prints these; failures print `rank<R> failed <error>`
//! on every rank, and the save is tried once more (`pending ...` or `rank<R> failed again`).
//!
//! Environment, all optional:
//! - `CKPT_EXPLICIT=1`: call `save_state_async` instead of `save_state` on an async builder.
//! - `CKPT_WAIT=1`: call `wait_for_checkpoint` after the loop (prints `committed <dir>`).
//! - `CKPT_STOP=<k>`: end (returning `Ok`, no save) two steps after the save at step `k`, so
//!   the state changes while that save is still in the background.
//! - `CKPT_BIG_AT=<k>`, `CKPT_BIG_RANK=<r>`: rank `r` (every rank without `CKPT_BIG_RANK`)
//!   limits the files it writes to 1 MiB, and its registered object holds 4 MB for the save at
//!   step `k` only, so that save's background write fails on that rank with a real I/O error
//!   (`EFBIG`).
//! - `CKPT_QUIT_AT=<k>`, `CKPT_QUIT_RANK=<r>`: rank `r` returns an error right after the save
//!   at step `k` while the others train on.
//! - `CKPT_PAUSE_MS=<ms>`: sleep after each save (time for a test to kill it mid-write).
//! - `CKPT_CRASH_RANK=<r>`: only rank `r` keeps `IVME_CRASH_AT` / `IVME_CRASH_TRACE`.

use std::path::PathBuf;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap};
use ivme::data::{DataLoader, TensorDataset};
use ivme::optim::{AcceleratedOptimizer, AdamW, ParamsAdamW};
use ivme::stateful::{Shared, StateDict, Stateful};
use ivme::Accelerator;

/// A registered object whose tensor can be made large for one save.
struct Blob(Vec<f32>);

impl Stateful for Blob {
    fn state_dict(&self) -> ivme::Result<StateDict> {
        let n = self.0.len();
        Ok(StateDict {
            tensors: vec![(
                "blob".into(),
                Tensor::from_vec(self.0.clone(), n, &Device::Cpu)?,
            )],
            json: serde_json::Value::Null,
        })
    }
    fn load_state_dict(&mut self, s: &StateDict) -> ivme::Result<()> {
        self.0 = s.tensor("blob")?.to_vec1::<f32>()?;
        Ok(())
    }
}

fn env_num(key: &str) -> Option<u64> {
    std::env::var(key).ok().and_then(|v| v.trim().parse().ok())
}

struct Run {
    acc: Accelerator,
    varmap: VarMap,
    layer: Linear,
    opt: AcceleratedOptimizer<AdamW>,
    loader: DataLoader<TensorDataset<(Tensor, Tensor)>>,
    blob: Shared<Blob>,
}

fn setup(project: PathBuf) -> ivme::Result<Run> {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .seed(11)
        .project_dir(project)
        .total_limit(3)
        .async_checkpoints(true)
        .build()?;
    if let Some(r) = env_num("CKPT_CRASH_RANK") {
        if r != acc.process_index() as u64 {
            // Read at the first crash point, which comes after this.
            std::env::remove_var("IVME_CRASH_AT");
            std::env::remove_var("IVME_CRASH_TRACE");
        }
    }
    let varmap = VarMap::new();
    let layer = linear(
        16,
        8,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )?;
    // Deterministic weights (candle's initialisers draw from an unseeded generator).
    let mut names: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
    names.sort();
    for (k, name) in names.iter().enumerate() {
        let v = varmap.data().lock().unwrap()[name].clone();
        let vals: Vec<f32> = (0..v.elem_count())
            .map(|i| ((i * 7 + k * 3) % 11) as f32 * 0.02 - 0.1)
            .collect();
        v.set(&Tensor::from_vec(vals, v.shape(), &Device::Cpu)?)?;
    }
    let x = Tensor::arange(0f32, 48.0 * 16.0, &Device::Cpu)?
        .reshape((48, 16))?
        .affine(0.01, -3.0)?;
    let y = x.narrow(1, 0, 8)?.sin()?.contiguous()?;
    let loader = DataLoader::new(TensorDataset::new((x, y))?, 4)
        .shuffle(true)
        .seed(5);
    let opt = AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: 0.01,
            ..Default::default()
        },
    )?;
    let (varmap, loader, opt) = acc.prepare((varmap, loader, opt))?;
    let blob = acc.register_for_checkpointing(Blob(vec![1.0; 4]));
    Ok(Run {
        acc,
        varmap,
        layer,
        opt,
        loader,
        blob,
    })
}

impl Run {
    fn step(&mut self) -> ivme::Result<()> {
        let batch = self.loader.iter().next();
        let (x, y) = batch.ok_or_else(|| ivme::Error::Usage("no batch".into()))??;
        let loss = candle_nn::loss::mse(&self.layer.forward(&x)?, &y)?;
        let grads = self.acc.backward(&loss)?;
        self.opt.step(&grads)?;
        // Draw from the checkpointed generator, so its position is part of the state.
        self.acc.rng().lock().next_u64();
        Ok(())
    }

    fn fingerprint(&self) -> String {
        let data = self.varmap.data().lock().unwrap();
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        for n in names {
            let t = data[n].as_tensor().flatten_all().unwrap();
            for x in t.to_vec1::<f32>().unwrap() {
                hash = (hash ^ u64::from(x.to_bits())).wrapping_mul(0x100_0000_01b3);
            }
        }
        let pos = self.loader.position();
        let rng = self.acc.rng().lock().state();
        format!(
            "s{}-p{}.{}-r{}-w{hash:016x}",
            self.opt.steps(),
            pos.epoch,
            pos.consumed,
            rng.word_pos
        )
    }

    fn say(&self, line: String) {
        if self.acc.is_main_process() {
            println!("{line}");
        }
    }

    fn save(&mut self) -> ivme::Result<PathBuf> {
        if env_num("CKPT_EXPLICIT") == Some(1) {
            self.acc.save_state_async(None)
        } else {
            self.acc.save_state(None)
        }
    }
}

#[path = "../support/fsize.rs"]
mod fsize;
use fsize::limit_file_size;

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = || ivme::Error::Usage("usage: ckpt_async <project> <steps> <every>".into());
    let project = PathBuf::from(args.first().ok_or_else(usage)?);
    let num = |i: usize| -> ivme::Result<u64> {
        args.get(i).and_then(|s| s.parse().ok()).ok_or_else(usage)
    };
    let (steps, every) = (num(1)?, num(2)?.max(1));
    let mut run = setup(project)?;
    let loaded = run.acc.load_state_if_any()?;
    let shown = loaded.map_or("none".into(), |d| d.display().to_string());
    run.say(format!("loaded {shown} {}", run.fingerprint()));
    let rank = run.acc.process_index() as u64;
    let mine = |key: &str| env_num(key).is_none_or(|r| r == rank);
    if env_num("CKPT_BIG_AT").is_some() && mine("CKPT_BIG_RANK") {
        limit_file_size(1 << 20);
    }
    while run.opt.steps() < steps {
        run.step()?;
        let s = run.opt.steps();
        if env_num("CKPT_STOP").is_some_and(|k| s == k + 2) {
            break;
        }
        if s % every != 0 {
            continue;
        }
        let big = env_num("CKPT_BIG_AT") == Some(s) && mine("CKPT_BIG_RANK");
        if big {
            run.blob.lock().0 = vec![0.5; 1 << 20];
        }
        let saved = match run.save() {
            Ok(d) => Ok(d),
            Err(e) => {
                println!("rank{rank} failed {}", e.to_string().replace('\n', " "));
                run.save().inspect_err(|e| {
                    println!(
                        "rank{rank} failed again {}",
                        e.to_string().replace('\n', " ")
                    )
                })
            }
        };
        if big {
            // The save holds its own copy; the live object goes back to its usual size.
            run.blob.lock().0 = vec![1.0; 4];
        }
        if let Ok(d) = saved {
            run.say(format!("pending {} {}", d.display(), run.fingerprint()));
        }
        if let Some(ms) = env_num("CKPT_PAUSE_MS") {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        if env_num("CKPT_QUIT_AT") == Some(s) && mine("CKPT_QUIT_RANK") {
            return Err(ivme::Error::Usage(format!("rank {rank} quits at step {s}")));
        }
    }
    run.say(format!("final {}", run.fingerprint()));
    if env_num("CKPT_WAIT") == Some(1) {
        match run.acc.wait_for_checkpoint() {
            Ok(d) => run.say(format!(
                "committed {}",
                d.map_or("none".into(), |d| d.display().to_string())
            )),
            Err(e) => println!("rank{rank} failed {}", e.to_string().replace('\n', " ")),
        }
    }
    Ok(())
}
