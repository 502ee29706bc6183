//! Items the `#[accelerate]` macro's generated code calls; not a stable API of its own.

use crate::accelerator::Accelerator;
use crate::data::sampler::plan_epoch;
use crate::data::{Batches, Dataset, StepObserver};
pub use crate::data::{LoopCursor, LoopPosition};
use crate::error::Result;
use candle_core::{Device, Tensor};

/// A batch that can be moved to a device (tensors, and tuples or vectors of them).
pub trait ToDevice: Sized {
    /// Returns `self` on `device`.
    fn to_device(&self, device: &Device) -> candle_core::Result<Self>;
}

impl ToDevice for Tensor {
    fn to_device(&self, device: &Device) -> candle_core::Result<Self> {
        Tensor::to_device(self, device)
    }
}

impl<T: ToDevice> ToDevice for Vec<T> {
    fn to_device(&self, device: &Device) -> candle_core::Result<Self> {
        self.iter().map(|t| t.to_device(device)).collect()
    }
}

macro_rules! tuple_to_device {
    ($($name:ident $i:tt),+) => {
        impl<$($name: ToDevice),+> ToDevice for ($($name,)+) {
            fn to_device(&self, device: &Device) -> candle_core::Result<Self> {
                Ok(($(self.$i.to_device(device)?,)+))
            }
        }
    };
}
tuple_to_device!(A 0);
tuple_to_device!(A 0, B 1);
tuple_to_device!(A 0, B 1, C 2);
tuple_to_device!(A 0, B 1, C 2, D 3);

/// A source of batches the macro can shard across processes.
#[diagnostic::on_unimplemented(
    message = "`#[accelerate]` cannot shard a batch loop over `{Self}`",
    label = "the loop that calls backward iterates over this",
    note = "the attribute shards a `Vec` of batches, `&Vec`/slice, their `.iter()`, `.into_iter()` \
            and `.enumerate()`, and a `DataLoader` (`&mut loader`, `loader.iter()`)",
    note = "collect other iterators first (`let batches: Vec<_> = it.collect();`), or, when each \
            process already reads its own data, call `accelerator.backward(&loss)?` yourself"
)]
pub trait ShardSource {
    /// The iterator over this process's share.
    type Iter: Iterator;
    /// This process's share, placed on the accelerator's device.
    fn shard(self, accelerator: &Accelerator) -> Result<Self::Iter>;
}

/// One pass of a sharded loop: this rank's batch indices, reported to the gradient state (so
/// accumulation windows follow the data) and to the loop cursor (so a save records them).
struct Pass {
    indices: Vec<usize>,
    padding: Vec<usize>,
    next: usize,
    // Batches of the pass before this rank's share (see `LoopPosition::skip`), the pass's
    // batch count and the number of processes: what `LoopPosition::done` is counted from.
    skip: usize,
    total: usize,
    world: usize,
    // false for a pass a loaded checkpoint had finished: it hands out nothing, records nothing
    live: bool,
    observer: std::sync::Arc<crate::train::window::GradientState>,
    cursor: crate::stateful::Shared<LoopCursor>,
}

impl Pass {
    /// The pass over `n` batches that begins now.
    fn begin(n: usize, accelerator: &Accelerator) -> Pass {
        let cursor = accelerator.loop_cursor();
        let start = cursor.lock().begin();
        let skip = start.map_or(0, |(skip, _)| skip.min(n));
        let (indices, padding) = my_share(n, skip, accelerator);
        Pass {
            next: start
                .map_or(indices.len(), |(_, next)| next)
                .min(indices.len()),
            live: start.is_some(),
            skip,
            total: n,
            world: accelerator.num_processes(),
            indices,
            padding,
            observer: accelerator.gradient_state(),
            cursor,
        }
    }

    /// The index of the next batch, or `None` at the end of the pass.
    fn advance(&mut self) -> Option<usize> {
        let len = self.indices.len();
        if self.next >= len {
            if std::mem::replace(&mut self.live, false) {
                self.cursor.lock().end_pass();
            }
            return None;
        }
        let k = self.next;
        self.observer
            .on_batch(k, len, self.padding.get(k).copied().unwrap_or(0));
        self.next += 1;
        let done = (self.skip + self.next * self.world).min(self.total);
        self.cursor.lock().handed_out(self.next, done);
        Some(self.indices[k])
    }
}

