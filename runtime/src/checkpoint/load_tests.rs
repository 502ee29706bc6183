//! Tests of how `load_state` reads a checkpoint: each file once, everything checked before
//! anything is applied.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Var};
use candle_nn::{Init, Optimizer, VarMap};

use super::fsio::opened;
use super::store::{verify, MANIFEST_FILE};
use crate::optim::{AcceleratedOptimizer, AdamW, ParamsAdamW};
use crate::Accelerator;

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ivme-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn bits(vars: &[Var]) -> Vec<Vec<u32>> {
    vars.iter()
        .map(|v| {
            let t = v.as_tensor().flatten_all().unwrap();
            t.to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        })
        .collect()
}

/// A prepared model with AdamW state after one step, saved to `dir`; returns the variables
/// (sorted by name) and the optimizer, so a test can move on and load back.
fn saved_run(dir: &Path) -> (Accelerator, Vec<Var>, AcceleratedOptimizer<AdamW>) {
    let mut acc = Accelerator::builder().cpu(true).build().unwrap();
    let varmap = VarMap::new();
    let init = Init::Uniform { lo: -1.0, up: 1.0 };
    // Large enough that the weight file is read by several threads where there are cores.
    varmap
        .get((2048, 2100), "a.weight", init, DType::F32, &Device::Cpu)
        .unwrap();
    varmap
        .get(2100, "a.bias", init, DType::F32, &Device::Cpu)
        .unwrap();
    let opt = AdamW::new(varmap.all_vars(), ParamsAdamW::default()).unwrap();
    let (varmap, mut opt) = acc.prepare((varmap, opt)).unwrap();
    let mut vars: Vec<(String, Var)> = varmap.data().lock().unwrap().clone().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let vars: Vec<Var> = vars.into_iter().map(|(_, v)| v).collect();
    let step = |acc: &mut Accelerator, opt: &mut AcceleratedOptimizer<AdamW>| {
        let loss = (vars[0].as_tensor().sqr().unwrap().sum_all().unwrap()
            + vars[1].as_tensor().sum_all().unwrap())
        .unwrap();
        let grads = acc.backward(&loss).unwrap();
        opt.step(&grads).unwrap();
    };
    step(&mut acc, &mut opt);
    acc.save_state(Some(dir)).unwrap();
    // Move on, so that a load is visible.
    step(&mut acc, &mut opt);
    (acc, vars, opt)
}

#[test]
fn load_state_reads_each_file_once_and_applies_from_memory() {
    let root = scratch("load-once");
    let ck = root.join("ck");
    let (mut acc, vars, _opt) = saved_run(&ck);
    let listed = verify(&ck).unwrap().files;
    let saved = {
        let reread = super::store::read_rank(&ck, 0).unwrap();
        let model = reread.get("model_0").unwrap();
        model
            .tensors
            .iter()
            .map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>())
            .collect::<Vec<_>>()
    };
    assert_ne!(bits(&vars), saved, "the run moved on after saving");
    opened::take_under(&ck);
    acc.load_state(Some(&ck)).unwrap();
    let counts = opened::take_under(&ck);
    assert_eq!(bits(&vars), saved, "the weights are the saved ones");
    for e in &listed {
        assert_eq!(
            counts.get(&ck.join(&e.path)).copied().unwrap_or(0),
            1,
            "{} is read exactly once by load_state: {counts:?}",
            e.path
        );
    }
    // Once to pick the checkpoint (the main process), once for the plan every rank follows.
    let manifest = counts.get(&ck.join(MANIFEST_FILE)).copied().unwrap_or(0);
    assert!(manifest <= 2, "manifest opened {manifest} times");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_corrupt_file_after_a_good_one_changes_nothing() {
    let root = scratch("load-corrupt");
    let good = root.join("good");
    let (mut acc, vars, _opt) = saved_run(&good);
    let before = bits(&vars);
    for (i, file) in ["model_0.safetensors", "optimizer_0.safetensors"]
        .iter()
        .enumerate()
    {
        // A copy of the good checkpoint with one flipped byte deep in the data of `file`,
        // which the optimizer's file follows and the model's precedes.
        let bad = root.join(format!("bad{i}"));
        std::fs::create_dir_all(bad.join("rank0")).unwrap();
        for e in std::fs::read_dir(good.join("rank0")).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), bad.join("rank0").join(e.file_name())).unwrap();
        }
        std::fs::copy(good.join(MANIFEST_FILE), bad.join(MANIFEST_FILE)).unwrap();
        let path = bad.join("rank0").join(file);
        let mut bytes = std::fs::read(&path).unwrap();
        let at = bytes.len() - 4 * 1000;
        bytes[at] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let err = acc.load_state(Some(&bad)).unwrap_err().to_string();
        assert!(
            err.contains(file)
                && err.contains("checksum does not match the manifest (corrupt file)")
                && err.contains("nothing was loaded"),
            "{file}: {err}"
        );
        assert_eq!(
            bits(&vars),
            before,
            "{file}: a refused load changed the weights"
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}
