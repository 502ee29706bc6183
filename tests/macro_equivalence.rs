//! The loop under `#[accelerate]`, the same loop written by hand against the runtime, and
//! plain candle doing the same maths end with the same weights (f32; 1 and 2 processes; with
//! and without accumulation).

mod common;
mod reference;

use candle_nn::SGD;
use std::collections::BTreeMap;

fn run(n: usize, mode: &str, accum: usize, steps: usize) -> Vec<BTreeMap<String, Vec<f32>>> {
    let args = [
        format!("mode={mode}"),
        format!("accum={accum}"),
        format!("steps={steps}"),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let tag = format!("macro-{mode}-{n}-{accum}");
    common::reports(n, "macro_check", &args, &tag)
        .iter()
        .map(common::params)
        .collect()
}

#[test]
fn macro_hand_written_and_plain_candle_agree() {
    // 8 batches of 4 consecutive samples.
    let order: Vec<usize> = (0..32).collect();
    for (procs, accum) in [(1usize, 1usize), (1, 2), (2, 1), (2, 2)] {
        let per_step = 4 * procs * accum;
        let expected =
            reference::train::<SGD>(32, &reference::chunks(&order, per_step, 32 / per_step), 0.1);
        let by_macro = run(procs, "macro", accum, 8);
        let by_hand = run(procs, "hand", accum, 8);
        // `for (i, (x, y)) in batches.iter().enumerate()` is sharded like the `Vec` itself.
        let enumerated = (accum == 1).then(|| run(procs, "macro_enumerate", accum, 8));
        for r in 0..procs {
            assert_eq!(
                by_macro[r], by_hand[r],
                "{procs} procs, accum {accum}: macro and hand differ on rank {r}"
            );
            if let Some(e) = &enumerated {
                assert_eq!(
                    e[r], by_hand[r],
                    "{procs} procs: the enumerate loop and hand differ on rank {r}"
                );
            }
            let d = reference::max_diff(&by_macro[r], &expected);
            assert!(
                d <= 1e-6,
                "{procs} procs, accum {accum}: {d} from plain candle"
            );
        }
    }
}

#[test]
fn the_attribute_with_zero_2_trains_like_plain_candle_on_2_and_3_processes() {
    // 12 batches of 4; 2 micro-batches per step on every process.
    let order: Vec<usize> = (0..48).collect();
    for procs in [2usize, 3] {
        let per_step = 4 * procs * 2;
        let expected =
            reference::train::<SGD>(48, &reference::chunks(&order, per_step, 48 / per_step), 0.1);
        let out = common::scratch(&format!("macro-zero2-{procs}"));
        let args = ["mode=macro_zero2", "accum=2", "steps=12"];
        let reports = common::run_reports(procs, "macro_check", &args, &out);
        assert_eq!(reports.len(), procs);
        let mut masters = 0;
        for (r, report) in reports.iter().enumerate() {
            let d = reference::max_diff(&common::params(report), &expected);
            assert!(
                d <= 1e-6,
                "{procs} procs: rank {r} is {d} from plain candle"
            );
            let held: serde_json::Value =
                serde_json::from_slice(&std::fs::read(out.join(format!("held{r}.json"))).unwrap())
                    .unwrap();
            // Sgd without momentum keeps no state. Stage 2 keeps no gradient memory between
            // steps (plain data parallelism keeps its sync buffers), and f32 weights are their
            // own masters, the variables a slice boundary cuts included.
            assert_eq!(
                held["gradients"].as_u64().unwrap(),
                0,
                "{procs} procs: rank {r} keeps gradient memory: not stage 2"
            );
            masters += held["masters"].as_u64().unwrap();
        }
        assert_eq!(
            masters, 0,
            "{procs} procs: bytes of f32 masters beside the f32 weights"
        );
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn a_precision_from_the_launcher_reaches_an_attribute_without_one() {
    // `#[accelerate(grad_accum = 2)]` has no `precision` key: `--mixed_precision fp16` on the
    // command line makes its weights f16, and the attribute must still cast the batch.
    let out = common::scratch("macro-launcher-fp16");
    let out_arg = format!("out={}", out.display());
    let o = std::process::Command::new(common::ivme_bin())
        .args([
            "launch",
            "--num_processes",
            "2",
            "--cpu",
            "--mixed_precision",
            "fp16",
        ])
        .arg(common::example_bin("macro_check"))
        .args(["mode=macro", "accum=2", "steps=8", &out_arg])
        .output()
        .expect("running ivme launch");
    let (_, stderr) = common::text(&o);
    assert!(
        o.status.success(),
        "fp16 from the launcher failed:\n{stderr}"
    );
    let read = |r: usize| -> BTreeMap<String, Vec<f32>> {
        let bytes = std::fs::read(out.join(format!("rank{r}.json"))).expect("a report");
        common::params(&serde_json::from_slice(&bytes).expect("JSON"))
    };
    let (a, b) = (read(0), read(1));
    let _ = std::fs::remove_dir_all(&out);
    assert_eq!(a, b, "the ranks differ");
    assert!(
        a.values().flatten().all(|v| v.is_finite()),
        "non-finite weights: {a:?}"
    );
    // f16 weights, f32 masters, a loss scale that may skip the first step on overflow: the
    // same training as the f32 run, not its numbers.
    let f32_run = &run(2, "macro", 2, 8)[0];
    let d = reference::max_diff(&a, f32_run);
    assert!(d > 0.0 && d <= 0.25, "{d} from the f32 run");
}
