//! Fine-tuning a pretrained base with LoRA adapters and a new head, on real processes, against
//! plain candle doing the same maths: the base's weights as constants, the adapters
//! `W x + (alpha / r) · B A x` written out by hand, the window's mean gradient clipped over the
//! trained gradients only (as PyTorch's `clip_grad_norm_` over the optimizer's parameters),
//! candle-nn's AdamW. Also the PEFT-layout adapter, merging it into the base, and bad input.
//!
//! Needs the built binaries: `cargo build --workspace --bins --examples`.

mod common;
mod reference;

#[path = "../examples/support/finetune_net.rs"]
mod finetune_net;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};
use common::{launch, scratch, text};
use finetune_net::{base_tensors, batch, flat, start_value, write_base, SMALL};
use reference::clipped_window_step;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

const CLIP: f64 = 0.05;
const ACCUM: usize = 2;
const STEPS: usize = 3;
const SCALE: f64 = 8.0 / 4.0;

/// `x Wᵀ + b`, `x` of shape (n, in).
fn lin(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let y = x.matmul(&w.t().unwrap()).unwrap();
    match b {
        Some(b) => y.broadcast_add(b).unwrap(),
        None => y,
    }
}

/// The fine-tuned model's output with the base `base` and the trained tensors `t`, by name.
fn forward(x: &Tensor, base: &HashMap<String, Tensor>, t: &HashMap<String, Tensor>) -> Tensor {
    let adapted = |h: &Tensor, m: &str| {
        let plain = lin(
            h,
            &base[&format!("{m}.weight")],
            Some(&base[&format!("{m}.bias")]),
        );
        let down = lin(h, &t[&format!("{m}.lora_A.weight")], None);
        let up = lin(&down, &t[&format!("{m}.lora_B.weight")], None);
        (plain + (up * SCALE).unwrap()).unwrap()
    };
    let mut h = x.clone();
    for b in 0..SMALL.blocks {
        let u = adapted(&h, &format!("blocks.{b}.fc1")).tanh().unwrap();
        h = (&h + adapted(&u, &format!("blocks.{b}.fc2"))).unwrap();
    }
    lin(&h, &t["head.weight"], Some(&t["head.bias"]))
}

/// The names and shapes of what trains.
fn trained_shapes() -> Vec<(String, Vec<usize>)> {
    let (d, h) = (SMALL.d, SMALL.h);
    let mut v = vec![
        ("head.weight".to_string(), vec![1, d]),
        ("head.bias".to_string(), vec![1]),
    ];
    for b in 0..SMALL.blocks {
        v.push((format!("blocks.{b}.fc1.lora_A.weight"), vec![4, d]));
        v.push((format!("blocks.{b}.fc1.lora_B.weight"), vec![h, 4]));
        v.push((format!("blocks.{b}.fc2.lora_A.weight"), vec![4, h]));
        v.push((format!("blocks.{b}.fc2.lora_B.weight"), vec![d, 4]));
    }
    v.sort();
    v
}

/// Plain candle: `world · ACCUM` micro-batches a step, their mean gradient clipped over the
/// trained gradients, candle-nn's AdamW.
fn reference(world: usize) -> BTreeMap<String, Vec<f32>> {
    reference_over(&[world; STEPS])
}

/// [`reference`] with step `s` taken on `worlds[s]` processes (a resume on another number):
/// rank r's j-th micro-batch is batch `r + W·j`, so step s reads batches `s·W·A .. (s+1)·W·A`.
fn reference_over(worlds: &[usize]) -> BTreeMap<String, Vec<f32>> {
    let base = base_tensors(SMALL);
    let names = trained_shapes();
    let vars: Vec<Var> = names
        .iter()
        .map(|(n, s)| Var::from_tensor(&start_value(n, s)).unwrap())
        .collect();
    let params = ParamsAdamW {
        lr: 0.02,
        ..Default::default()
    };
    let mut opt = candle_nn::AdamW::new(vars.clone(), params).unwrap();
    for (step, &world) in worlds.iter().enumerate() {
        let n = world * ACCUM;
        let t: HashMap<String, Tensor> = names
            .iter()
            .zip(&vars)
            .map(|((k, _), v)| (k.clone(), v.as_tensor().clone()))
            .collect();
        let losses = (step * n..(step + 1) * n).map(|j| {
            let (x, y) = batch(j, SMALL.d);
            (candle_nn::loss::mse(&forward(&x, &base, &t), &y).unwrap() / n as f64).unwrap()
        });
        let norm = clipped_window_step(&mut opt, &vars, losses, CLIP);
        assert!(norm > CLIP, "the reference must clip (norm {norm})");
    }
    names
        .iter()
        .zip(&vars)
        .map(|((k, _), v)| (k.clone(), flat(v.as_tensor())))
        .collect()
}

