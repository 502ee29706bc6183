//! Which samples each rank sees, and in what order: pure functions of the dataset size, the
//! seed, the epoch and the rank.
//!
//! The rule that shapes everything here: N ranks with batch B see, step by step, exactly what
//! one process with batch N*B would see. Global step k covers `order[k*W*B .. (k+1)*W*B)` and
//! rank r takes the r-th block of B inside it, so averaging the ranks' gradients reproduces the
//! big-batch gradient.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// One batch of the plan: the dataset indices to fetch and how many of them are padding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedBatch {
    /// Dataset indices, padding (if any) last.
    pub indices: Vec<usize>,
    /// How many trailing entries of `indices` repeat earlier samples only to even out the ranks.
    pub padding: usize,
}

/// Returns the sample order of one epoch: `0..n`, or when `shuffle` is on a permutation that
/// depends only on `(seed, epoch)`, so every rank computes the same one without talking.
pub fn epoch_order(n: usize, shuffle: bool, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if shuffle {
        let mut rng = epoch_rng(seed, epoch);
        // Fisher-Yates with our own bounded draw: rand's `shuffle` may change its algorithm
        // between releases, which would silently change the order a checkpoint resumes into.
        for i in (1..n).rev() {
            let j = uniform_below(&mut rng, i as u64 + 1) as usize;
            order.swap(i, j);
        }
    }
    order
}

/// The generator for one epoch's permutation.
///
/// The seed and the epoch fill separate halves of the ChaCha key, so distinct `(seed, epoch)`
/// pairs give distinct keys and, ChaCha being a keyed PRF, unrelated streams; no hash-based
/// mixing (which could collide) is needed.
fn epoch_rng(seed: u64, epoch: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&epoch.to_le_bytes());
    // A constant tag keeps these streams apart from any other ChaCha use seeded with the
    // same two numbers elsewhere in ivme.
    key[16..24].copy_from_slice(b"ivmedata");
    ChaCha8Rng::from_seed(key)
}

/// Draws uniformly from `0..bound` (`bound > 0`) without modulo bias (Lemire's method).
fn uniform_below(rng: &mut ChaCha8Rng, bound: u64) -> u64 {
    // Products whose low half falls below 2^64 mod bound would make small results likelier.
    let threshold = bound.wrapping_neg() % bound;
    loop {
        let wide = u128::from(rng.next_u64()) * u128::from(bound);
        if (wide as u64) >= threshold {
            return (wide >> 64) as u64;
        }
    }
}

/// Builds rank `rank`'s batches for one epoch from the shared `order`.
///
/// Full global steps of `world * batch_size` samples are split into one block per rank. The
/// tail `m` (when `0 < m < world * batch_size`) is dropped with `drop_last`; otherwise each rank
/// gets `ceil(m / world)` tail samples, and with `even_batches` the missing ones are padding
/// taken cyclically from the start of `order`, so every rank runs the same number of steps
/// (collectives would hang otherwise). Without `even_batches` a rank whose tail slice is empty
/// gets one batch fewer.
///
/// A zero `batch_size` or `world`, or `rank >= world`, describes no valid split and yields an
/// empty plan; [`DataLoader`](super::DataLoader) rejects those settings with an error first.
pub fn plan_epoch(
    order: &[usize],
    batch_size: usize,
    world: usize,
    rank: usize,
    drop_last: bool,
    even_batches: bool,
) -> Vec<PlannedBatch> {
    let n = order.len();
    let Some(step) = valid_step(batch_size, world, rank) else {
        return Vec::new();
    };
    let full_steps = n / step;
    let mut plan: Vec<PlannedBatch> = (0..full_steps)
        .map(|k| {
            let start = k * step + rank * batch_size;
            PlannedBatch {
                indices: order[start..start + batch_size].to_vec(),
                padding: 0,
            }
        })
        .collect();

    let tail = &order[full_steps * step..];
    let m = tail.len();
    if m == 0 || drop_last {
        return plan;
    }
    let per_rank = m.div_ceil(world);
    // Positions in the padded tail; those at or past `m` are padding.
    let lo = rank * per_rank;
    let hi = lo + per_rank;
    let real: Vec<usize> = tail[lo.min(m)..hi.min(m)].to_vec();
    if even_batches {
        let padding = per_rank - real.len();
        let first_pad = lo.max(m) - m;
        let mut indices = real;
        indices.extend((first_pad..first_pad + padding).map(|j| order[j % n]));
        plan.push(PlannedBatch { indices, padding });
    } else if !real.is_empty() {
        plan.push(PlannedBatch {
            indices: real,
            padding: 0,
        });
    }
    plan
}

