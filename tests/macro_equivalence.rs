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
