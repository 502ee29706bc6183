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
