//! Tests of how `load_state` reads a checkpoint: each file once (the model's twice: checked,
//! then read into its variables), everything checked before anything is applied.

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

/// A prepared model with AdamW state (in a project at `project`, if given), its variables
/// sorted by name, and its optimizer.
fn prepared(project: Option<&Path>) -> (Accelerator, Vec<Var>, AcceleratedOptimizer<AdamW>) {
    let mut acc = Accelerator::builder().cpu(true).build().unwrap();
    if let Some(p) = project {
        let config = super::ProjectConfiguration::new(p).automatic_checkpoint_naming(true);
        acc.set_project_configuration(config).unwrap();
    }
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
    let (varmap, opt) = acc.prepare((varmap, opt)).unwrap();
    let mut vars: Vec<(String, Var)> = varmap.data().lock().unwrap().clone().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let vars: Vec<Var> = vars.into_iter().map(|(_, v)| v).collect();
    (acc, vars, opt)
}

/// One training step.
fn step(acc: &mut Accelerator, opt: &mut AcceleratedOptimizer<AdamW>, vars: &[Var]) {
    let loss = (vars[0].as_tensor().sqr().unwrap().sum_all().unwrap()
        + vars[1].as_tensor().sum_all().unwrap())
    .unwrap();
    let grads = acc.backward(&loss).unwrap();
    opt.step(&grads).unwrap();
}

/// A prepared model with AdamW state after one step, saved to `dir`; returns the variables
/// (sorted by name) and the optimizer, so a test can move on and load back.
fn saved_run(dir: &Path) -> (Accelerator, Vec<Var>, AcceleratedOptimizer<AdamW>) {
    let (mut acc, vars, mut opt) = prepared(None);
    step(&mut acc, &mut opt, &vars);
    acc.save_state(Some(dir)).unwrap();
    // Move on, so that a load is visible.
    step(&mut acc, &mut opt, &vars);
    (acc, vars, opt)
}

/// The files of checkpoint `ck`, per its manifest.
fn listed(ck: &Path) -> Vec<PathBuf> {
    verify(ck)
        .unwrap()
        .files
        .iter()
        .map(|e| ck.join(&e.path))
        .collect()
}

/// How many times each of `files` was opened.
fn opened_files(
    files: &[PathBuf],
    counts: &std::collections::HashMap<PathBuf, usize>,
) -> Vec<usize> {
    files
        .iter()
        .map(|f| counts.get(f).copied().unwrap_or(0))
        .collect()
}

/// How many times a load opens each of `files`: the model's file twice (checked, streamed
/// through a small buffer; then read straight into the variables), every other file once.
fn once_but_the_model(files: &[PathBuf]) -> Vec<usize> {
    files
        .iter()
        .map(|f| {
            if f.ends_with("rank0/model_0.safetensors") {
                2
            } else {
                1
            }
        })
        .collect()
}

/// Where each variable's values live.
fn buffers(vars: &[Var]) -> Vec<usize> {
    vars.iter()
        .map(|v| {
            let (storage, _) = v.as_tensor().storage_and_layout();
            match &*storage {
                candle_core::Storage::Cpu(s) => s.as_slice::<f32>().unwrap().as_ptr() as usize,
                _ => unreachable!("CPU variables"),
            }
        })
        .collect()
}

