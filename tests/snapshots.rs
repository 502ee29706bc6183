//! In-memory snapshots with real processes: a rank killed mid-run under `--max_restarts` is
//! resumed from the newest snapshot (in `/dev/shm`), newer than the newest checkpoint on disk,
//! loses at most one step, and the run ends bit for bit like one that never stopped; the
//! launcher removes the snapshots when it ends.
//!
//! Needs `cargo build --workspace --bins --examples` first and Open MPI's `mpirun`.

mod common;

use common::job::{uninterrupted_then_crashed, weight_bits};
use common::Scratch;
use std::path::Path;

#[test]
fn a_crash_resumes_from_the_in_memory_snapshot_and_loses_at_most_a_step() {
    let dir = Scratch::new("snapshots");
    // 18 steps, a disk checkpoint every 4, a snapshot after every step; rank 1 dies right after
    // step 10, whose snapshot was never taken: the snapshot of step 9 is the newest state.
    let (whole, resumed, b) =
        uninterrupted_then_crashed(&dir.0, &[], &[("IVME_SNAPSHOT_EVERY", "1")]);
    assert_eq!(resumed["restart_count"].as_u64(), Some(1), "{}", b.show());
    assert_eq!(
        resumed["start_step"].as_u64(),
        Some(9),
        "not resumed from the snapshot of step 9 (the disk has step 8)\n{}",
        b.show()
    );
    let from = resumed["resumed_from"]
        .as_str()
        .expect("resumed from a folder");
    assert!(
        from.contains("ivme-snapshots-") && from.ends_with("checkpoint_9"),
        "{from}\n{}",
        b.show()
    );
    assert_eq!(
        weight_bits(&resumed),
        weight_bits(&whole),
        "resumed from the snapshot, the weights differ from the uninterrupted run's"
    );
    let folder = Path::new(from).parent().expect("the snapshots folder");
    assert!(
        !folder.exists(),
        "the launcher left its snapshots behind in {}",
        folder.display()
    );
}
