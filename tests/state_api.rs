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
        [".ivme-lock", "checkpoint_2", "checkpoint_3"],
        "total_limit 2 keeps the newest two (and the folder's lock file)"
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

/// A run with every kind of saved state: weights, AdamW moments, a data loader, the RNG and a
/// registered object.
struct Full {
    acc: Accelerator,
    varmap: VarMap,
    layer: candle_nn::Linear,
    opt: ivme::optim::AcceleratedOptimizer<AdamW>,
    loader: ivme::data::DataLoader<ivme::data::TensorDataset<(Tensor, Tensor)>>,
    counter: ivme::stateful::Shared<Counter>,
}

fn full() -> Full {
    let mut acc = Accelerator::builder().cpu(true).build().unwrap();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let layer = linear(3, 2, vb).unwrap();
    let x = Tensor::arange(0f32, 30.0, &Device::Cpu)
        .unwrap()
        .reshape((10, 3))
        .unwrap();
    let y = x.narrow(1, 0, 2).unwrap().cos().unwrap();
    let data = ivme::data::TensorDataset::new((x, y)).unwrap();
    let loader = ivme::data::DataLoader::new(data, 3).shuffle(true).seed(5);
    let opt = AdamW::new(varmap.all_vars(), ParamsAdamW::default()).unwrap();
    let (varmap, loader, opt) = acc.prepare((varmap, loader, opt)).unwrap();
    let counter = acc.register_for_checkpointing(Counter(0));
    Full {
        acc,
        varmap,
        layer,
        opt,
        loader,
        counter,
    }
}

fn train(f: &mut Full) {
    use candle_core::Module;
    let (x, y) = f.loader.iter().next().unwrap().unwrap();
    let loss = candle_nn::loss::mse(&f.layer.forward(&x).unwrap(), &y).unwrap();
    let g = f.acc.backward(&loss).unwrap();
    f.opt.step(&g).unwrap();
    f.acc.rng().lock().next_u64();
    f.counter.lock().0 += 1;
}

/// Everything a load could change, as bits.
fn snapshot(f: &Full) -> String {
    use ivme::optim::StatefulOptimizer;
    let bits = |t: &Tensor| -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    };
    let w: Vec<u32> = weights(&f.varmap).iter().map(|x| x.to_bits()).collect();
    let st = f.opt.inner().state_dict().unwrap();
    let moments: Vec<Vec<(String, Vec<u32>)>> = st
        .tensors
        .iter()
        .map(|v| v.iter().map(|(k, t)| (k.clone(), bits(t))).collect())
        .collect();
    format!(
        "w={w:?} opt={moments:?} {} rng={:?} loader={:?} counter={} micro={:?}",
        st.scalars,
        f.acc.rng().lock().state(),
        f.loader.position(),
        f.counter.lock().0,
        f.acc.scaler()
    )
}

/// Rewrites `good` into `bad` with rank 0's state changed by `damage`, checksummed anew.
fn rewrite(
    good: &std::path::Path,
    bad: &std::path::Path,
    damage: impl Fn(&mut ivme::checkpoint::RankState),
) {
    let mut state = ivme::checkpoint::read_rank(good, 0).unwrap();
    damage(&mut state);
    let m = ivme::checkpoint::verify(good).unwrap();
    let tmp = ivme::checkpoint::begin(bad).unwrap();
    ivme::checkpoint::store::write_rank(&tmp, 0, &state).unwrap();
    let meta = ivme::checkpoint::ManifestMeta {
        world_size: 1,
        step: m.step,
        extra: m.extra,
    };
    ivme::checkpoint::commit(&tmp, bad, meta).unwrap();
}

fn component<'a>(
    s: &'a mut ivme::checkpoint::RankState,
    name: &str,
) -> &'a mut ivme::checkpoint::Component {
    s.components.iter_mut().find(|c| c.name == name).unwrap()
}

