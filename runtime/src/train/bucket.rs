//! The gradient sync's buckets: the layout of a model's gradients in flat buffers, and the
//! host buffers that carry them across processes without allocating.
//!
//! Every rank lays the gradients out alike: variables in name order. On the CPU their elements
//! are cut into buckets of `bucket_bytes` (a variable larger than a bucket is cut across
//! several), and one send and one receive buffer of one bucket each carry every bucket of every
//! step: a gradient's part is copied into the send buffer, the buffers are reduced, and the
//! mean comes back into the gradient's own storage (the window's sum, which nothing else
//! holds), so a step of the sync allocates no buffer and no tensor, and the buffers cost two
//! buckets whatever the largest variable. Gradients elsewhere (a GPU) or in another form take
//! the general path, [`all_reduce_bucketed`], whose buckets hold whole variables (a variable
//! larger than a bucket travels alone).

use std::cell::{Cell, RefCell};
use std::ops::Range;

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Tensor, Var};

use crate::comm::{Communicator, ReduceOp};
use crate::error::Result;

/// Cuts variables of `sizes` elements (f32) into consecutive buckets of at most `bucket_bytes`
/// each; a variable larger than a bucket is a bucket of its own.
pub(crate) fn cut(
    sizes: impl IntoIterator<Item = usize>,
    bucket_bytes: usize,
) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0usize);
    let mut end = 0;
    for n in sizes {
        let b = n * 4;
        if end > start && bytes + b > bucket_bytes {
            out.push(start..end);
            (start, bytes) = (end, 0);
        }
        bytes += b;
        end += 1;
    }
    if end > start {
        out.push(start..end);
    }
    out
}

/// A run of one variable's elements inside a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    /// The variable's position in the laid-out list.
    pub at: usize,
    /// Its first element in this bucket (flattened).
    pub from: usize,
    /// How many of its elements this bucket holds.
    pub len: usize,
}

/// Cuts the elements of variables of `sizes` (f32), one after the other, into buckets of
/// `bucket_bytes` (the last one shorter); a variable may be cut across buckets.
pub(crate) fn chunks(
    sizes: impl IntoIterator<Item = usize>,
    bucket_bytes: usize,
) -> Vec<Vec<Span>> {
    let step = (bucket_bytes / 4).max(1);
    let mut out = Vec::new();
    let mut bucket = Vec::new();
    let mut room = step;
    for (at, n) in sizes.into_iter().enumerate() {
        let mut from = 0;
        while from < n {
            let len = room.min(n - from);
            bucket.push(Span { at, from, len });
            (from, room) = (from + len, room - len);
            if room == 0 {
                out.push(std::mem::take(&mut bucket));
                room = step;
            }
        }
    }
    if !bucket.is_empty() {
        out.push(bucket);
    }
    out
}

/// Averages `grads` across processes with one collective per bucket of at most
/// `bucket_bytes` (a tensor larger than a bucket travels alone).
///
/// `position` says where this rank's data stands (see
/// [`GradientState::position`](crate::train::window::GradientState::position)); every rank must pass
/// the same value, or the sync fails on every rank instead of averaging gradients of
/// different batches.
pub fn all_reduce_bucketed(
    comm: &dyn Communicator,
    grads: &mut [Tensor],
    bucket_bytes: usize,
    position: u64,
) -> Result<()> {
    let sizes: Vec<usize> = grads.iter().map(Tensor::elem_count).collect();
    for bucket in cut(sizes, bucket_bytes) {
        let (start, end) = (bucket.start, bucket.end);
        let flat: Vec<Tensor> = grads[start..end]
            .iter()
            .map(|g| g.flatten_all())
            .collect::<candle_core::Result<_>>()?;
        let flat = if flat.len() == 1 {
            flat[0].clone()
        } else {
            Tensor::cat(&flat, 0)?
        };
        let reduced = comm.all_reduce_checked(&flat, ReduceOp::Mean, position)?;
        let mut offset = 0;
        for g in &mut grads[start..end] {
            let n = g.elem_count();
            *g = reduced.narrow(0, offset, n)?.reshape(g.shape())?;
            offset += n;
        }
    }
    Ok(())
}

/// What the unpacking of a reduced bucket does to each value: `x * inv_world`, then the
/// loss-scale undone as candle's `tensor * f64` would (`y * s + 0`), so the result is bit for bit
/// the tensor path's.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Finish {
    /// `1 / world size`, as the mean's f32 factor.
    pub inv_world: f32,
    /// The f32 factor that undoes the loss scale, when there is one.
    pub inv_scale: Option<f32>,
}

