//! The llama example (`models/examples/llama_tiny.rs`) on 2 real processes in bf16: it learns,
//! and a run stopped mid-epoch and started again ends with exactly the weights of a run that
//! was never stopped.

#[path = "../../tests/common/mod.rs"]
mod common;

use candle_core::{DType, Device, Tensor};
use common::{example_bin, launch, text, Scratch};
use std::collections::HashMap;
use std::path::Path;

fn run(args: &[String]) -> String {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = launch(2, &example_bin("llama_tiny"), &args, &[]);
    let (stdout, stderr) = text(&o);
    assert!(
        o.status.success(),
        "llama_tiny {args:?} failed\n{stdout}\n{stderr}"
    );
    stdout
}

fn weights(dir: &Path, rank: usize) -> HashMap<String, Vec<f32>> {
    let path = dir.join(format!("rank{rank}.safetensors"));
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .into_iter()
        .map(|(k, t): (String, Tensor)| {
            assert_eq!(t.dtype(), DType::BF16, "{k}: the model computes in bf16");
            let v = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            (k, v.to_vec1().unwrap())
        })
        .collect()
}

fn eval_losses(stdout: &str) -> Vec<f32> {
    stdout
        .lines()
        .filter_map(|l| l.split("eval loss ").nth(1))
        .map(|rest| rest.split(',').next().unwrap().trim().parse().unwrap())
        .collect()
}

#[test]
fn stopped_and_resumed_in_bf16_it_ends_where_an_unstopped_run_does() {
    let whole = Scratch::new("llama-whole");
    let parts = Scratch::new("llama-parts");
    let arg = |k: &str, p: &Path| format!("{k}={}", p.display());
    let epochs = "epochs=3".to_string();

    let out = run(&[
        arg("project", &whole.0.join("run")),
        arg("out", &whole.0.join("out")),
        epochs.clone(),
    ]);
    let losses = eval_losses(&out);
    assert_eq!(losses.len(), 3, "one eval per epoch:\n{out}");
    assert!(
        losses[2] < losses[0] && losses[0] < (256f32).ln(),
        "the eval loss should fall below a uniform guess's: {losses:?}"
    );

    // Stop after 5 optimizer steps, in the first epoch (8 steps an epoch), then resume.
    let project = arg("project", &parts.0.join("run"));
    let first = run(&[project.clone(), epochs.clone(), "stop_after=5".into()]);
    assert!(first.contains("stopping after 5 steps"), "{first}");
    let second = run(&[project, arg("out", &parts.0.join("out")), epochs]);
    assert!(second.contains("resumed from"), "{second}");

    let (a, b) = (whole.0.join("out"), parts.0.join("out"));
    let reference = weights(&a, 0);
    same(&weights(&a, 1), &reference, "rank 1 of the unstopped run");
    same(&weights(&b, 0), &reference, "rank 0 of the resumed run");
    same(&weights(&b, 1), &reference, "rank 1 of the resumed run");
}

/// Asserts `got` equals `want` bit for bit, naming the first variable that differs.
fn same(got: &HashMap<String, Vec<f32>>, want: &HashMap<String, Vec<f32>>, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: different variables");
    let mut names: Vec<&String> = want.keys().collect();
    names.sort();
    for name in names {
        let (g, w) = (&got[name], &want[name]);
        let differ = g
            .iter()
            .zip(w)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ,
            0,
            "{what}: {differ} of {} values of `{name}` differ from the unstopped run's rank 0",
            w.len()
        );
    }
}
