//! The step-time report with real processes: a rank that is slower in its forward pass is the
//! one the report names, because the other ranks wait for it at the gradient sync.
//!
//! Needs `cargo build --workspace --bins --examples` first and Open MPI's `mpirun`.

mod common;

use common::job::{restartable, Job};
use common::Scratch;

#[test]
fn the_report_names_the_rank_the_others_wait_for() {
    for slow in ["0", "1"] {
        let dir = Scratch::new("step-times");
        let job: Job = restartable(
            &[],
            &dir.0.join("project"),
            &dir.0.join("out"),
            &[
                "step_ms=40",
                &format!("slow_rank={slow}"),
                "save_every=1000",
            ],
            &[("IVME_STEP_TIMES", "6")],
        );
        let end = job.wait();
        assert!(end.status.success(), "{}", end.show());
        // 18 steps: three reports, each over 6 steps, printed once (by rank 0).
        let reports = end
            .stdout
            .matches("step time, ms per optimizer step (6 steps")
            .count();
        assert_eq!(reports, 3, "{}", end.show());
        for phase in [
            "data",
            "forward and the rest",
            "backward",
            "sync",
            "optimizer",
        ] {
            assert!(
                end.stdout.contains(phase),
                "no `{phase}` row\n{}",
                end.show()
            );
        }
        let named = format!("rank {slow} waits least in sync");
        assert!(
            end.stdout.matches(&named).count() == 3,
            "the slow rank {slow} is not named every time\n{}",
            end.show()
        );
    }
}