/// Runs the subject on `n` processes over `dir/base` (written first if missing), its reports in
/// `dir/{out}`; returns every rank's report.
fn run_in(dir: &Path, n: usize, out: &str, args: &[&str]) -> Vec<serde_json::Value> {
    let base = dir.join("base");
    if !base.is_dir() {
        write_base(&base, SMALL);
    }
    let out = dir.join(out);
    let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    all.push(format!("base={}", base.display()));
    all.push(format!("out={}", out.display()));
    all.push(format!("steps={STEPS}"));
    all.push(format!("accum={ACCUM}"));
    all.push(format!("clip={CLIP}"));
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    let o = launch(n, &common::example_bin("finetune_check"), &refs, &[]);
    let (so, se) = text(&o);
    assert!(o.status.success(), "{args:?} on {n}: failed\n{so}\n{se}");
    (0..n)
        .map(|r| {
            let b = std::fs::read(out.join(format!("rank{r}.json"))).expect("a rank's report");
            serde_json::from_slice(&b).expect("JSON")
        })
        .collect()
}

/// Runs the subject on `n` processes in a scratch folder of its own; returns every rank's report.
fn run(n: usize, args: &[&str], tag: &str) -> Vec<serde_json::Value> {
    let dir = scratch(tag);
    let reports = run_in(&dir, n, "out", args);
    let _ = std::fs::remove_dir_all(&dir);
    reports
}

