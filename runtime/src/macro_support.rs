//! Items the `#[accelerate]` macro's generated code calls; not a stable API of its own.

use crate::accelerator::Accelerator;
use crate::data::sampler::plan_epoch;
use crate::data::{Batches, Dataset, StepObserver};
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

/// This process's share of a plain list of batches: rank r takes batches r, r+W, …, with the
/// last round padded from the start so every rank runs the same number of steps.
pub struct Sharded<T> {
    batches: std::vec::IntoIter<T>,
    // 1 for a batch repeated only to even out the ranks
    padding: Vec<usize>,
    len: usize,
    next: usize,
    observer: std::sync::Arc<crate::grads::GradientState>,
}

impl<T: ToDevice> Iterator for Sharded<T> {
    type Item = T;
    fn next(&mut self) -> Option<T> {
        let batch = self.batches.next()?;
        let padding = self.padding.get(self.next).copied().unwrap_or(0);
        self.observer.on_batch(self.next, self.len, padding);
        self.next += 1;
        Some(batch)
    }
}

/// The batch indices this rank takes from `n` batches (the DataLoader's convention: rank r
/// takes r, r+W, …, the last round padded from the start), with each one's padding flag.
fn my_share(n: usize, accelerator: &Accelerator) -> (Vec<usize>, Vec<usize>) {
    let order: Vec<usize> = (0..n).collect();
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
    indices: std::vec::IntoIter<usize>,
    padding: Vec<usize>,
    len: usize,
    next: usize,
    observer: std::sync::Arc<crate::grads::GradientState>,
}

impl<'a, T> Iterator for ShardedRefs<'a, T> {
    type Item = &'a T;
    fn next(&mut self) -> Option<&'a T> {
        let i = self.indices.next()?;
        let padding = self.padding.get(self.next).copied().unwrap_or(0);
        self.observer.on_batch(self.next, self.len, padding);
        self.next += 1;
        Some(&self.items[i])
    }
}

impl<'a, T> ShardSource for std::slice::Iter<'a, T> {
    type Iter = ShardedRefs<'a, T>;
    fn shard(self, accelerator: &Accelerator) -> Result<Self::Iter> {
        let items = self.as_slice();
        let (indices, padding) = my_share(items.len(), accelerator);
        Ok(ShardedRefs {
            items,
            len: indices.len(),
            indices: indices.into_iter(),
            padding,
            next: 0,
            observer: accelerator.gradient_state(),
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
    let (indices, padding) = my_share(items.len(), accelerator);
    let mine = indices
        .iter()
        .map(|&i| items[i].to_device(device))
        .collect::<candle_core::Result<Vec<T>>>()?;
    Ok(Sharded {
        padding,
        len: mine.len(),
        batches: mine.into_iter(),
        next: 0,
        observer: accelerator.gradient_state(),
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
