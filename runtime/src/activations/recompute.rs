//! Backward through checkpointed segments: candle's backward from the loss stops at the last
//! segments' outputs; each segment, from the last to the first, is then run again and
//! backpropagated from the gradient its output received.

use super::tape::{self, Segment};
use crate::error::{Error, Result};
use crate::nn::grad_sink;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use std::time::{Duration, Instant};

/// A backward's gradients, and the time its recomputes took.
pub(crate) struct Recomputed {
    /// The gradients of every variable the loss reached, as a backward without checkpointing
    /// gives them.
    pub store: GradStore,
    /// When each segment's recompute (its forward run again) began and ended, last segment
    /// first.
    pub spans: Vec<(Instant, Instant)>,
}

impl Recomputed {
    /// The time the recomputes took in all.
    pub(crate) fn took(&self) -> Duration {
        self.spans.iter().map(|(a, b)| *b - *a).sum()
    }
}

/// The gradients of `loss` through every segment recorded since the last backward; `verify`
/// compares each recomputed segment with its forward's output and refuses one that differs.
/// Segments the loss does not reach (an evaluation's) are dropped.
pub(crate) fn backward(loss: &Tensor, verify: bool) -> Result<Recomputed> {
    let segments = tape::take();
    let weights = tape::weights();
    let mut store = detached(grad_sink::backward(loss)?);
    let mut spans = Vec::new();
    let count = segments.len();
    for (k, segment) in segments.into_iter().enumerate().rev() {
        let Segment {
            input,
            output,
            run,
            unit,
            draws,
        } = segment;
        let Some(grad) = store.remove(output.as_tensor()) else {
            continue;
        };
        let began = Instant::now();
        if let (Some(w), Some(unit)) = (&weights, &unit) {
            w.gather(unit)?;
        }
        let (again, left) = tape::recompute(draws, || run(&input));
        let again = match again {
            Ok(again) => again,
            Err(e) => {
                if let Some(w) = &weights {
                    w.release()?;
                }
                return Err(refused(k, count, &format!("its recompute failed: {e}")));
            }
        };
        if left > 0 {
            return Err(refused(
                k,
                count,
                &format!(
                    "its recompute drew {left} time(s) fewer from an ivme Rng than its forward"
                ),
            ));
        }
        spans.push((began, Instant::now()));
        if verify {
            same_as_forward(&again, output.as_tensor(), k, count)?;
        }
        drop(output);
        let seed = grad.detach();
        let mut part = grad_sink::backward(&(again * &seed)?.sum_all()?)?;
        // candle gives `seed` a gradient too (`again` itself, graph and all): not wanted.
        part.remove(&seed);
        if let Some(w) = &weights {
            // ZeRO-3: the units' gradients go to their slices now, and their weights go.
            w.scatter(&mut part)?;
        }
        store.extend(detached(part))?;
    }
    Ok(Recomputed { store, spans })
}

/// `store` with every gradient cut from the graph it was computed with: a gradient candle
/// computes from a forward tensor can hold that tensor's graph, which would keep a recomputed
/// segment's activations alive until the step ends (tests/activation_memory.rs).
fn detached(mut store: GradStore) -> GradStore {
    let ids: Vec<_> = store.get_ids().copied().collect();
    for id in ids {
        if let Some(grad) = store.get_id(id) {
            let grad = grad.detach();
            store.insert_id(id, grad);
        }
    }
    store
}

/// Refuses segment `k` of `count` whose recompute did not give its forward's result.
fn same_as_forward(again: &Tensor, forward: &Tensor, k: usize, count: usize) -> Result<()> {
    if again.shape() != forward.shape() || again.dtype() != forward.dtype() {
        return Err(refused(
            k,
            count,
            &format!(
                "its recompute gave a {:?} {:?} tensor, its forward a {:?} {:?} one",
                again.dtype(),
                again.shape(),
                forward.dtype(),
                forward.shape()
            ),
        ));
    }
    let a = again.detach().to_dtype(DType::F32)?;
    let f = forward.to_dtype(DType::F32)?;
    let diff = (&a - &f)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let size = f.abs()?.max_all()?.to_scalar::<f32>()?;
    // A GPU's kernels may round a few elements differently when run again; a draw that differs
    // (a unit dropped in one run and kept in the other) moves values by their own size.
    if diff.is_nan() || diff > 1e-2 * size {
        return Err(refused(
            k,
            count,
            &format!(
                "run again in backward it computed different values (largest difference {diff:e} \
                 on values up to {size:e}): it draws randomness ivme cannot replay \
                 (candle_nn::ops::dropout, Tensor::rand and Tensor::randn use candle's \
                 unseeded generator; draw from ivme::rng::Rng instead, whose draws are \
                 replayed) or reads state that changed after its forward"
            ),
        ));
    }
    Ok(())
}

/// The error for segment `k` (0-based, in forward order) of `count`.
fn refused(k: usize, count: usize, why: &str) -> Error {
    Error::Usage(format!(
        "activation checkpointing: segment {} of {count} (in forward order) cannot be \
         recomputed: {why}; make the segment repeatable, or train without \
         activation_checkpointing",
        k + 1
    ))
}