/// The persistent buffers and layout of one prepared model's gradient sync.
#[derive(Debug, Default)]
pub(crate) struct SyncBuffers {
    // The bucket size the layout was cut for, the variables it lays out (indices into the
    // model's variables: the synced ones), and the buckets (runs of those variables).
    layout: Option<(usize, Vec<usize>, Vec<Vec<Span>>)>,
    send: Vec<f32>,
    recv: Vec<f32>,
    // Scratch for the aliasing check: (start, end) addresses of every gradient's data.
    spans: Vec<(usize, usize)>,
}

impl SyncBuffers {
    /// The bytes its send and receive buffers hold.
    pub(crate) fn bytes(&self) -> usize {
        (self.send.capacity() + self.recv.capacity()) * std::mem::size_of::<f32>()
    }

    /// Whether every gradient of the window can take the allocation-free path: on the CPU,
    /// f32, contiguous, and no two sharing memory (so that writing one cannot change another).
    pub fn fits(&mut self, sums: &[Option<Tensor>]) -> bool {
        self.spans.clear();
        for t in sums.iter().flatten() {
            if !t.device().is_cpu() || t.dtype() != DType::F32 || !t.is_contiguous() {
                return false;
            }
            let (storage, layout) = t.storage_and_layout();
            let candle_core::Storage::Cpu(CpuStorage::F32(data)) = &*storage else {
                return false;
            };
            let Some((a, b)) = layout.contiguous_offsets() else {
                return false;
            };
            let base = data.as_ptr() as usize;
            self.spans.push((base + 4 * a, base + 4 * b));
        }
        self.spans.sort_unstable();
        self.spans.windows(2).all(|w| w[0].1 <= w[1].0)
    }

    /// Averages the window's sums of the variables `synced` lists (indices into `sums` and
    /// `master`; the others, frozen, move nothing) across processes bucket by bucket through
    /// the persistent buffers, writes each mean (unscaled) back into its sum, and moves the
    /// sums into `store` keyed by master variable. Returns whether any value is inf/NaN (when
    /// `check_overflow`).
    ///
    /// Call only after [`fits`](Self::fits) said yes for these `sums`.
    pub fn sync(
        &mut self,
        comm: &dyn Communicator,
        work: Work,
        synced: &[usize],
        bucket_bytes: usize,
        store: &mut GradStore,
    ) -> Result<bool> {
        let master = work.master;
        self.lay_out(master, synced, bucket_bytes);
        self.run(comm, work, |landed| {
            if let Landed::Whole(i, t) = landed {
                store.insert(master[i].as_tensor(), t);
            }
        })
    }

    /// Cuts the variables `synced` lists into buckets of `bucket_bytes` (again only when the
    /// size or the list changed) and sizes the buffers for the largest; returns how many
    /// buckets there are.
    pub(crate) fn lay_out(
        &mut self,
        master: &[Var],
        synced: &[usize],
        bucket_bytes: usize,
    ) -> usize {
        if self
            .layout
            .as_ref()
            .is_none_or(|(b, s, _)| *b != bucket_bytes || s != synced)
        {
            let buckets = chunks(synced.iter().map(|&i| master[i].elem_count()), bucket_bytes);
            let largest = buckets
                .iter()
                .map(|b| b.iter().map(|s| s.len).sum::<usize>())
                .max()
                .unwrap_or(0);
            self.send = vec![0.0; largest];
            self.recv = vec![0.0; largest];
            self.layout = Some((bucket_bytes, synced.to_vec(), buckets));
        }
        self.layout.as_ref().map_or(0, |(_, _, b)| b.len())
    }

