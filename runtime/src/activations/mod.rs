//! Activation checkpointing: segments of a forward pass whose activations are dropped as soon
//! as the segment has run and computed again, one segment at a time, during `backward`.
//!
//! A forward pass keeps every intermediate tensor it made until backward has used it, so the
//! activations of all of a model's blocks are alive at once. Run each block through
//! [`checkpoint`] and only the blocks' inputs stay: the segment's own graph is dropped with its
//! output, and [`Accelerator::backward`](crate::Accelerator::backward) runs it again, from the
//! last segment to the first, when the gradient reaches it (its weights' gradients and its
//! input's are then exactly what a backward without checkpointing computes). The price is one
//! more forward of each segment.
//!
//! Checkpointing is on while an Accelerator built with
//! [`activation_checkpointing(true)`](crate::AcceleratorBuilder::activation_checkpointing)
//! (`activation_checkpointing = true` in `#[accelerate]`) lives on the thread; otherwise
//! [`checkpoint`] simply runs the segment. ivme's model families ([`crate::models`]) run each
//! decoder or encoder block as a segment, so they need nothing more.
//!
//! What a recompute keeps the same:
//! - **Random draws**: draws from an [`ivme::rng::Rng`](crate::rng::Rng) (`dropout`, `rand`,
//!   `randn`) inside a segment are replayed, so the recompute drops the same units. candle's
//!   own random ops (`candle_nn::ops::dropout`, `Tensor::rand`) draw from a generator nobody
//!   can replay: the first `backward` compares each recomputed segment with its forward and
//!   refuses one that differs, naming it.
//! - **Buffers**: BatchNorm's running statistics and registered buffers are put back after the
//!   recomputes, so a recompute does not count a batch twice.
//!
//! ```no_run
//! # fn main() -> ivme::Result<()> {
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{linear, Linear, VarBuilder, VarMap};
//!
//! let mut acc = ivme::Accelerator::builder().activation_checkpointing(true).build()?;
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, acc.device());
//! let blocks: Vec<Linear> = (0..4)
//!     .map(|i| linear(64, 64, vb.pp(format!("block{i}"))))
//!     .collect::<candle_core::Result<_>>()?;
//! acc.prepare(varmap.clone())?;
//! let mut h = Tensor::ones((8, 64), DType::F32, acc.device())?;
//! for block in &blocks {
//!     let block = block.clone(); // the segment owns what it runs again (weights are shared)
//!     h = ivme::activations::checkpoint(&h, move |x| block.forward(x)?.tanh())?;
//! }
//! let grads = acc.backward(&h.sqr()?.mean_all()?)?;
//! # Ok(()) }
//! ```

mod recompute;
mod tape;

pub(crate) use recompute::backward;
pub(crate) use tape::{ever_ran, note_freed_unit, WeightsInstalled};

use crate::error::Result;
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

/// What ZeRO-3 does around a segment's runs: the Accelerator installs it on the thread that
/// built it (train/sync/gathered.rs), and segments call it, so the two know nothing else of
/// each other.
pub(crate) trait UnitWeights {
    /// Makes the weights of `unit` whole for a run of its segment (a collective). They stay
    /// whole until [`release`](Self::release) or [`scatter`](Self::scatter).
    fn gather(&self, unit: &str) -> Result<()>;
    /// Frees the weights of every unit gathered since the last release.
    fn release(&self) -> Result<()>;
    /// Takes those units' gradients out of `store` into this process's slices (a
    /// reduce-scatter), then frees their weights.
    fn scatter(&self, store: &mut GradStore) -> Result<()>;
}

