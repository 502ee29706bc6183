//! The gradient sync on real ranks allocates no buffer per step: `Accelerator::backward`
//! allocates no more large blocks than candle's own `loss.backward()` on the same graph.

mod common;

fn sync_allocations(n: usize) -> Vec<(f64, f64)> {
    let out = common::launch(n, &common::example_bin("grad_sync_alloc"), &["5"], &[]);
    let (stdout, stderr) = common::text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let rows: Vec<(f64, f64)> = stdout
        .lines()
        .filter(|l| l.starts_with("rank "))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            let field = |name: &str| -> f64 {
                let i = w.iter().position(|x| *x == name).expect(name);
                w[i + 1].parse().expect(name)
            };
            (field("sync_large"), field("sync_bytes"))
        })
        .collect();
    assert_eq!(rows.len(), n, "one line per rank: {stdout}");
    rows
}

#[test]
fn the_gradient_sync_allocates_no_buffer_per_step() {
    // The model's gradients are ~330 KB: copying them into fresh buffers would show as large
    // blocks and hundreds of kilobytes per step.
    for n in [2, 3] {
        for (rank, (large, bytes)) in sync_allocations(n).into_iter().enumerate() {
            assert_eq!(large, 0.0, "{n} ranks, rank {rank}: large blocks per step");
            assert!(
                bytes < 8192.0,
                "{n} ranks, rank {rank}: the sync allocated {bytes} bytes per step"
            );
        }
    }
}