#[test]
fn resuming_from_a_project_reads_each_file_once_and_skips_a_damaged_newest() {
    let root = scratch("load-newest");
    let (mut acc, vars, mut opt) = prepared(Some(&root));
    step(&mut acc, &mut opt, &vars);
    let first = acc.save_state(None).unwrap();
    let w1 = bits(&vars);
    step(&mut acc, &mut opt, &vars);
    let second = acc.save_state(None).unwrap();
    let w2 = bits(&vars);
    step(&mut acc, &mut opt, &vars);
    let checkpoints = root.join("checkpoints");
    let (first_files, second_files) = (listed(&first), listed(&second));
    opened::take_under(&checkpoints);
    assert_eq!(acc.load_state(None).unwrap(), second);
    assert_eq!(bits(&vars), w2);
    let counts = opened::take_under(&checkpoints);
    let expected = once_but_the_model(&second_files);
    let once = opened_files(&second_files, &counts);
    assert_eq!(once, expected, "load_state(None): {counts:?}");
    assert!(opened_files(&first_files, &counts).iter().all(|&n| n == 0));
    assert_eq!(acc.load_state_if_any().unwrap(), Some(second.clone()));
    let counts = opened::take_under(&checkpoints);
    let once = opened_files(&second_files, &counts);
    assert_eq!(once, expected, "load_state_if_any: {counts:?}");
    // One flipped bit in the newest weights (same size, so only the checksum can tell):
    // the older checkpoint is loaded instead, and nothing of the damaged one was applied.
    step(&mut acc, &mut opt, &vars);
    let path = second.join("rank0/model_0.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 400;
    bytes[at] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    assert_eq!(acc.load_state_if_any().unwrap(), Some(first.clone()));
    assert_eq!(bits(&vars), w1);
    step(&mut acc, &mut opt, &vars);
    assert_eq!(acc.load_state(None).unwrap(), first);
    assert_eq!(bits(&vars), w1);
    // Both damaged: an error, never a fresh start.
    let path = first.join("rank0/model_0.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let e = acc.load_state_if_any().unwrap_err().to_string();
    assert!(e.contains("none verifies") && e.contains("checksum"), "{e}");
    let e = acc.load_state(None).unwrap_err().to_string();
    assert!(e.contains("no complete checkpoint"), "{e}");
    let _ = std::fs::remove_dir_all(&root);
}

/// A registered counter that refuses to be put back to `refused`.
struct Picky {
    count: u64,
    refused: Option<u64>,
}

impl crate::stateful::Stateful for Picky {
    fn state_dict(&self) -> crate::Result<crate::stateful::StateDict> {
        Ok(crate::stateful::StateDict {
            tensors: Vec::new(),
            json: serde_json::json!({ "count": self.count }),
        })
    }
    fn load_state_dict(&mut self, state: &crate::stateful::StateDict) -> crate::Result<()> {
        let count = state.json["count"].as_u64().unwrap();
        if self.refused == Some(count) {
            return Err(crate::Error::Usage(format!("count {count} is not allowed")));
        }
        self.count = count;
        Ok(())
    }
}

/// A newest checkpoint that is sound but that this run refuses (a registered object will not
/// take its state) is unfit: an error that says so, nothing loaded, and no fallback to the
/// older checkpoint, which would silently resume from the wrong step.
#[test]
fn a_sound_newest_this_run_refuses_is_unfit_and_nothing_falls_back() {
    use crate::CheckpointErrorKind as Kind;
    let root = scratch("load-unfit-newest");
    let (mut acc, vars, mut opt) = prepared(Some(&root));
    let picky = acc.register_for_checkpointing(Picky {
        count: 1,
        refused: None,
    });
    step(&mut acc, &mut opt, &vars);
    acc.save_state(None).unwrap();
    picky.lock().count = 2;
    step(&mut acc, &mut opt, &vars);
    acc.save_state(None).unwrap();
    step(&mut acc, &mut opt, &vars);
    let before = bits(&vars);
    picky.lock().refused = Some(2);
    for e in [
        acc.load_state_if_any().unwrap_err(),
        acc.load_state(None).unwrap_err(),
    ] {
        assert_eq!(e.checkpoint_kind(), Some(Kind::Unfit), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("count 2 is not allowed"), "{msg}");
        assert!(msg.contains("nothing was loaded"), "{msg}");
        assert_eq!(
            bits(&vars),
            before,
            "nothing of either checkpoint was applied"
        );
    }
    assert_eq!(picky.lock().count, 2);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn load_state_reads_the_weights_into_the_variables_own_buffers_and_other_files_once() {
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
    let before = buffers(&vars);
    opened::take_under(&ck);
    acc.load_state(Some(&ck)).unwrap();
    let counts = opened::take_under(&ck);
    assert_eq!(bits(&vars), saved, "the weights are the saved ones");
    // Read into the buffers the variables had: no second copy of the weights in memory.
    assert_eq!(
        buffers(&vars),
        before,
        "the variables' buffers were replaced"
    );
    let files: Vec<PathBuf> = listed.iter().map(|e| ck.join(&e.path)).collect();
    assert_eq!(
        opened_files(&files, &counts),
        once_but_the_model(&files),
        "{counts:?}"
    );
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

/// Each way a load can fail carries a kind a caller can branch on: no checkpoint yet
/// (start fresh), a damaged one (an older one may stand in), one that does not fit the run
/// (never load it), a folder another job holds.
#[test]
fn checkpoint_errors_say_which_kind_of_problem_they_are() {
    use crate::CheckpointErrorKind as Kind;
    let kind = |r: crate::Result<_>| r.err().and_then(|e| e.checkpoint_kind());

    // A project without a checkpoint: missing.
    let root = scratch("kind-missing");
    let (mut acc, _, _) = prepared(Some(&root));
    assert_eq!(kind(acc.load_state(None)), Some(Kind::Missing));

    // No folder there at all: missing.
    let nowhere = root.join("no-such-checkpoint");
    assert_eq!(kind(acc.load_state(Some(&nowhere))), Some(Kind::Missing));

    // A file cut short: damaged.
    let dir = scratch("kind-damaged");
    let (mut acc, vars, mut opt) = saved_run(&dir);
    let big = listed(&dir)
        .into_iter()
        .max_by_key(|f| std::fs::metadata(f).unwrap().len())
        .unwrap();
    let len = std::fs::metadata(&big).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&big)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    assert_eq!(kind(acc.load_state(Some(&dir))), Some(Kind::Damaged));
    // ... and so is a listed file that is gone.
    std::fs::remove_file(&big).unwrap();
    assert_eq!(kind(acc.load_state(Some(&dir))), Some(Kind::Damaged));

    // A sound checkpoint of another model: unfit.
    let dir = scratch("kind-unfit");
    step(&mut acc, &mut opt, &vars);
    let other = scratch("kind-unfit-other");
    let mut small = Accelerator::builder().cpu(true).build().unwrap();
    let varmap = VarMap::new();
    varmap
        .get(3, "a.weight", Init::Const(1.0), DType::F32, &Device::Cpu)
        .unwrap();
    let adamw = AdamW::new(varmap.all_vars(), ParamsAdamW::default()).unwrap();
    let _prepared = small.prepare((varmap, adamw)).unwrap();
    small.save_state(Some(&other)).unwrap();
    acc.save_state(Some(&dir)).unwrap();
    assert_eq!(kind(acc.load_state(Some(&other))), Some(Kind::Unfit));
    assert!(acc.load_state(Some(&dir)).is_ok());

    // Every other error has no checkpoint kind.
    assert_eq!(crate::Error::Usage("x".into()).checkpoint_kind(), None);
    for d in [
        "kind-missing",
        "kind-damaged",
        "kind-unfit",
        "kind-unfit-other",
    ] {
        let _ = std::fs::remove_dir_all(scratch(d));
    }
}
