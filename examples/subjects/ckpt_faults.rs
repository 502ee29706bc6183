//! Fault-test subject: a tiny training run that saves and loads through the Accelerator and
//! prints one line per save or load, so tests can check that every checkpoint reported saved
//! really loads, under concurrent writers, injected crashes and a full disk.
//!
//! Usage (`<fp>` is a fingerprint of the whole training state: optimizer step, registered tag,
//! loader position, RNG position and every weight's bits):
//!
//! - `ckpt_faults save <project> <job> <n> [pause_ms]`: `n` automatic saves, one training step
//!   before each; prints `saved <dir> <fp>` or `failed <error>` (and goes on) for each.
//! - `ckpt_faults explicit <folder> <job> <n>`: the same, saving to `<folder>/shared_<i>`.
//! - `ckpt_faults resume <project> <steps>`: `load_state_if_any` (prints `loaded <dir|none>
//!   <fp>`), then `steps` times: a step, `saving <fp>`, `save_state(None)`, `saved <dir> <fp>`.
//! - `ckpt_faults load <project>`: `load_state(None)` (prints `loaded <dir> <fp>`), then one
//!   `save_state(None)` (prints `saved <dir> <fp>`).
//! - `ckpt_faults grow <project>`: saves, then grows the registered tag's tensor to 4 MB and
//!   saves again (prints `failed <error>` when that fails, e.g. under a file size limit), then
//!   `load_state(None)` (prints `loaded <dir> <fp>`).
//! - `ckpt_faults check <list>`: for each line `<dir> <fp>` of the file `<list>`, loads `<dir>`
//!   into a fresh run and prints `ok <dir>` when its fingerprint is `<fp>`, else `bad <dir> ...`.
//!
//! Automatic saves keep the newest 2 checkpoints; `CKPT_KEEP=0` keeps all (`CKPT_KEEP=n`, n).
//! Only the main process prints. The process exits non-zero when a step other than a save
//! fails.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap};
use ivme::checkpoint::ProjectConfiguration;
use ivme::data::{DataLoader, TensorDataset};
use ivme::optim::{AcceleratedOptimizer, AdamW, ParamsAdamW};
use ivme::stateful::{Shared, StateDict, Stateful};
use ivme::Accelerator;

/// A registered object: which job wrote it, how many saves it had made, and a tensor whose
/// size the `grow` mode changes.
struct Tag {
    job: u64,
    saves: u64,
    blob: Vec<f32>,
}

impl Stateful for Tag {
    fn state_dict(&self) -> ivme::Result<StateDict> {
        let n = self.blob.len();
        Ok(StateDict {
            tensors: vec![(
                "blob".into(),
                Tensor::from_vec(self.blob.clone(), n, &Device::Cpu)?,
            )],
            json: serde_json::json!({ "job": self.job, "saves": self.saves }),
        })
    }
    fn load_state_dict(&mut self, s: &StateDict) -> ivme::Result<()> {
        let blob = s.tensor("blob")?.to_vec1::<f32>()?;
        let get = |k: &str| {
            s.json[k]
                .as_u64()
                .ok_or_else(|| ivme::Error::Usage(format!("tag state has no `{k}`")))
        };
        (self.job, self.saves, self.blob) = (get("job")?, get("saves")?, blob);
        Ok(())
    }
}

struct Run {
    acc: Accelerator,
    varmap: VarMap,
    layer: Linear,
    opt: AcceleratedOptimizer<AdamW>,
    loader: DataLoader<TensorDataset<(Tensor, Tensor)>>,
    tag: Shared<Tag>,
}