/// Counts the batches rank `rank` gets per epoch, without building the plan.
///
/// Agrees with `plan_epoch(..).len()` for every input, including the invalid ones (zero).
pub fn batches_per_rank(
    n: usize,
    batch_size: usize,
    world: usize,
    rank: usize,
    drop_last: bool,
    even_batches: bool,
) -> usize {
    let Some(step) = valid_step(batch_size, world, rank) else {
        return 0;
    };
    let full_steps = n / step;
    let m = n % step;
    if m == 0 || drop_last {
        return full_steps;
    }
    let has_tail = even_batches || rank * m.div_ceil(world) < m;
    full_steps + usize::from(has_tail)
}

/// Samples per global step, or `None` when the split is not meaningful.
fn valid_step(batch_size: usize, world: usize, rank: usize) -> Option<usize> {
    if batch_size == 0 || world == 0 || rank >= world {
        return None;
    }
    batch_size.checked_mul(world)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(n: usize, b: usize, w: usize, r: usize, drop: bool, even: bool) -> Vec<PlannedBatch> {
        let order: Vec<usize> = (0..n).collect();
        plan_epoch(&order, b, w, r, drop, even)
    }

    fn batch(indices: &[usize], padding: usize) -> PlannedBatch {
        PlannedBatch {
            indices: indices.to_vec(),
            padding,
        }
    }

    #[test]
    fn unshuffled_order_is_the_identity() {
        assert_eq!(epoch_order(5, false, 7, 3), vec![0, 1, 2, 3, 4]);
        assert!(epoch_order(0, true, 1, 1).is_empty());
        assert_eq!(epoch_order(1, true, 1, 1), vec![0]);
    }

    #[test]
    fn shuffled_order_is_a_deterministic_permutation() {
        let a = epoch_order(100, true, 42, 3);
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_eq!(a, epoch_order(100, true, 42, 3));
        assert_ne!(a, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn shuffled_order_changes_with_epoch_and_seed() {
        let base = epoch_order(50, true, 1, 0);
        assert_ne!(base, epoch_order(50, true, 1, 1));
        assert_ne!(base, epoch_order(50, true, 2, 0));
        // Swapping seed and epoch must not give the same stream.
        assert_ne!(epoch_order(50, true, 1, 2), epoch_order(50, true, 2, 1));
    }

    #[test]
    fn shuffle_is_uniform_over_permutations() {
        // 6000 draws over the 6 permutations of 3 items: a chi-square statistic with 5 degrees
        // of freedom above 20.5 has probability below 0.001 for a uniform shuffle.
        let mut counts = std::collections::HashMap::new();
        for epoch in 0..6000 {
            *counts.entry(epoch_order(3, true, 9, epoch)).or_insert(0u32) += 1;
        }
        assert_eq!(counts.len(), 6);
        let chi2: f64 = counts
            .values()
            .map(|&c| (f64::from(c) - 1000.0).powi(2) / 1000.0)
            .sum();
        assert!(chi2 < 20.5, "chi-square {chi2} for counts {counts:?}");
    }

    #[test]
    fn uniform_below_stays_in_range() {
        let mut rng = epoch_rng(0, 0);
        for bound in [1u64, 2, 3, 7, u64::MAX] {
            for _ in 0..100 {
                assert!(uniform_below(&mut rng, bound) < bound);
            }
        }
    }

    #[test]
    fn world_of_one_is_plain_chunking() {
        let order = epoch_order(23, true, 5, 0);
        for b in 1..=25 {
            let expected: Vec<Vec<usize>> = order.chunks(b).map(<[usize]>::to_vec).collect();
            let got: Vec<Vec<usize>> = plan_epoch(&order, b, 1, 0, false, true)
                .into_iter()
                .map(|p| {
                    assert_eq!(p.padding, 0);
                    p.indices
                })
                .collect();
            assert_eq!(got, expected, "batch size {b}");
            let exact: Vec<Vec<usize>> = order.chunks_exact(b).map(<[usize]>::to_vec).collect();
            let dropped: Vec<Vec<usize>> = plan_epoch(&order, b, 1, 0, true, true)
                .into_iter()
                .map(|p| p.indices)
                .collect();
            assert_eq!(dropped, exact, "batch size {b} with drop_last");
        }
    }

    #[test]
    fn multiple_of_the_global_step_has_no_tail() {
        // n = 24, B = 3, W = 4: two global steps of 12.
        assert_eq!(
            plan(24, 3, 4, 1, false, true),
            vec![batch(&[3, 4, 5], 0), batch(&[15, 16, 17], 0)]
        );
        assert_eq!(
            plan(24, 3, 4, 3, true, false),
            vec![batch(&[9, 10, 11], 0), batch(&[21, 22, 23], 0)]
        );
    }

    #[test]
    fn uneven_tail_is_split_then_padded_from_the_start() {
        // n = 10, B = 2, W = 3: one full step (0..6), tail 6..10 gives 2 per rank.
        assert_eq!(plan(10, 2, 3, 0, false, true)[1], batch(&[6, 7], 0));
        assert_eq!(plan(10, 2, 3, 1, false, true)[1], batch(&[8, 9], 0));
        assert_eq!(plan(10, 2, 3, 2, false, true)[1], batch(&[0, 1], 2));
        // n = 11, B = 3, W = 2: tail 6..11 gives 3 per rank; the second rank ends with padding.
        assert_eq!(plan(11, 3, 2, 0, false, true)[1], batch(&[6, 7, 8], 0));
        assert_eq!(plan(11, 3, 2, 1, false, true)[1], batch(&[9, 10, 0], 1));
    }

    #[test]
    fn padding_follows_the_shared_order_not_the_identity() {
        let order = [4, 2, 0, 3, 1];
        // B = 2, W = 2: step 4, tail [1] gives 1 per rank; rank 1 pads with order[0] = 4.
        assert_eq!(
            plan_epoch(&order, 2, 2, 0, false, true),
            vec![batch(&[4, 2], 0), batch(&[1], 0)]
        );
        assert_eq!(
            plan_epoch(&order, 2, 2, 1, false, true),
            vec![batch(&[0, 3], 0), batch(&[4], 1)]
        );
    }

    #[test]
    fn tiny_datasets_wrap_the_padding() {
        // n = 3, W = 4: each rank gets one sample, the last one repeats sample 0.
        let got: Vec<_> = (0..4).map(|r| plan(3, 2, 4, r, false, true)).collect();
        assert_eq!(
            got,
            vec![
                vec![batch(&[0], 0)],
                vec![batch(&[1], 0)],
                vec![batch(&[2], 0)],
                vec![batch(&[0], 1)]
            ]
        );
        // n = 2, W = 5: the padding cycles through the order more than once.
        let pads: Vec<_> = (0..5).map(|r| plan(2, 4, 5, r, false, true)).collect();
        assert_eq!(pads[2], vec![batch(&[0], 1)]);
        assert_eq!(pads[3], vec![batch(&[1], 1)]);
        assert_eq!(pads[4], vec![batch(&[0], 1)]);
        // n = 1, W = 4: every other rank repeats the only sample.
        assert_eq!(plan(1, 1, 4, 3, false, true), vec![batch(&[0], 1)]);
    }

    #[test]
    fn drop_last_removes_the_tail() {
        assert_eq!(plan(10, 2, 3, 2, true, true), vec![batch(&[4, 5], 0)]);
        assert!(plan(3, 2, 4, 0, true, true).is_empty());
        assert_eq!(batches_per_rank(3, 2, 4, 0, true, true), 0);
    }

    #[test]
    fn without_even_batches_empty_tail_slices_are_skipped() {
        // n = 7, B = 2, W = 3: tail [6] goes to rank 0 only.
        assert_eq!(
            plan(7, 2, 3, 0, false, false),
            vec![batch(&[0, 1], 0), batch(&[6], 0)]
        );
        assert_eq!(plan(7, 2, 3, 1, false, false), vec![batch(&[2, 3], 0)]);
        assert_eq!(plan(7, 2, 3, 2, false, false), vec![batch(&[4, 5], 0)]);
        // n < world: the ranks past the data get nothing at all.
        assert_eq!(plan(2, 1, 4, 1, false, false), vec![batch(&[1], 0)]);
        assert!(plan(2, 1, 4, 2, false, false).is_empty());
        assert_eq!(batches_per_rank(2, 1, 4, 3, false, false), 0);
    }

    #[test]
    fn empty_dataset_and_invalid_splits_give_empty_plans() {
        for (b, w, r) in [(2, 3, 0), (0, 1, 0), (2, 0, 0), (2, 2, 2)] {
            for drop in [false, true] {
                for even in [false, true] {
                    assert!(plan(0, b, w, r, drop, even).is_empty());
                    assert_eq!(batches_per_rank(0, b, w, r, drop, even), 0);
                }
            }
        }
        assert!(plan(10, 0, 2, 0, false, true).is_empty());
        assert!(plan(10, 2, 2, 5, false, true).is_empty());
        assert_eq!(batches_per_rank(10, 2, 0, 0, false, true), 0);
    }

    /// Checks, for many sizes, the properties the training maths relies on.
    #[test]
    fn ranks_together_replay_one_big_batch() {
        for n in 0..40 {
            let order = epoch_order(n, true, 11, n as u64);
            for b in 1..5 {
                for w in 1..5 {
                    for drop in [false, true] {
                        for even in [false, true] {
                            check_split(&order, b, w, drop, even);
                        }
                    }
                }
            }
        }
    }

    fn check_split(order: &[usize], b: usize, w: usize, drop: bool, even: bool) {
        let ctx = format!("n={} b={b} w={w} drop={drop} even={even}", order.len());
        let plans: Vec<_> = (0..w)
            .map(|r| plan_epoch(order, b, w, r, drop, even))
            .collect();
        for (r, p) in plans.iter().enumerate() {
            assert_eq!(
                batches_per_rank(order.len(), b, w, r, drop, even),
                p.len(),
                "{ctx}"
            );
            for (i, pb) in p.iter().enumerate() {
                assert!(!pb.indices.is_empty() && pb.indices.len() <= b, "{ctx}");
                assert!(pb.padding <= pb.indices.len(), "{ctx}");
                assert!(
                    pb.padding == 0 || i + 1 == p.len(),
                    "{ctx}: padding before the end"
                );
            }
        }
        if even || drop {
            assert!(plans.iter().all(|p| p.len() == plans[0].len()), "{ctx}");
        }
        // Step k across ranks, padding removed, is chunk k of the order with batch W*B.
        let reference: Vec<&[usize]> = if drop {
            order.chunks_exact(w * b).collect()
        } else {
            order.chunks(w * b).collect()
        };
        let steps = plans.iter().map(Vec::len).max().unwrap_or(0);
        assert_eq!(steps, reference.len(), "{ctx}");
        for (k, chunk) in reference.iter().enumerate() {
            let mut joined = Vec::new();
            for p in &plans {
                if let Some(pb) = p.get(k) {
                    joined.extend_from_slice(&pb.indices[..pb.indices.len() - pb.padding]);
                }
            }
            assert_eq!(joined.as_slice(), *chunk, "{ctx}: step {k}");
        }
        // The padding repeats the order from its start, cycling.
        let pads: Vec<usize> = plans
            .iter()
            .filter_map(|p| p.last())
            .flat_map(|pb| pb.indices[pb.indices.len() - pb.padding..].to_vec())
            .collect();
        let expected: Vec<usize> = (0..pads.len()).map(|j| order[j % order.len()]).collect();
        assert_eq!(pads, expected, "{ctx}");
        let m = order.len() % (w * b);
        let missing = if even && !drop && m > 0 {
            w * m.div_ceil(w) - m
        } else {
            0
        };
        assert_eq!(pads.len(), missing, "{ctx}");
    }
}