/// Runs `f` on `x` as a checkpointed segment: its activations are dropped once it has run and
/// computed again during `backward`. Without checkpointing on this thread, or inside another
/// segment, it is just `f(x)`.
///
/// `f` is kept until `backward`, so it owns what it reads: clone the module into it (candle's
/// modules share their weights when cloned). It must compute the same result when run again:
/// draw randomness from [`ivme::rng::Rng`](crate::rng::Rng), whose draws are replayed.
pub fn checkpoint<F>(x: &Tensor, f: F) -> candle_core::Result<Tensor>
where
    F: Fn(&Tensor) -> candle_core::Result<Tensor> + 'static,
{
    run_segment(x, None, f)
}

/// [`checkpoint`] for a segment whose weights are the variables named `unit.…` (a block's
/// `VarMap` prefix, such as `model.layers.3`): under ZeRO-3
/// ([`Sharding::Parameters`](crate::Sharding::Parameters)) each process holds only its slice
/// of them, and they are gathered whole just before each run of the segment (its forward and
/// its recompute), freed after it, and their gradients reduce-scattered into the slices as
/// soon as the segment's backward ends. Under other stages the name is only a label.
///
/// The weights exist only inside the segment: code outside it must not read them (save and
/// load through the Accelerator, which knows where they are).
pub fn segment<F>(x: &Tensor, unit: &str, f: F) -> candle_core::Result<Tensor>
where
    F: Fn(&Tensor) -> candle_core::Result<Tensor> + 'static,
{
    run_segment(x, Some(unit), f)
}

fn run_segment<F>(x: &Tensor, unit: Option<&str>, f: F) -> candle_core::Result<Tensor>
where
    F: Fn(&Tensor) -> candle_core::Result<Tensor> + 'static,
{
    let weights = unit.and_then(|u| tape::weights().map(|w| (u, w)));
    if let (Some(u), None) = (unit, &weights) {
        if tape::freed_elsewhere(u) {
            // Its weights are freed, and only the thread that built the Accelerator gathers.
            candle_core::bail!(
                "ZeRO-3: the segment `{u}` runs on a thread that did not build the \
                 Accelerator, which is the one that gathers its weights: run the forward there"
            )
        }
    }
    if let Some((u, w)) = &weights {
        w.gather(u)?;
    }
    if !tape::records() {
        // Inside another segment: its end frees what this one gathered.
        return f(x);
    }
    let (out, draws) = tape::forward(|| f(x));
    if let Some((_, w)) = &weights {
        w.release()?;
    }
    let out = out?;
    if !out.track_op() {
        // Nothing in the segment or before it trains (a frozen base): no gradient flows here,
        // so there is no graph to drop and nothing to recompute.
        return Ok(out);
    }
    // A copy as a fresh variable: the segment's graph goes with `out`, and backward stops here.
    let output = Var::from_tensor(&out.detach())?;
    let handed_on = output.as_tensor().clone();
    tape::push(tape::Segment {
        input: x.clone(),
        output,
        run: Box::new(f),
        unit: unit.map(str::to_string),
        draws,
    });
    Ok(handed_on)
}

/// An Accelerator's activation checkpointing: on for the thread that built it while it lives.
#[derive(Debug)]
pub(crate) struct Segments {
    _recording: tape::Recording,
    /// Whether a backward has compared its recomputes with their forwards (the first does).
    verified: bool,
}

impl Segments {
    /// Switches checkpointing on for this thread.
    pub(crate) fn start() -> Segments {
        Segments {
            _recording: tape::Recording::start(),
            verified: false,
        }
    }

    /// Whether this backward should compare each recompute with its forward: the first one
    /// that recomputes does. Marks it done.
    pub(crate) fn verify_once(&mut self) -> bool {
        !std::mem::replace(&mut self.verified, true)
    }
}

/// Whether [`checkpoint`] records segments on this thread now (checkpointing is on and no
/// segment is running).
pub fn is_recording() -> bool {
    tape::records()
}

/// Drops the segments recorded since the last `backward`: call it after a forward pass that no
/// `backward` follows (an evaluation), so its segments' inputs are freed at once rather than
/// at the next `backward`.
pub fn discard() {
    drop(tape::take());
}