fn setup(project: Option<&Path>, job: u64) -> ivme::Result<Run> {
    let mut acc = Accelerator::builder().cpu(true).seed(7).build()?;
    if let Some(p) = project {
        let keep: usize = std::env::var("CKPT_KEEP")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2);
        let mut cfg = ProjectConfiguration::new(p).automatic_checkpoint_naming(true);
        if keep > 0 {
            cfg = cfg.total_limit(keep);
        }
        acc.set_project_configuration(cfg)?;
    }
    let varmap = VarMap::new();
    let layer = linear(
        3,
        2,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )?;
    // Deterministic weights, different per job, so a mix of two jobs' saves would show.
    let mut names: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
    names.sort();
    for (k, name) in names.iter().enumerate() {
        let v = varmap.data().lock().unwrap()[name].clone();
        let n = v.elem_count();
        let vals: Vec<f32> = (0..n)
            .map(|i| (job * 10 + k as u64) as f32 + i as f32 * 0.25)
            .collect();
        v.set(&Tensor::from_vec(vals, v.shape(), &Device::Cpu)?)?;
    }
    let x = Tensor::arange(0f32, 36.0, &Device::Cpu)?
        .reshape((12, 3))?
        .affine(0.1, -1.0)?;
    let y = x
        .sum_keepdim(1)?
        .sin()?
        .broadcast_as((12, 2))?
        .contiguous()?;
    let loader = DataLoader::new(TensorDataset::new((x, y))?, 4)
        .shuffle(true)
        .seed(3);
    let opt = AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: 0.01,
            ..Default::default()
        },
    )?;
    let (varmap, loader, opt) = acc.prepare((varmap, loader, opt))?;
    let tag = acc.register_for_checkpointing(Tag {
        job,
        saves: 0,
        blob: vec![job as f32; 4],
    });
    Ok(Run {
        acc,
        varmap,
        layer,
        opt,
        loader,
        tag,
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
        let bits: Vec<String> = names
            .iter()
            .flat_map(|n| {
                data[*n]
                    .as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            })
            .map(|x| format!("{:x}", x.to_bits()))
            .collect();
        let tag = self.tag.lock();
        let pos = self.loader.position();
        let rng = self.acc.rng().lock().state();
        format!(
            "s{}-t{}.{}.{}-p{}.{}-r{}-w{}",
            self.opt.steps(),
            tag.job,
            tag.saves,
            tag.blob.len(),
            pos.epoch,
            pos.consumed,
            rng.word_pos,
            bits.join(".")
        )
    }

    /// Prints a line from the main process only (every rank runs the same loop).
    fn say(&self, line: String) {
        if self.acc.is_main_process() {
            println!("{line}");
        }
    }

    fn save(&mut self, dir: Option<&Path>) -> bool {
        self.tag.lock().saves += 1;
        match self.acc.save_state(dir) {
            Ok(d) => {
                self.say(format!("saved {} {}", d.display(), self.fingerprint()));
                true
            }
            Err(e) => {
                self.tag.lock().saves -= 1;
                self.say(format!("failed {}", e.to_string().replace('\n', " ")));
                false
            }
        }
    }
}

fn arg(args: &[String], i: usize, what: &str) -> ivme::Result<String> {
    args.get(i)
        .cloned()
        .ok_or_else(|| ivme::Error::Usage(format!("missing argument {i}: {what}")))
}

fn num(args: &[String], i: usize, what: &str) -> ivme::Result<u64> {
    arg(args, i, what)?
        .parse()
        .map_err(|_| ivme::Error::Usage(format!("argument {i} ({what}) is not a number")))
}

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = arg(&args, 0, "mode")?;
    let place = PathBuf::from(arg(&args, 1, "folder")?);
    match mode.as_str() {
        "save" | "explicit" => {
            let (job, n) = (num(&args, 2, "job")?, num(&args, 3, "saves")?);
            let pause = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(0u64);
            let auto = mode == "save";
            let mut run = setup(auto.then_some(place.as_path()), job)?;
            for i in 0..n {
                run.step()?;
                let dir = (!auto).then(|| place.join(format!("shared_{i}")));
                run.save(dir.as_deref());
                std::thread::sleep(std::time::Duration::from_millis(pause));
            }
        }
        "resume" => {
            let steps = num(&args, 2, "steps")?;
            let mut run = setup(Some(&place), 1)?;
            let loaded = run.acc.load_state_if_any()?;
            let shown = loaded.map_or("none".into(), |d| d.display().to_string());
            run.say(format!("loaded {shown} {}", run.fingerprint()));
            for _ in 0..steps {
                run.step()?;
                run.tag.lock().saves += 1;
                run.say(format!("saving {}", run.fingerprint()));
                let d = run.acc.save_state(None)?;
                run.say(format!("saved {} {}", d.display(), run.fingerprint()));
            }
        }
        "load" => {
            let mut run = setup(Some(&place), 1)?;
            let d = run.acc.load_state(None)?;
            run.say(format!("loaded {} {}", d.display(), run.fingerprint()));
            run.step()?;
            if !run.save(None) {
                std::process::exit(3);
            }
        }
        "grow" => {
            let mut run = setup(Some(&place), 1)?;
            run.step()?;
            run.save(None);
            run.tag.lock().blob = vec![0.5; 1 << 20];
            run.step()?;
            run.save(None);
            let d = run.acc.load_state(None)?;
            run.say(format!("loaded {} {}", d.display(), run.fingerprint()));
        }
        "check" => {
            let list = std::fs::read_to_string(&place)
                .map_err(|e| ivme::Error::io("reading the list", e))?;
            // One run loads every listed checkpoint in turn (a load replaces all state).
            let mut run = setup(None, 0)?;
            for line in list.lines().filter(|l| !l.trim().is_empty()) {
                let (dir, want) = line.split_once(' ').unwrap_or((line, ""));
                let verdict = match run.acc.load_state(Some(Path::new(dir))) {
                    Ok(_) if run.fingerprint() == want => format!("ok {dir}"),
                    Ok(_) => format!("bad {dir} holds {}", run.fingerprint()),
                    Err(e) => format!("bad {dir} {}", e.to_string().replace('\n', " ")),
                };
                run.say(verdict);
            }
        }
        other => {
            return Err(ivme::Error::Usage(format!(
                "unknown mode `{other}`: use save, explicit, resume, load, grow or check"
            )))
        }
    }
    Ok(())
}
