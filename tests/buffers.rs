//! Buffers (BatchNorm's running statistics) on real processes, against plain candle: the conv
//! net of examples/support/cnn.rs (with dropout, each rank its own masks) trained on 2 and 3
//! ranks, without sharding and under ZeRO
//! stages 1 and 2, in each `buffers` mode. The reference simulates the ranks in one process:
//! each rank's micro-batches through its own copy of the statistics, gradients summed and
//! averaged, candle-nn's AdamW, and the statistics taken as the mode says at every step.

mod common;

#[path = "../examples/support/cnn.rs"]
mod cnn;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, ModuleT, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use ivme::rng::{mix, Rng};
use ivme::stateful::Shared;
use serde_json::Value;
use std::collections::BTreeMap;

type Values = BTreeMap<String, Vec<f32>>;

const BATCH: usize = 4;
const ACCUM: usize = 2;
const STEPS: usize = 8; // micro-steps: 4 optimizer steps
const LR: f64 = 0.01;
const DROPOUT: f32 = 0.2;
/// The seed of the subject's `set_seed(SEED, true)`: rank r's masks come from stream r.
const SEED: u64 = 7;

fn is_statistic(name: &str) -> bool {
    name.ends_with("running_mean") || name.ends_with("running_var")
}

fn statistics(v: &Values) -> Values {
    v.iter()
        .filter(|(k, _)| is_statistic(k))
        .map(|(k, x)| (k.clone(), x.clone()))
        .collect()
}

fn set_statistics(varmap: &VarMap, values: &Values) {
    let data = varmap.data().lock().unwrap();
    for (k, x) in values {
        let var = &data[k];
        var.set(&Tensor::from_vec(x.clone(), var.shape(), &Device::Cpu).unwrap())
            .unwrap();
    }
}

/// Plain candle simulating `world` ranks: per rank its own statistics, per step the mean
/// gradient of every rank's micro-batches, the statistics taken as `mode` says. Returns the
/// final variables and the eval-mode outputs on the samples the subject evaluates.
fn reference(world: usize, mode: &str) -> (Values, Vec<f32>) {
    let varmap = VarMap::new();
    // One model for every simulated rank; each rank's dropout generator is swapped in.
    let masks = Shared::new(Rng::new(0));
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = cnn::Cnn::new(vb, Some((DROPOUT, masks.clone()))).unwrap();
    let mut streams: Vec<_> = (0..world)
        .map(|r| Rng::new(mix(SEED, r as u64)).state())
        .collect();
    cnn::init(&varmap, 1).unwrap(); // rank 0's weights
    let params = ParamsAdamW {
        lr: LR,
        ..Default::default()
    };
    let mut opt = AdamW::new(varmap.all_vars(), params).unwrap();
    for step in 0..STEPS / ACCUM {
        let start = statistics(&cnn::values(&varmap).unwrap());
        let mut ends = Vec::new();
        let mut total: Option<GradStore> = None;
        for (r, stream) in streams.iter_mut().enumerate() {
            set_statistics(&varmap, &start);
            *masks.lock() = Rng::from_state(*stream);
            let mut mine: Option<GradStore> = None;
            for j in 0..ACCUM {
                let k = step * ACCUM + j;
                let (x, y) = cnn::images((k * world + r) * BATCH, BATCH).unwrap();
                let out = model.forward_t(&x, true).unwrap();
                let loss = (candle_nn::loss::mse(&out, &y).unwrap() / ACCUM as f64).unwrap();
                let g = loss.backward().unwrap();
                mine = Some(add(mine, g, &varmap));
            }
            *stream = masks.lock().state();
            ends.push(statistics(&cnn::values(&varmap).unwrap()));
            total = Some(add(total, mine.unwrap(), &varmap));
        }
        let mut total = total.unwrap();
        for v in varmap.all_vars() {
            if let Some(g) = total.remove(v.as_tensor()) {
                total.insert(v.as_tensor(), (g / world as f64).unwrap());
            }
        }
        let agreed = match mode {
            "broadcast" => ends[0].clone(),
            "average" => ends[0]
                .keys()
                .map(|k| {
                    let sum = ends
                        .iter()
                        .map(|e| Tensor::new(e[k].as_slice(), &Device::Cpu).unwrap())
                        .reduce(|a, b| (a + b).unwrap())
                        .unwrap();
                    let mean = (sum / world as f64).unwrap();
                    (k.clone(), mean.to_vec1::<f32>().unwrap())
                })
                .collect(),
            _ => unreachable!("local is compared rank by rank"),
        };
        set_statistics(&varmap, &agreed);
        opt.step(&total).unwrap();
    }
    let (x, _) = cnn::images(10_000, 6).unwrap();
    let eval = model.forward_t(&x, false).unwrap();
    (
        cnn::values(&varmap).unwrap(),
        eval.flatten_all().unwrap().to_vec1().unwrap(),
    )
}