    /// Moves every bucket of the layout [`lay_out`](Self::lay_out) made: packs it, reduces it
    /// and writes the finished mean back into the sums; tells `landed` each run of a
    /// variable written, each variable whose mean is complete (its sum taken out of `sums`)
    /// and the end of each bucket. Returns whether any value is inf/NaN (when
    /// `check_overflow`).
    pub(crate) fn run(
        &mut self,
        comm: &dyn Communicator,
        work: Work<'_>,
        mut landed: impl FnMut(Landed<'_>),
    ) -> Result<bool> {
        let Work {
            sums,
            master,
            position,
            finish,
            check_overflow,
        } = work;
        let Some((_, synced, buckets)) = &self.layout else {
            return Err(crate::Error::Usage(
                "the gradient sync ran before its buffers were laid out".into(),
            ));
        };
        let mut overflow = false;
        for bucket in buckets {
            let mut len = 0;
            for span in bucket {
                let dst = &mut self.send[len..len + span.len];
                match &sums[synced[span.at]] {
                    Some(t) => t.inplace_op1(&CopyOut {
                        from: span.from,
                        dst: RefCell::new(dst),
                    })?,
                    // Every rank sends the same layout: a variable no loss reached sends zeros.
                    None => dst.fill(0.0),
                }
                len += span.len;
            }
            comm.all_reduce_sum_into(&self.send[..len], &mut self.recv[..len], position)?;
            let mut offset = 0;
            for span in bucket {
                let i = synced[span.at];
                if let Some(t) = &sums[i] {
                    let op = CopyIn {
                        from: span.from,
                        src: &self.recv[offset..offset + span.len],
                        finish,
                        check: check_overflow && !overflow,
                        non_finite: Cell::new(false),
                    };
                    t.inplace_op1(&op)?;
                    overflow |= op.non_finite.get();
                    landed(Landed::Span {
                        at: i,
                        from: span.from,
                        len: span.len,
                        sum: t,
                    });
                    if span.from + span.len == master[i].elem_count() {
                        // Its last part is back: the whole mean is in place.
                        let t = sums[i].take().expect("present");
                        landed(Landed::Whole(i, t));
                    }
                }
                offset += span.len;
            }
            landed(Landed::BucketEnd);
        }
        Ok(overflow)
    }
}

/// What one run of the bucketed sync works on.
pub(crate) struct Work<'a> {
    /// The window's sums, by variable; each complete mean is taken out.
    pub sums: &'a mut [Option<Tensor>],
    /// The variables, whose element counts say when a mean is complete.
    pub master: &'a [Var],
    /// Where the data stands (the position check).
    pub position: u64,
    /// What unpacking does to each value.
    pub finish: Finish,
    /// Whether to look for inf/NaN.
    pub check_overflow: bool,
}

/// What the bucketed sync reports as it goes.
pub(crate) enum Landed<'a> {
    /// Elements `from..from + len` of variable `at`'s mean are in place in its sum.
    Span {
        /// The variable.
        at: usize,
        /// The first element (flattened).
        from: usize,
        /// How many.
        len: usize,
        /// The variable's sum, whose run is now the mean.
        sum: &'a Tensor,
    },
    /// Variable `i`'s mean is complete: its sum, now the mean.
    Whole(usize, Tensor),
    /// A bucket is done.
    BucketEnd,
}

/// The f32 data of a contiguous CPU storage, as `layout` addresses it.
fn f32_slice<'a>(
    storage: &'a mut CpuStorage,
    layout: &Layout,
    name: &str,
) -> candle_core::Result<&'a mut [f32]> {
    let CpuStorage::F32(data) = storage else {
        candle_core::bail!(
            "{name}: expected an f32 gradient, found {:?}",
            storage.dtype()
        )
    };
    let Some((a, b)) = layout.contiguous_offsets() else {
        candle_core::bail!("{name}: expected a contiguous gradient")
    };
    Ok(&mut data[a..b])
}

/// Copies a gradient's values from element `from` on into a slice of the send buffer (it only
/// reads the storage).
struct CopyOut<'a> {
    from: usize,
    dst: RefCell<&'a mut [f32]>,
}

impl InplaceOp1 for CopyOut<'_> {
    fn name(&self) -> &'static str {
        "ivme-gradient-pack"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let src = f32_slice(storage, layout, self.name())?;
        let mut dst = self.dst.borrow_mut();
        let Some(src) = src.get(self.from..self.from + dst.len()) else {
            candle_core::bail!(
                "ivme-gradient-pack: {} values from {} of {}",
                dst.len(),
                self.from,
                src.len()
            )
        };
        dst.copy_from_slice(src);
        Ok(())
    }
}

/// Writes a reduced slice, finished (mean, unscaled), into a gradient's own storage from
/// element `from` on.
struct CopyIn<'a> {
    from: usize,
    src: &'a [f32],
    finish: Finish,
    check: bool,
    non_finite: Cell<bool>,
}

impl InplaceOp1 for CopyIn<'_> {
    fn name(&self) -> &'static str {
        "ivme-gradient-unpack"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let dst = f32_slice(storage, layout, self.name())?;
        let Some(dst) = dst.get_mut(self.from..self.from + self.src.len()) else {
            candle_core::bail!(
                "ivme-gradient-unpack: {} values from {} of {}",
                self.src.len(),
                self.from,
                dst.len()
            )
        };
        let Finish {
            inv_world,
            inv_scale,
        } = self.finish;
        // One plain loop per case, so that it vectorises.
        match inv_scale {
            Some(s) => {
                for (d, &x) in dst.iter_mut().zip(self.src) {
                    *d = (x * inv_world) * s + 0.0;
                }
            }
            None => {
                for (d, &x) in dst.iter_mut().zip(self.src) {
                    *d = x * inv_world;
                }
            }
        }
        if self.check && !dst.iter().all(|v| v.is_finite()) {
            self.non_finite.set(true);
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "bucket_tests.rs"]
mod tests;
