//! A loop over a plain `Vec` of batches under `#[accelerate]` resumes mid-epoch exactly:
//! stopped after K optimizer steps and started again, it trains only the remaining batches and
//! ends with the weights of a run that never stopped, bit for bit (1 and 2 processes).

mod common;

use common::{run_reports, Scratch};

#[test]
fn a_macro_loop_over_a_vec_resumes_where_it_stopped() {
    // 10 batches, 3 epochs: 30 steps on 1 process, 15 per rank on 2.
    for (n, total) in [(1usize, 30usize), (2, 15)] {
        // Mid-epoch, and at the end of the first epoch (the next pass must start afresh).
        for stop_at in [7usize, total / 3] {
            let dir = Scratch::new(&format!("macro-resume-{n}-{stop_at}"));
            let project = |name: &str| format!("project={}", dir.0.join(name).display());
            let full = run_reports(
                n,
                "macro_resume",
                &[&project("full")],
                &dir.0.join("full_out"),
            );
            let stop = format!("stop_at={stop_at}");
            let part_out = dir.0.join("part_out");
            let first = run_reports(n, "macro_resume", &[&project("part"), &stop], &part_out);
            let resumed = run_reports(n, "macro_resume", &[&project("part")], &part_out);
            assert_eq!((full.len(), first.len(), resumed.len()), (n, n, n));
            for r in 0..n {
                assert_eq!(full[r]["trained"], total, "{n} procs: the full run");
                assert_eq!(first[r]["trained"], stop_at, "{n} procs: the stopped run");
                assert_eq!(
                    resumed[r]["trained"],
                    total - stop_at,
                    "{n} procs, stop at {stop_at}: the resumed run must train only what was left"
                );
                assert_eq!(
                    common::params(&resumed[r]),
                    common::params(&full[r]),
                    "{n} procs, stop at {stop_at}, rank {r}: resumed weights differ"
                );
            }
        }
    }
}

/// Plain candle on one process: the example's model, data and AdamW, one step per group of
/// batch indices (the mean loss over the group's samples, as the ranks' averaged gradients).
fn plain_candle(steps: &[Vec<usize>]) -> std::collections::BTreeMap<String, Vec<f32>> {
    use candle_core::{DType, Device, Module, Tensor};
    use candle_nn::{linear, Optimizer, VarBuilder, VarMap};
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let model = linear(4, 1, VarBuilder::from_varmap(&varmap, DType::F32, &device)).unwrap();
    let mut rng = ivme::rng::Rng::new(3);
    {
        let data = varmap.data().lock().unwrap();
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        for name in names {
            let v = &data[name];
            v.set(&rng.randn(0.0, 0.5, v.shape(), &device).unwrap())
                .unwrap();
        }
    }
    let mut rng = ivme::rng::Rng::new(11);
    let batches: Vec<(Tensor, Tensor)> = (0..10)
        .map(|_| {
            let x = rng.randn(0.0, 1.0, (6, 4), &device).unwrap();
            let y = x.sum_keepdim(1).unwrap();
            (x, y)
        })
        .collect();
    let params = candle_nn::ParamsAdamW {
        lr: 0.05,
        ..Default::default()
    };
    let mut opt = candle_nn::AdamW::new(varmap.all_vars(), params).unwrap();
    for group in steps {
        let x = Tensor::cat(&group.iter().map(|&i| &batches[i].0).collect::<Vec<_>>(), 0).unwrap();
        let y = Tensor::cat(&group.iter().map(|&i| &batches[i].1).collect::<Vec<_>>(), 0).unwrap();
        let loss = candle_nn::loss::mse(&model.forward(&x).unwrap(), &y).unwrap();
        opt.backward_step(&loss).unwrap();
    }
    let data = varmap.data().lock().unwrap();
    data.iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
            )
        })
        .collect()
}

#[test]
fn a_macro_loop_stopped_on_two_processes_resumes_on_one_over_the_batches_left() {
    // Saved without sharding, and under ZeRO stage 2 (set by the launcher's variable).
    for sharding in ["no", "gradients"] {
        moved_to_one(sharding);
    }
}

fn moved_to_one(sharding: &str) {
    let dir = Scratch::new(&format!("macro-resume-moved-{sharding}"));
    let project = format!("project={}", dir.0.join("p").display());
    // 3 steps of 2 batches: batches 0..6 of the first pass are used.
    let out = format!("out={}", dir.0.join("a").display());
    let o = common::launch(
        2,
        &common::example_bin("macro_resume"),
        &[&project, "stop_at=3", &out],
        &[("IVME_SHARDING", sharding)],
    );
    common::ok(&o);
    let saved = dir.0.join("p/checkpoints/checkpoint_1");
    let m = ivme::checkpoint::verify(&saved).unwrap();
    assert_eq!(m.extra["layout"]["sharding"], sharding, "the save's layout");
    let resumed = run_reports(1, "macro_resume", &[&project], &dir.0.join("b"));
    // The 4 batches left of the first pass, then two whole passes, one batch per step.
    assert_eq!(resumed[0]["trained"], 4 + 10 + 10);
    let mut steps: Vec<Vec<usize>> = vec![vec![0, 1], vec![2, 3], vec![4, 5]];
    steps.extend((6..10).chain(0..10).chain(0..10).map(|i| vec![i]));
    let expected = plain_candle(&steps);
    let got = common::params(&resumed[0]);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>()
    );
    for (name, want) in &expected {
        for (a, b) in got[name].iter().zip(want) {
            assert!(
                (a - b).abs() <= 1e-5,
                "{sharding}: `{name}`: {a} vs plain candle's {b}"
            );
        }
    }
}