fn params(report: &serde_json::Value) -> BTreeMap<String, Vec<f32>> {
    serde_json::from_value(report["params"].clone()).unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The bytes the trained gradients take in f32.
fn trained_bytes() -> u64 {
    trained_shapes()
        .iter()
        .map(|(_, s)| 4 * s.iter().product::<usize>() as u64)
        .sum()
}

#[test]
fn a_lora_fine_tune_over_a_constant_base_matches_plain_candle_on_1_2_and_3_processes() {
    for world in [1, 2, 3] {
        let want = reference(world);
        let reports = run(world, &["layout=constant"], &format!("ft-const-{world}"));
        for (rank, r) in reports.iter().enumerate() {
            let got = params(r);
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>(),
                "rank {rank} of {world}: only the adapters and the head are variables"
            );
            for (k, v) in &want {
                let d = max_diff(&got[k], v);
                assert!(
                    d <= 1e-6,
                    "{world} process(es), rank {rank}: `{k}` is {d} away"
                );
            }
            assert_eq!(
                r["frozen"],
                serde_json::json!([]),
                "nothing frozen: constants"
            );
            assert_eq!(r["adapted"].as_array().unwrap().len(), 2 * SMALL.blocks);
            // A window's end moves the trained gradients and a few bytes of agreement; the
            // micro-steps inside it move nothing.
            let bytes: Vec<u64> = serde_json::from_value(r["bytes"].clone()).unwrap();
            if world > 1 {
                for (j, b) in bytes.iter().enumerate() {
                    if j % ACCUM + 1 < ACCUM {
                        assert_eq!(*b, 0, "micro-step {j} communicated");
                    } else {
                        assert!(
                            *b >= trained_bytes() && *b < trained_bytes() + 1024,
                            "step {j}: {b} bytes for {} bytes of trained gradients",
                            trained_bytes()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_lora_fine_tune_trains_alike_under_zero_1_and_2() {
    for world in [2, 3] {
        let want = reference(world);
        for stage in ["sharding=optimizer", "sharding=gradients"] {
            let reports = run(
                world,
                &["layout=constant", stage],
                &format!("ft-zero-{world}"),
            );
            for (rank, r) in reports.iter().enumerate() {
                let got = params(r);
                for (k, v) in &want {
                    let d = max_diff(&got[k], v);
                    assert!(
                        d <= 1e-6,
                        "{stage} on {world}, rank {rank}: `{k}` is {d} away"
                    );
                }
            }
        }
    }
}

#[test]
fn a_subset_optimizer_over_one_varmap_trains_like_the_constant_base_and_syncs_only_what_trains() {
    let constant = run(2, &["layout=constant"], "ft-cmp-const");
    let subset = run(2, &["layout=subset"], "ft-cmp-subset");
    let base = base_tensors(SMALL);
    for rank in 0..2 {
        let (c, s) = (params(&constant[rank]), params(&subset[rank]));
        for (k, v) in &c {
            let d = max_diff(&s[k], v);
            assert!(
                d <= 1e-6,
                "rank {rank}: `{k}` differs by {d} between the layouts"
            );
        }
        // The base's weights are variables here, held by no optimizer: frozen, bit for bit.
        for (k, t) in &base {
            assert_eq!(s[k], flat(t), "rank {rank}: the frozen `{k}` changed");
        }
        let frozen: Vec<String> = serde_json::from_value(subset[rank]["frozen"].clone()).unwrap();
        let mut names: Vec<&String> = base.keys().collect();
        names.sort();
        assert_eq!(frozen.iter().collect::<Vec<_>>(), names);
        assert_eq!(
            constant[rank]["bytes"], subset[rank]["bytes"],
            "rank {rank}: the frozen variables moved bytes"
        );
        // Nor at prepare: the trained weights are broadcast, the frozen ones show a checksum.
        let checksums = 4 * base.len() as u64;
        assert_eq!(
            subset[rank]["prepare_bytes"].as_u64().unwrap(),
            trained_bytes() + checksums,
            "rank {rank}: preparing moved the frozen weights"
        );
    }
}

#[test]
fn a_bf16_fine_tune_trains_alike_in_both_layouts_and_near_the_f32_reference() {
    let want = reference(2);
    let constant = run(2, &["layout=constant", "precision=bf16"], "ft-bf16-c");
    let subset = run(2, &["layout=subset", "precision=bf16"], "ft-bf16-s");
    let c0 = params(&constant[0]);
    for k in want.keys() {
        let d = max_diff(&params(&subset[0])[k], &c0[k]);
        assert!(d <= 1e-6, "`{k}` differs by {d} between the bf16 layouts");
    }
    assert_eq!(params(&constant[1]), c0, "the ranks' masters differ");
    // Only what trains has an f32 master, in both layouts.
    for r in constant.iter().chain(&subset) {
        assert_eq!(
            r["masters"].as_u64().unwrap(),
            trained_bytes(),
            "f32 masters held"
        );
    }
    // Adam moves a weight whose gradient is tiny by about ±lr either way, so bf16's rounding
    // shows in single weights; the whole update stays close to f32's.
    let (mut err, mut norm) = (0.0f64, 0.0f64);
    for (k, v) in &want {
        for (a, b) in c0[k].iter().zip(v) {
            err += ((a - b) as f64).powi(2);
            norm += (*b as f64).powi(2);
        }
    }
    let rel = (err / norm).sqrt();
    assert!(
        rel <= 0.02,
        "bf16 ends {rel} (relative) from the f32 reference"
    );
}

#[test]
fn a_fine_tune_resumes_exactly_on_the_same_and_another_number_of_processes_and_refuses_a_changed_base(
) {
    let dir = scratch("ft-resume");
    let whole = run_in(&dir, 2, "whole", &[]);
    let ckpt = dir.join("ckpt");
    let save = format!("save={}", ckpt.display());
    run_in(&dir, 2, "first", &[&save, "save_after=1"]);
    let resume = format!("resume={}", ckpt.display());
    let same = run_in(&dir, 2, "same", &[&resume, "resume_at=1"]);
    for rank in 0..2 {
        assert_eq!(
            params(&same[rank]),
            params(&whole[rank]),
            "rank {rank}: resumed on 2"
        );
    }
    let want = reference_over(&[2, 3, 3]);
    for (rank, r) in run_in(&dir, 3, "three", &[&resume, "resume_at=1"])
        .iter()
        .enumerate()
    {
        let got = params(r);
        for (k, v) in &want {
            let d = max_diff(&got[k], v);
            assert!(d <= 1e-6, "resumed on 3, rank {rank}: `{k}` is {d} away");
        }
    }
    // The base changed since the save: refused, naming the file.
    let mut changed = base_tensors(SMALL);
    let w = changed["blocks.0.fc1.weight"].clone();
    changed.insert("blocks.0.fc1.weight".into(), (w * 1.01).unwrap());
    candle_core::safetensors::save(&changed, dir.join("base/model.safetensors")).unwrap();
    let refs = [
        format!("base={}", dir.join("base").display()),
        format!("out={}", dir.join("changed").display()),
        resume,
        "resume_at=1".to_string(),
    ];
    let refs: Vec<&str> = refs.iter().map(String::as_str).collect();
    let o = launch(2, &common::example_bin("finetune_check"), &refs, &[]);
    let (so, se) = text(&o);
    assert!(
        !o.status.success(),
        "resumed over a changed base\n{so}\n{se}"
    );
    assert!(
        se.contains("`model.safetensors`") && se.contains("pretrained weights changed"),
        "{se}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The merged model's output, with plain linears over the merged folder's weights.
fn merged_forward(x: &Tensor, m: &HashMap<String, Tensor>) -> Tensor {
    let mut h = x.clone();
    for b in 0..SMALL.blocks {
        let p = |l: &str, w: &str| m[&format!("blocks.{b}.{l}.{w}")].clone();
        let u = lin(&h, &p("fc1", "weight"), Some(&p("fc1", "bias")))
            .tanh()
            .unwrap();
        h = (&h + lin(&u, &p("fc2", "weight"), Some(&p("fc2", "bias")))).unwrap();
    }
    lin(&h, &m["head.weight"], Some(&m["head.bias"]))
}

#[test]
fn the_adapter_is_saved_in_peft_layout_and_merge_weights_folds_it_into_the_base() {
    let dir = scratch("ft-peft");
    let base_dir = dir.join("base");
    write_base(&base_dir, SMALL);
    let adapter = dir.join("adapter");
    let args = [
        format!("base={}", base_dir.display()),
        format!("out={}", dir.join("out").display()),
        format!("adapter_out={}", adapter.display()),
    ];
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = launch(2, &common::example_bin("finetune_check"), &refs, &[]);
    assert!(o.status.success(), "{:?}", text(&o));
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("out/rank0.json")).unwrap()).unwrap();
    let trained = params(&report);

    // PEFT's layout: the trained tensors under `base_model.model.`, and the settings.
    let saved =
        candle_core::safetensors::load(adapter.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    let mut keys: Vec<&String> = saved.keys().collect();
    keys.sort();
    let want: Vec<String> = trained_shapes()
        .into_iter()
        .map(|(n, _)| format!("base_model.model.{n}"))
        .collect();
    assert_eq!(keys, want.iter().collect::<Vec<_>>());
    for (name, values) in &trained {
        assert_eq!(&flat(&saved[&format!("base_model.model.{name}")]), values);
    }
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(adapter.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 4);
    assert_eq!(config["lora_alpha"], 8);
    assert_eq!(config["modules_to_save"], serde_json::json!(["head"]));
    assert_eq!(
        config["base_model_name_or_path"].as_str(),
        Some(base_dir.to_str().unwrap())
    );
    let mut targets: Vec<String> =
        serde_json::from_value(config["target_modules"].clone()).unwrap();
    targets.sort();
    assert_eq!(
        targets,
        [
            "blocks.0.fc1",
            "blocks.0.fc2",
            "blocks.1.fc1",
            "blocks.1.fc2"
        ]
    );

    // `ivme merge-weights --adapter`, the base found through the adapter's config.
    let merged = dir.join("merged");
    let o = std::process::Command::new(common::ivme_bin())
        .args(["merge-weights", "--adapter"])
        .arg(&adapter)
        .arg(&merged)
        .output()
        .unwrap();
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(
        merged.join("config.json").is_file(),
        "the base's config is copied"
    );
    let m = candle_core::safetensors::load(merged.join("model.safetensors"), &Device::Cpu).unwrap();
    let base = base_tensors(SMALL);
    let t: HashMap<String, Tensor> = trained_shapes()
        .into_iter()
        .map(|(n, s)| {
            let v = Tensor::from_vec(trained[&n].clone(), s, &Device::Cpu).unwrap();
            (n, v)
        })
        .collect();
    for j in 0..4 {
        let (x, _) = batch(100 + j, SMALL.d);
        let d = max_diff(
            &flat(&merged_forward(&x, &m)),
            &flat(&forward(&x, &base, &t)),
        );
        assert!(
            d <= 1e-5,
            "batch {j}: the merged model is {d} away from base + adapters"
        );
    }

    // The adapter loads back into a model built the same way, and computes what it trained.
    let mut acc = single();
    let lora = acc
        .lora(ivme::finetune::LoraConfig::new(4, 8.0, &["fc1", "fc2"]))
        .unwrap();
    let varmap = candle_nn::VarMap::new();
    let b = acc.load_base(&base_dir).unwrap();
    let net = finetune_net::Net::new(acc.base_var_builder(&b, &varmap, DType::F32), &lora, SMALL)
        .unwrap();
    let opt = ivme::optim::AdamW::new(varmap.all_vars(), Default::default());
    acc.prepare_optimizer_of(opt).unwrap();
    let report = acc.load_adapter(&adapter).unwrap();
    assert_eq!(report.loaded.len(), trained.len());
    for (name, var) in acc.named_master_vars() {
        assert_eq!(
            flat(var.as_tensor()),
            trained[&name],
            "`{name}` loaded back"
        );
    }
    let (x, _) = batch(7, SMALL.d);
    let d = max_diff(
        &flat(&candle_core::Module::forward(&net, &x).unwrap()),
        &flat(&forward(&x, &base, &t)),
    );
    assert!(
        d <= 1e-5,
        "the loaded adapter computes {d} away from base + adapters"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn processes_that_opened_different_bases_are_stopped_naming_the_file() {
    let dir = scratch("ft-two-bases");
    let (one, two) = (dir.join("one"), dir.join("two"));
    write_base(&one, SMALL);
    write_base(&two, SMALL);
    let mut changed = base_tensors(SMALL);
    let w = changed["blocks.1.fc2.bias"].clone();
    changed.insert("blocks.1.fc2.bias".into(), (w + 1e-3).unwrap());
    candle_core::safetensors::save(&changed, two.join("model.safetensors")).unwrap();
    let args = [
        format!("base={}", one.display()),
        format!("base_rank1={}", two.display()),
        format!("out={}", dir.join("out").display()),
    ];
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let started = std::time::Instant::now();
    let o = launch(2, &common::example_bin("finetune_check"), &refs, &[]);
    let (so, se) = text(&o);
    assert!(!o.status.success(), "ran on different bases\n{so}\n{se}");
    assert!(
        se.contains("opened different bases")
            && se.contains("`model.safetensors`")
            && se.contains("rank 1"),
        "{se}"
    );
    assert!(
        started.elapsed().as_secs() < 60,
        "took {:?}",
        started.elapsed()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn frozen_weights_that_differ_between_processes_are_refused_at_prepare() {
    let dir = scratch("ft-frozen-differ");
    let args = [
        format!("base={}", dir.join("base").display()),
        format!("out={}", dir.join("out").display()),
        "layout=subset".to_string(),
        "perturb_rank1=1".to_string(),
    ];
    write_base(&dir.join("base"), SMALL);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = launch(2, &common::example_bin("finetune_check"), &refs, &[]);
    let (so, se) = text(&o);
    assert!(
        !o.status.success(),
        "trained over differing frozen weights\n{so}\n{se}"
    );
    assert!(
        se.contains("frozen variable `blocks.0.fc1.weight` holds other values on rank 1"),
        "{se}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// An Accelerator on one CPU process.
fn single() -> ivme::Accelerator {
    ivme::Accelerator::builder().cpu(true).build().unwrap()
}

#[test]
fn bad_fine_tuning_input_is_refused_naming_what_is_wrong() {
    let dir = scratch("ft-bad");
    let base_dir = dir.join("base");
    write_base(&base_dir, SMALL);
    let (d, h) = (SMALL.d, SMALL.h);

    // A LoRA target that matches no module: refused at prepare, naming it and the modules.
    let mut acc = single();
    let lora = acc
        .lora(ivme::finetune::LoraConfig::new(4, 8.0, &["q_proj"]))
        .unwrap();
    let varmap = candle_nn::VarMap::new();
    let base = acc.load_base(&base_dir).unwrap();
    let vb = acc.base_var_builder(&base, &varmap, DType::F32);
    lora.linear(d, h, vb.pp("blocks.0.fc1")).unwrap();
    candle_nn::linear(d, 1, vb.pp("head")).unwrap();
    let opt = ivme::optim::AdamW::new(varmap.all_vars(), Default::default());
    let e = acc.prepare_optimizer_of(opt).unwrap_err().to_string();
    assert!(
        e.contains("`q_proj` matched no module") && e.contains("blocks.0.fc1"),
        "{e}"
    );

    // An unfreeze pattern that matches none of the base's tensors.
    let acc = single();
    let e = acc
        .load_base(&base_dir)
        .unwrap()
        .unfreeze("decoder")
        .unwrap_err()
        .to_string();
    assert!(e.contains("`decoder` matches none"), "{e}");

    // A model whose shapes disagree with the base's.
    let varmap = candle_nn::VarMap::new();
    let base = acc.load_base(&base_dir).unwrap();
    let vb = acc.base_var_builder(&base, &varmap, DType::F32);
    let e = candle_nn::linear(d, h + 1, vb.pp("blocks.0.fc1"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("[{}, {d}]", h + 1)) && e.contains(&format!("[{h}, {d}]")),
        "{e}"
    );

    // A folder without weights.
    let e = acc.load_base(dir.join("nowhere")).unwrap_err().to_string();
    assert!(e.contains("nowhere"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unfrozen_layer_trains_from_the_base_and_the_rest_stays_constant() {
    let dir = scratch("ft-unfreeze");
    let base_dir = dir.join("base");
    write_base(&base_dir, SMALL);
    let mut acc = single();
    let varmap = candle_nn::VarMap::new();
    // A Hugging Face cache's snapshot folder: the weights a link to a blob elsewhere.
    let linked = dir.join("snapshot");
    std::fs::create_dir_all(&linked).unwrap();
    let blob = base_dir.join("model.safetensors");
    std::os::unix::fs::symlink(blob, linked.join("model.safetensors")).unwrap();
    let base = acc
        .load_base(&linked)
        .unwrap()
        .unfreeze("blocks.1.fc2")
        .unwrap();
    let vb = acc.base_var_builder(&base, &varmap, DType::F32);
    let fc2 = candle_nn::linear(SMALL.h, SMALL.d, vb.pp("blocks.1.fc2")).unwrap();
    let fc1 = candle_nn::linear(SMALL.d, SMALL.h, vb.pp("blocks.1.fc1")).unwrap();
    let mut names: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
    names.sort();
    assert_eq!(names, ["blocks.1.fc2.bias", "blocks.1.fc2.weight"]);
    let want = base_tensors(SMALL);
    assert_eq!(flat(fc2.weight()), flat(&want["blocks.1.fc2.weight"]));
    assert_eq!(flat(fc1.weight()), flat(&want["blocks.1.fc1.weight"]));
    let opt = ivme::optim::AdamW::new(varmap.all_vars(), Default::default());
    let mut opt = acc.prepare_optimizer_of(opt).unwrap();
    let (x, _) = batch(0, SMALL.h);
    let loss = candle_nn::Module::forward(&fc2, &x)
        .unwrap()
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap();
    let grads = acc.backward(&loss).unwrap();
    opt.step(&grads).unwrap();
    assert_ne!(
        flat(fc2.weight()),
        flat(&want["blocks.1.fc2.weight"]),
        "it trains"
    );
    assert_eq!(acc.trained_names(), names);
    let _ = std::fs::remove_dir_all(&dir);
}