#[test]
fn a_refused_load_changes_nothing() {
    let root = common::Scratch::new("state-all-or-nothing");
    let mut f = full();
    train(&mut f);
    train(&mut f);
    let good = root.0.join("good");
    f.acc.save_state(Some(&good)).unwrap();
    // Move on, so that loading anything from `good` would be visible.
    train(&mut f);
    train(&mut f);
    let before = snapshot(&f);
    type Damage = Box<dyn Fn(&mut ivme::checkpoint::RankState)>;
    let kinds: Vec<(&str, &str, Damage)> = vec![
        (
            "optimizer shape",
            "exp_avg",
            Box::new(|s| {
                let c = component(s, "optimizer_0");
                c.tensors[0].1 = Tensor::zeros(7, DType::F32, &Device::Cpu).unwrap();
            }),
        ),
        (
            "rng json",
            "rng.json",
            Box::new(|s| {
                component(s, "rng").json =
                    serde_json::json!({"seed": "not 32 bytes", "word_pos": 0});
            }),
        ),
        (
            "scaler json",
            "scaler",
            Box::new(|s| {
                component(s, "training").json["scaler"] = serde_json::json!({"scale": "huge"});
            }),
        ),
        (
            "registered count",
            "register",
            Box::new(|s| {
                s.components.push(ivme::checkpoint::Component {
                    name: "custom_1".into(),
                    tensors: vec![],
                    json: serde_json::json!({"n": 1}),
                });
            }),
        ),
        (
            "loader position",
            "loader_0.json",
            Box::new(|s| {
                component(s, "loader_0").json =
                    serde_json::json!({"epoch": -3, "seed": 0, "consumed": "x"});
            }),
        ),
        (
            "extra model tensor",
            "model_0.safetensors",
            Box::new(|s| {
                let t = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
                component(s, "model_0").tensors.push(("stray".into(), t));
            }),
        ),
    ];
    for (i, (kind, named, damage)) in kinds.iter().enumerate() {
        let bad = root.0.join(format!("bad{i}"));
        rewrite(&good, &bad, damage);
        ivme::checkpoint::verify(&bad).expect("the bad checkpoint is checksummed");
        let e = f.acc.load_state(Some(&bad)).unwrap_err().to_string();
        assert_eq!(
            snapshot(&f),
            before,
            "{kind}: a refused load changed the state ({e})"
        );
        assert!(
            e.contains(named) && e.contains("nothing was loaded"),
            "{kind}: {e}"
        );
    }
    // The intact checkpoint does load, and changes every piece back.
    f.acc.load_state(Some(&good)).unwrap();
    assert_ne!(snapshot(&f), before);
    assert_eq!(f.counter.lock().0, 2);
}

#[test]
fn load_state_if_any_starts_fresh_resumes_or_refuses() {
    let project = tmp("if-any");
    let mut r = run(&project, 3);
    assert_eq!(
        r.acc.load_state_if_any().unwrap(),
        None,
        "no checkpoint yet"
    );
    step(&mut r);
    let first = r.acc.save_state(None).unwrap();
    let w1 = weights(&r.varmap);
    step(&mut r);
    let second = r.acc.save_state(None).unwrap();
    let w2 = weights(&r.varmap);
    let mut fresh = run(&project, 3);
    assert_eq!(fresh.acc.load_state_if_any().unwrap(), Some(second.clone()));
    assert_eq!(weights(&fresh.varmap), w2);
    // A damaged newest: the older valid one is loaded (with a warning on stderr).
    std::fs::write(second.join("rank0/rng.json"), b"{}").unwrap();
    let mut fresh = run(&project, 3);
    assert_eq!(fresh.acc.load_state_if_any().unwrap(), Some(first.clone()));
    assert_eq!(weights(&fresh.varmap), w1);
    // Checkpoints, but none verifies: an error, not a silent fresh start.
    std::fs::write(first.join("rank0/rng.json"), b"{}").unwrap();
    let e = fresh.acc.load_state_if_any().unwrap_err().to_string();
    assert!(e.contains("none verifies") && e.contains("rng.json"), "{e}");
    let mut bare = Accelerator::builder().cpu(true).build().unwrap();
    let e = bare.load_state_if_any().unwrap_err().to_string();
    assert!(e.contains("ProjectConfiguration"), "{e}");
    let _ = std::fs::remove_dir_all(project);
}

#[test]
fn a_fresh_run_loads_lazily_created_optimizer_state() {
    // SGD creates its momentum buffers at the first step: a fresh run has none yet and must
    // still accept a checkpoint that has them.
    use ivme::optim::{ParamsSgd, Sgd};
    let root = common::Scratch::new("state-sgd-fresh");
    let make = || {
        let mut acc = Accelerator::builder().cpu(true).build().unwrap();
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let layer = linear(3, 1, vb).unwrap();
        let params = ParamsSgd {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        };
        let opt = Sgd::new(varmap.all_vars(), params).unwrap();
        let (varmap, opt) = acc.prepare((varmap, opt)).unwrap();
        (acc, varmap, layer, opt)
    };
    let (mut acc, varmap, layer, mut opt) = make();
    use candle_core::Module;
    let x = Tensor::new(&[[1f32, 2.0, 3.0]], &Device::Cpu).unwrap();
    let loss = layer.forward(&x).unwrap().sqr().unwrap().sum_all().unwrap();
    let g = acc.backward(&loss).unwrap();
    opt.step(&g).unwrap();
    let dir = root.0.join("sgd");
    acc.save_state(Some(&dir)).unwrap();
    let (mut fresh, fresh_vm, _, fresh_opt) = make();
    fresh.load_state(Some(&dir)).unwrap();
    assert_eq!(weights(&fresh_vm), weights(&varmap));
    assert_eq!(fresh_opt.steps(), 1);
}
