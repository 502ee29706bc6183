//! The gradient sync bucket by bucket, on real processes: a model whose 1 MB buckets, ZeRO
//! stage 2's rank slices and variables all cut each other trains to plain candle's weights
//! (sharded or not), and a stage-2 step holds no second copy of the whole gradient (nor of the
//! whole weights) on top of candle's own.

mod common;

mod formula;

use formula::{max_diff, reference, weights};

/// Runs the subject on `n` ranks; returns each rank's weights and report.
fn run(n: usize, args: &[&str], tag: &str) -> (Vec<Vec<Vec<f32>>>, Vec<serde_json::Value>) {
    let out = common::scratch(tag);
    // Every buffer of more than 64 KiB gets pages of its own and gives them back when freed,
    // so the resident memory follows what the step really holds.
    let envs = [("MALLOC_MMAP_THRESHOLD_", "65536")];
    let out_arg = format!("out={}", out.display());
    let mut all = args.to_vec();
    all.push(&out_arg);
    let o = common::launch(n, &common::example_bin("zero_buckets"), &all, &envs);
    let (so, se) = common::text(&o);
    assert!(o.status.success(), "{tag}: {args:?}\n{so}\n{se}");
    let w = (0..n).map(|r| weights(&out, r)).collect();
    let reports = (0..n)
        .map(|r| {
            let b = std::fs::read(out.join(format!("rank{r}.json"))).expect("a report");
            serde_json::from_slice(&b).expect("JSON")
        })
        .collect();
    let _ = std::fs::remove_dir_all(&out);
    (w, reports)
}

#[test]
fn stage_2_syncs_bucket_by_bucket_to_plain_candles_weights_without_a_second_gradient_copy() {
    // Scale 1: 378,880 parameters (1.5 MB in f32): two buckets, cut inside matrices and, on 3
    // ranks, the slices cut inside other matrices.
    for n in [2usize, 3] {
        let (ws, _) = run(
            n,
            &["stage=gradients", "scale=1", "steps=3", "batch=4"],
            &format!("zb-f32-{n}"),
        );
        let expected = reference(1, 3, 4, n);
        for (r, w) in ws.iter().enumerate() {
            // Each rank's mean over its rows, averaged, against one mean over all rows: the
            // rounding differs (~1e-6 here); a misplaced element would be off by the step, 1e-3.
            let d = max_diff(w, &expected);
            assert!(d < 1e-5, "{n} ranks, rank {r}: {d} from plain candle");
            assert_eq!(w, &ws[0], "{n} ranks: rank {r} differs from rank 0");
        }
    }
    // Plain data parallelism's buckets cut variables too (scale 2: matrix 2 is 1.03 MB, longer
    // than a bucket): its mean is plain candle's as well.
    let (ws, _) = run(3, &["stage=no", "scale=2", "steps=3", "batch=4"], "zb-dp-3");
    let expected = reference(2, 3, 4, 3);
    for (r, w) in ws.iter().enumerate() {
        let d = max_diff(w, &expected);
        assert!(d < 1e-5, "no sharding, rank {r}: {d} from plain candle");
    }
    // bf16 weights travel at their own size and are written in place: the ranks agree, and
    // every weight is within one bf16 step (at 0.1–0.2, 2^-10) of the unsharded bf16 run's.
    let (ws, _) = run(
        3,
        &[
            "stage=gradients",
            "precision=bf16",
            "scale=1",
            "steps=3",
            "batch=4",
        ],
        "zb-bf16-3",
    );
    let (unsharded, _) = run(
        3,
        &[
            "stage=no",
            "precision=bf16",
            "scale=1",
            "steps=3",
            "batch=4",
        ],
        "zb-bf16-no-3",
    );
    for (r, w) in ws.iter().enumerate() {
        assert_eq!(w, &ws[0], "bf16: rank {r} differs from rank 0");
        let d = max_diff(w, &unsharded[0]);
        assert!(
            d <= 1.0 / 1024.0,
            "bf16, rank {r}: {d} from the unsharded run"
        );
    }
    // Scale 8: 6.05 M parameters, 24.2 MB of f32 gradient; the largest matrix is 4.1 MB.
    let (_, reports) = run(
        2,
        &["stage=gradients", "scale=8", "steps=3", "batch=4"],
        "zb-mem",
    );
    for (r, rep) in reports.iter().enumerate() {
        let grads = rep["params"].as_f64().unwrap() * 4.0;
        let grew = rep["grew"].as_f64().unwrap();
        // What a step must hold above what the loop held before it: candle's gradients (1×),
        // this rank's slice of the mean (½×) and candle's temporaries (a few matrices). The sync
        // that packed every gradient into one buffer, or gathered every weight into one, held
        // another whole copy on top.
        assert!(
            grew < 1.75 * grads,
            "rank {r}: a step grew resident memory by {:.1} MB for {:.1} MB of gradients",
            grew / 1e6,
            grads / 1e6
        );
    }
}

#[test]
fn f32_sharding_holds_each_weight_once() {
    // Scale 8 on 2 ranks: 6.05 M parameters. Unsharded, a rank holds the weights (4 bytes a
    // parameter) and AdamW's two moments (8); stage 2 the weights and its half of the moments
    // (4), so it should hold 4 bytes a parameter less. A stage that kept an f32 master copy of
    // its slice beside the f32 weights saved only half of that (2 bytes a parameter).
    let args = |stage| [stage, "scale=8", "steps=2", "batch=4"];
    let (_, plain) = run(2, &args("stage=no"), "zb-held-no");
    let (_, sharded) = run(2, &args("stage=gradients"), "zb-held-s2");
    for r in 0..2 {
        let params = plain[r]["params"].as_f64().unwrap();
        let held = |rep: &serde_json::Value| rep["held"].as_f64().unwrap();
        let saved = held(&plain[r]) - held(&sharded[r]);
        // The matrix the two slices cut is updated in place too: no copy of either part of it
        // (a copy of rank 0's part alone would be 2.9 MB, 0.5 B a parameter).
        assert!(
            saved > 3.6 * params,
            "rank {r}: stage 2 holds {:.1} MB, unsharded {:.1} MB: {:.1} MB less, expected \
             about {:.1} MB less",
            held(&sharded[r]) / 1e6,
            held(&plain[r]) / 1e6,
            saved / 1e6,
            4.0 * params / 1e6
        );
    }
}

#[test]
fn stage_2_stages_its_collectives_in_quarter_buckets() {
    // Scale 8 on 2 ranks: 24.2 MB of f32 gradient, the largest matrix 4.1 MB, and the default
    // 25 MiB bucket. The sync's four staging buffers (the reduce-scatter's send and receive,
    // the all-gather's own part and result) take a quarter bucket each, 6.6 MB: the
    // allocator keeps freed blocks of their size for the next step, so four whole buckets
    // (here the whole 24.2 MB gradient in one send buffer) raised every later step's peak.
    let (_, reports) = run(
        2,
        &[
            "stage=gradients",
            "scale=8",
            "steps=2",
            "batch=4",
            "bucket=25",
        ],
        "zb-chunks",
    );
    for (r, rep) in reports.iter().enumerate() {
        let largest = rep["largest"].as_f64().unwrap();
        assert!(
            largest < 8e6,
            "rank {r}: a stage-2 step allocated a block of {:.1} MB",
            largest / 1e6
        );
    }
}