/// This process's share of a plain list of batches: rank r takes batches r, r+W, …, with the
/// last round padded from the start so every rank runs the same number of steps.
pub struct Sharded<T> {
    // This rank's batches from the pass's starting point on, already on the device.
    batches: std::vec::IntoIter<T>,
    pass: Pass,
}

impl<T: ToDevice> Iterator for Sharded<T> {
    type Item = T;
    fn next(&mut self) -> Option<T> {
        self.pass.advance()?;
        self.batches.next()
    }
}

/// The batch indices this rank takes from batches `skip..n` (the DataLoader's convention:
/// rank r takes the r-th, (r+W)-th, … of them, the last round padded from their start), with
/// each one's padding flag.
fn my_share(n: usize, skip: usize, accelerator: &Accelerator) -> (Vec<usize>, Vec<usize>) {
    let order: Vec<usize> = (skip..n).collect();
    let plan = plan_epoch(
        &order,
        1,
        accelerator.num_processes(),
        accelerator.process_index(),
        false,
        true,
    );
    let padding = plan.iter().map(|b| b.padding).collect();
    let indices = plan.iter().flat_map(|b| b.indices.clone()).collect();
    (indices, padding)
}

/// This process's share of a slice iterated by reference (`batches.iter()`): the same items,
/// `&T`, as the loop had, left where they are.
pub struct ShardedRefs<'a, T> {
    items: &'a [T],
    pass: Pass,
}

impl<'a, T> Iterator for ShardedRefs<'a, T> {
    type Item = &'a T;
    fn next(&mut self) -> Option<&'a T> {
        let i = self.pass.advance()?;
        Some(&self.items[i])
    }
}

impl<'a, T> ShardSource for std::slice::Iter<'a, T> {
    type Iter = ShardedRefs<'a, T>;
    fn shard(self, accelerator: &Accelerator) -> Result<Self::Iter> {
        let items = self.as_slice();
        Ok(ShardedRefs {
            pass: Pass::begin(items.len(), accelerator),
            items,
        })
    }
}

impl<T: ToDevice> ShardSource for std::vec::IntoIter<T> {
    type Iter = Sharded<T>;
    fn shard(self, accelerator: &Accelerator) -> Result<Self::Iter> {
        shard_vec(self.as_slice(), accelerator)
    }
}

// Moves this rank's share to the device up front, so a failure surfaces as an error before
// the loop starts rather than in the middle of it.
fn shard_vec<T: ToDevice>(items: &[T], accelerator: &Accelerator) -> Result<Sharded<T>> {
    let device = accelerator.device();
    let pass = Pass::begin(items.len(), accelerator);
    let mine = pass.indices[pass.next..]
        .iter()
        .map(|&i| items[i].to_device(device))
        .collect::<candle_core::Result<Vec<T>>>()?;
    Ok(Sharded {
        batches: mine.into_iter(),
        pass,
    })
}

impl<T: ToDevice> ShardSource for Vec<T> {
    type Iter = Sharded<T>;
    fn shard(self, accelerator: &Accelerator) -> Result<Self::Iter> {
        shard_vec(&self, accelerator)
    }
}

impl<T: ToDevice> ShardSource for &Vec<T> {
    type Iter = Sharded<T>;
    fn shard(self, accelerator: &Accelerator) -> Result<Self::Iter> {
        shard_vec(self, accelerator)
    }
}

impl<T: ToDevice> ShardSource for &[T] {
    type Iter = Sharded<T>;
    fn shard(self, accelerator: &Accelerator) -> Result<Self::Iter> {
        shard_vec(self, accelerator)
    }
}

impl<'a, D: Dataset> ShardSource for Batches<'a, D> {
    type Iter = Batches<'a, D>;
    fn shard(self, _: &Accelerator) -> Result<Self::Iter> {
        Ok(self)
    }
}

impl<'a, D: Dataset> ShardSource for &'a mut crate::data::DataLoader<D> {
    type Iter = Batches<'a, D>;
    fn shard(self, _: &Accelerator) -> Result<Self::Iter> {
        Ok(self.iter())
    }
}

/// This process's share of `source`, on the accelerator's device; see [`ShardSource`].
pub fn shard<S: ShardSource>(accelerator: &Accelerator, source: S) -> Result<S::Iter> {
    source.shard(accelerator)
}