/// `a + b`, gradient by gradient, over the variables of `varmap`.
fn add(a: Option<GradStore>, b: GradStore, varmap: &VarMap) -> GradStore {
    let Some(mut a) = a else { return b };
    for v in varmap.all_vars() {
        if let Some(gb) = b.get(v.as_tensor()) {
            let sum = match a.remove(v.as_tensor()) {
                Some(ga) => (ga + gb).unwrap(),
                None => gb.clone(),
            };
            a.insert(v.as_tensor(), sum);
        }
    }
    a
}

fn values(report: &Value) -> Values {
    serde_json::from_value(report["params"].clone()).expect("a report has params")
}

fn eval(report: &Value) -> Vec<f32> {
    serde_json::from_value(report["eval"].clone()).expect("a report has eval outputs")
}

fn run(n: usize, extra: &[&str], tag: &str) -> Vec<Value> {
    let steps = format!("steps={STEPS}");
    let batch = format!("batch={BATCH}");
    let accum = format!("accum={ACCUM}");
    let lr = format!("lr={LR}");
    let dropout = format!("dropout={DROPOUT}");
    let mut args = vec![
        steps.as_str(),
        batch.as_str(),
        accum.as_str(),
        lr.as_str(),
        dropout.as_str(),
    ];
    args.extend_from_slice(extra);
    common::reports(n, "bn_harness", &args, tag)
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Every rank ends bit-identical (statistics included), its statistics moved away from their
/// initial values, and its variables and eval outputs equal the reference's.
fn check(reports: &[Value], mode: &str, world: usize, what: &str) {
    for r in &reports[1..] {
        assert_eq!(values(r), values(&reports[0]), "{what}: ranks differ");
        assert_eq!(
            eval(r),
            eval(&reports[0]),
            "{what}: ranks evaluate differently"
        );
    }
    let ours = values(&reports[0]);
    let names: Vec<String> = serde_json::from_value(reports[0]["buffers"].clone()).unwrap();
    assert_eq!(
        names,
        vec![
            "bn1.running_mean",
            "bn1.running_var",
            "bn2.running_mean",
            "bn2.running_var"
        ],
        "{what}: the buffers found"
    );
    let var = &ours["bn1.running_var"];
    assert!(
        var.iter().all(|v| (v - 1.0).abs() > 1e-3),
        "{what}: running_var still at its initial 1: {var:?}"
    );
    let (expected, expected_eval) = reference(world, mode);
    let far: Vec<String> = ours
        .iter()
        .map(|(k, x)| (k, max_abs(x, &expected[k])))
        .filter(|(_, d)| *d > 2e-5)
        .map(|(k, d)| format!("`{k}` {d}"))
        .collect();
    assert!(far.is_empty(), "{what}: away from plain candle: {far:?}");
    let d = max_abs(&eval(&reports[0]), &expected_eval);
    assert!(d <= 1e-4, "{what}: eval outputs {d} away from plain candle");
}

#[test]
fn batch_norm_statistics_agree_with_plain_candle_under_every_stage() {
    for stage in ["no", "optimizer", "gradients", "parameters"] {
        for mode in ["broadcast", "average"] {
            let what = format!("sharding {stage}, buffers {mode}, 2 ranks");
            let reports = run(
                2,
                &[&format!("sharding={stage}"), &format!("buffers={mode}")],
                &format!("bn-{stage}-{mode}"),
            );
            check(&reports, mode, 2, &what);
        }
    }
}

#[test]
fn three_ranks_agree_on_their_statistics_under_stages_two_and_three_and_without_sharding() {
    for stage in ["no", "gradients", "parameters"] {
        for mode in ["broadcast", "average"] {
            let what = format!("sharding {stage}, buffers {mode}, 3 ranks");
            let reports = run(
                3,
                &[&format!("sharding={stage}"), &format!("buffers={mode}")],
                &format!("bn3-{stage}-{mode}"),
            );
            check(&reports, mode, 3, &what);
        }
    }
}

#[test]
fn an_undeclared_buffer_is_found_at_the_first_step_and_kept_equal() {
    for stage in ["no", "gradients"] {
        let out = common::scratch(&format!("bn-ema-{stage}"));
        let out_arg = format!("out={}", out.display());
        let sharding = format!("sharding={stage}");
        let args = [
            "steps=8", "batch=4", "accum=2", "lr=0.01", "ema=1", &sharding, &out_arg,
        ];
        let o = common::launch(2, &common::example_bin("bn_harness"), &args, &[]);
        let (_, stderr) = common::text(&o);
        assert!(o.status.success(), "{stage}: {stderr}");
        assert!(
            stderr.contains("ema.seen received no gradient but changed in the forward"),
            "{stage}: no warning naming the variable: {stderr}"
        );
        let read = |r: usize| -> Value {
            serde_json::from_slice(&std::fs::read(out.join(format!("rank{r}.json"))).unwrap())
                .unwrap()
        };
        let (a, b) = (values(&read(0)), values(&read(1)));
        let _ = std::fs::remove_dir_all(&out);
        assert_eq!(
            a["ema.seen"], b["ema.seen"],
            "{stage}: the ranks' averages differ"
        );
        // Plain candle: each window starts from rank 0's value and applies rank 0's inputs.
        let mut ema = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
        for k in 0..STEPS {
            let (x, _) = cnn::images(k * 2 * BATCH, BATCH).unwrap();
            ema = cnn::ema_step(&ema, &x).unwrap();
        }
        assert_eq!(
            a["ema.seen"],
            ema.to_vec1::<f32>().unwrap(),
            "{stage}: not rank 0's average"
        );
    }
}

#[test]
fn local_buffers_differ_by_rank_and_the_weights_still_agree() {
    // A sharded checkpoint holds one value per buffer: local buffers are refused there.
    let o = common::launch(
        2,
        &common::example_bin("bn_harness"),
        &["buffers=local", "sharding=gradients"],
        &[],
    );
    let (_, stderr) = common::text(&o);
    assert!(
        !o.status.success(),
        "local buffers with sharding must be refused"
    );
    assert!(
        stderr.contains("use buffers = broadcast or average under sharding"),
        "{stderr}"
    );
    let reports = run(2, &["buffers=local"], "bn-local");
    let (a, b) = (values(&reports[0]), values(&reports[1]));
    for (k, x) in &a {
        if is_statistic(k) {
            assert_ne!(
                x, &b[k],
                "`{k}`: local statistics should be each rank's own"
            );
        } else {
            assert_eq!(x, &b[k], "`{k}`: the weights must agree");
        }
    }
    // The weights do not depend on the statistics in training mode.
    let (expected, _) = reference(2, "broadcast");
    for (k, x) in a.iter().filter(|(k, _)| !is_statistic(k)) {
        let d = max_abs(x, &expected[k]);
        assert!(d <= 2e-5, "`{k}` is {d} away from plain candle");
    }
}

#[test]
fn a_resume_continues_bit_for_bit_and_the_saved_model_evaluates_as_the_reference() {
    let cases = [
        ("no", "broadcast"),
        ("gradients", "average"),
        ("parameters", "average"),
    ];
    for (stage, mode) in cases {
        let scratch = common::Scratch::new(&format!("bn-resume-{stage}"));
        let dir = scratch.0.join("ckpt");
        let model = scratch.0.join("model");
        let save = [
            format!("sharding={stage}"),
            format!("buffers={mode}"),
            "save_at=4".into(),
            format!("dir={}", dir.display()),
            format!("model_out={}", model.display()),
        ];
        let save: Vec<&str> = save.iter().map(String::as_str).collect();
        let whole = run(2, &save, &format!("bn-whole-{stage}"));
        let resume = [
            format!("sharding={stage}"),
            format!("buffers={mode}"),
            format!("resume={}", dir.display()),
        ];
        let resume: Vec<&str> = resume.iter().map(String::as_str).collect();
        let resumed = run(2, &resume, &format!("bn-resumed-{stage}"));
        for (w, r) in whole.iter().zip(&resumed) {
            assert_eq!(
                values(w),
                values(r),
                "{stage}/{mode}: the resume is not the run"
            );
        }
        // The saved model in plain candle: eval mode reads the saved statistics.
        let mut varmap = VarMap::new();
        let net = cnn::Cnn::new(
            VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
            None,
        )
        .unwrap();
        let file = model.join("model.safetensors");
        varmap.load(&file).unwrap();
        let (x, _) = cnn::images(10_000, 6).unwrap();
        let out: Vec<f32> = net
            .forward_t(&x, false)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let (_, expected) = reference(2, mode);
        let d = max_abs(&out, &expected);
        assert!(
            d <= 1e-4,
            "{stage}/{mode}: the saved model evaluates {d} away"
        );
        assert_eq!(
            out,
            eval(&whole[0]),
            "{stage}/{mode}: the saved model is not the trained one"
        );
    }
}

#[test]
fn fp16_trains_batch_norm_with_f32_statistics_on_every_stage() {
    // fp16, since candle 0.11's CPU conv2d has no bf16 kernel.
    for stage in ["no", "gradients"] {
        let reports = run(
            2,
            &["precision=fp16", &format!("sharding={stage}")],
            &format!("bn-fp16-{stage}"),
        );
        assert_eq!(
            values(&reports[0]),
            values(&reports[1]),
            "fp16 {stage}: ranks differ"
        );
        let ours = values(&reports[0]);
        for (k, x) in statistics(&ours) {
            assert!(
                x.iter().all(|v| v.is_finite()),
                "fp16 {stage}: `{k}` is not finite"
            );
            // Trained, not reset: every statistic moved away from its initial 0 or 1.
            let initial = if k.ends_with("running_var") { 1.0 } else { 0.0 };
            assert!(
                x.iter().all(|v| (v - initial).abs() > 1e-4),
                "fp16 {stage}: `{k}` is still at its initial value: {x:?}"
            );
        }
    }
}
