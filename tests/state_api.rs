//! save_state / load_state through the Accelerator on one process: automatic naming, rotation,
//! choosing the newest verified checkpoint, and refusing damaged or mismatched ones.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::{linear, Optimizer, VarBuilder, VarMap};
use ivme::optim::{AdamW, ParamsAdamW};
use ivme::stateful::{StateDict, Stateful};
use ivme::Accelerator;
use std::path::PathBuf;

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ivme-state-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

struct Counter(u64);

impl Stateful for Counter {
    fn state_dict(&self) -> ivme::Result<StateDict> {
        Ok(StateDict::json(serde_json::json!({ "n": self.0 })))
    }
    fn load_state_dict(&mut self, s: &StateDict) -> ivme::Result<()> {
        self.0 = s.json["n"].as_u64().unwrap_or(0);
        Ok(())
    }
}

struct Run {
    acc: Accelerator,
    varmap: VarMap,
    opt: ivme::optim::AcceleratedOptimizer<AdamW>,
    layer: candle_nn::Linear,
}

fn run(project: &PathBuf, limit: usize) -> Run {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .project_dir(project)
        .total_limit(limit)
        .build()
        .unwrap();
    let varmap = VarMap::new();
    let layer = linear(
        3,
        1,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    let opt = AdamW::new(varmap.all_vars(), ParamsAdamW::default()).unwrap();
    let (varmap, opt) = acc.prepare((varmap, opt)).unwrap();
    Run {
        acc,
        varmap,
        opt,
        layer,
    }
}

fn step(r: &mut Run) {
    use candle_core::Module;
    let x = Tensor::new(&[[1f32, 2.0, 3.0]], &Device::Cpu).unwrap();
    let loss = r
        .layer
        .forward(&x)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap();
    let g = r.acc.backward(&loss).unwrap();
    r.opt.step(&g).unwrap();
}

fn weights(vm: &VarMap) -> Vec<f32> {
    common::flat_weights(vm)
}

#[test]
fn automatic_names_rotate_and_load_picks_the_newest_valid_checkpoint() {
    let project = tmp("auto");
    let mut r = run(&project, 2);
    let counter = r.acc.register_for_checkpointing(Counter(0));
    let mut saved = Vec::new();
    for i in 0..4 {
        step(&mut r);
        counter.lock().0 = i;
        saved.push((r.acc.save_state(None).unwrap(), weights(&r.varmap)));
    }
    let ckpts = project.join("checkpoints");
    let mut names: Vec<String> = std::fs::read_dir(&ckpts)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["checkpoint_2", "checkpoint_3"],
        "total_limit 2 keeps the newest two"
    );

    // Damage the newest: a fresh run must fall back to checkpoint_2, with a warning.
    let victim = saved[3].0.join("rank0/model_0.safetensors");
    let mut bytes = std::fs::read(&victim).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&victim, bytes).unwrap();

    let mut fresh = run(&project, 2);
    let counter2 = fresh.acc.register_for_checkpointing(Counter(99));
    let loaded = fresh.acc.load_state(None).unwrap();
    assert_eq!(loaded, saved[2].0);
    assert_eq!(weights(&fresh.varmap), saved[2].1);
    assert_eq!(counter2.lock().0, 2);
    // An explicit path that fails verification is an error naming the bad file.
    let e = fresh
        .acc
        .load_state(Some(&saved[3].0))
        .unwrap_err()
        .to_string();
    assert!(e.contains("model_0.safetensors"), "{e}");
    // Saving after a resume continues the numbering instead of failing with "exists".
    let next = fresh.acc.save_state(None).unwrap();
    assert!(next.ends_with("checkpoint_4"), "{}", next.display());
    let _ = std::fs::remove_dir_all(project);
}

#[test]
fn a_checkpoint_with_other_registered_objects_is_refused() {
    let project = tmp("registered");
    let mut r = run(&project, 3);
    r.acc.register_for_checkpointing(Counter(1));
    step(&mut r);
    let dir = r.acc.save_state(None).unwrap();
    let mut other = run(&project, 3);
    let e = other.acc.load_state(Some(&dir)).unwrap_err().to_string();
    assert!(e.contains("register"), "{e}");
    let _ = std::fs::remove_dir_all(project);
}

#[test]
fn total_limit_without_a_project_is_refused() {
    let e = Accelerator::builder()
        .total_limit(2)
        .build()
        .unwrap_err()
        .to_string();
    assert!(e.contains("project_dir"), "{e}");
}

#[test]
fn save_model_writes_shards_that_load_back() {
    let project = tmp("model");
    let mut r = run(&project, 1);
    step(&mut r);
    let out = project.join("model");
    r.acc.save_model(&out, Some("8B")).unwrap();
    assert!(out.join("model.safetensors.index.json").is_file());
    let before = weights(&r.varmap);
    for v in r.varmap.all_vars() {
        v.set(&v.as_tensor().zeros_like().unwrap()).unwrap();
    }
    r.acc.load_model(&out).unwrap();
    assert_eq!(weights(&r.varmap), before);
    // The same files into a plain candle model built without any Accelerator.
    let plain = VarMap::new();
    linear(
        3,
        1,
        VarBuilder::from_varmap(&plain, DType::F32, &Device::Cpu),
    )
    .unwrap();
    ivme::checkpoint::load_checkpoint_in_varmap(&plain, &out, &Device::Cpu).unwrap();
    assert_eq!(weights(&plain), before);
    let _ = std::fs::remove_dir_all(project);
}
