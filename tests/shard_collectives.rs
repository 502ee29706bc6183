//! Sharded collectives (reduce-scatter, all-gather into the caller's buffers, uneven shards)
//! on 1, 2 and 3 real processes, checked against values computed by hand.

mod common;

#[test]
fn reduce_scatter_and_all_gather_are_exact_on_one_two_and_three_ranks() {
    for n in [1, 2, 3] {
        let out = common::launch(n, &common::example_bin("shard_collectives"), &[], &[]);
        let (stdout, stderr) = common::text(&out);
        assert!(out.status.success(), "{n} ranks:\n{stdout}\n{stderr}");
        for r in 0..n {
            assert!(
                stdout.contains(&format!("ok rank {r} of {n}")),
                "{n} ranks:\n{stdout}\n{stderr}"
            );
        }
    }
}
