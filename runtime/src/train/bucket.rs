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
/// [`GradientState::position`](crate::train::grads::GradientState::position)); every rank must pass
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
    #[allow(clippy::too_many_arguments)]
    pub fn sync(
        &mut self,
        comm: &dyn Communicator,
        sums: &mut [Option<Tensor>],
        master: &[Var],
        synced: &[usize],
        position: u64,
        bucket_bytes: usize,
        finish: Finish,
        check_overflow: bool,
        store: &mut GradStore,
    ) -> Result<bool> {
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
        let Some((_, _, buckets)) = &self.layout else {
            unreachable!("laid out above")
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
                    if span.from + span.len == master[i].elem_count() {
                        // Its last part is back: the whole mean is in place.
                        let t = sums[i].take().expect("present");
                        store.insert(master[i].as_tensor(), t);
                    }
                }
                offset += span.len;
            }
        }
        Ok(overflow)
    }
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
mod tests {
    use super::*;

    #[test]
    fn buckets_hold_at_most_their_bytes_and_big_variables_travel_alone() {
        assert_eq!(cut([10, 10, 10], 80), vec![0..2, 2..3]);
        assert_eq!(cut([100, 1, 1], 80), vec![0..1, 1..3]);
        assert_eq!(cut([1, 100, 1], 80), vec![0..1, 1..2, 2..3]);
        assert_eq!(cut(Vec::<usize>::new(), 80), Vec::<Range<usize>>::new());
    }

    #[test]
    fn chunks_fill_every_bucket_and_cut_variables_across_them() {
        let span = |at, from, len| Span { at, from, len };
        // 10 elements per bucket.
        assert_eq!(
            chunks([4, 25, 3], 40),
            vec![
                vec![span(0, 0, 4), span(1, 0, 6)],
                vec![span(1, 6, 10)],
                vec![span(1, 16, 9), span(2, 0, 1)],
                vec![span(2, 1, 2)],
            ]
        );
        assert_eq!(chunks([10], 40), vec![vec![span(0, 0, 10)]]);
        assert!(chunks(Vec::<usize>::new(), 40).is_empty());
    }

    /// A variable larger than a bucket is cut across buckets: the buffers stay one bucket each,
    /// every part comes back finished, and an overflow in a later part is seen.
    #[test]
    fn a_variable_larger_than_a_bucket_syncs_through_one_bucket_buffers() -> Result<()> {
        let d = candle_core::Device::Cpu;
        let vars = [
            Var::zeros(1000, DType::F32, &d)?,
            Var::zeros(7, DType::F32, &d)?,
        ];
        let g0 = Tensor::arange(0f32, 1000.0, &d)?;
        let g1 = Tensor::arange(0f32, 7.0, &d)?;
        let mut sums = vec![Some(g0.copy()?), Some(g1.copy()?)];
        let mut bufs = SyncBuffers::default();
        assert!(bufs.fits(&sums));
        let mut store = GradStore::default();
        let finish = Finish {
            inv_world: 0.5,
            inv_scale: Some(0.25),
        };
        let comm = crate::comm::SingleComm;
        // Buckets of 100 values.
        let of = bufs.sync(
            &comm,
            &mut sums,
            &vars,
            &[0, 1],
            0,
            400,
            finish,
            true,
            &mut store,
        )?;
        assert!(!of);
        assert_eq!(bufs.bytes(), 2 * 100 * 4);
        for (v, g) in vars.iter().zip([g0, g1]) {
            let want = ((g * 0.5)? * 0.25)?.to_vec1::<f32>()?;
            assert_eq!(store.get(v.as_tensor()).unwrap().to_vec1::<f32>()?, want);
        }
        assert!(sums.iter().all(Option::is_none));
        let mut late = vec![0f32; 1000];
        late[950] = f32::NAN;
        let mut sums = vec![Some(Tensor::new(late.as_slice(), &d)?), None];
        assert!(bufs.sync(
            &comm,
            &mut sums,
            &vars,
            &[0, 1],
            0,
            400,
            finish,
            true,
            &mut store
        )?);
        Ok(())
    }

    #[test]
    fn gradients_sharing_memory_take_the_general_path() -> Result<()> {
        let d = candle_core::Device::Cpu;
        let a = Tensor::arange(0f32, 8.0, &d)?;
        let b = Tensor::arange(0f32, 4.0, &d)?;
        let mut bufs = SyncBuffers::default();
        assert!(bufs.fits(&[Some(a.clone()), None, Some(b)]));
        let view = a.narrow(0, 2, 3)?;
        assert!(!bufs.fits(&[Some(a.clone()), Some(view)]));
        assert!(!bufs.fits(&[Some(a.to_dtype(DType::F16)?)]));
        assert!(!bufs.fits(&[Some(a.reshape((2, 4))?.t()?)]));
        Ok(())
    }

    #[test]
    fn one_process_sync_writes_the_finished_values_into_the_sums() -> Result<()> {
        let d = candle_core::Device::Cpu;
        let vars = [
            Var::zeros(3, DType::F32, &d)?,
            Var::zeros(2, DType::F32, &d)?,
        ];
        let g0 = Tensor::new(&[1f32, -2.0, 4.0], &d)?;
        let mut sums = vec![Some(g0.clone()), None];
        let mut bufs = SyncBuffers::default();
        assert!(bufs.fits(&sums));
        let mut store = GradStore::default();
        let finish = Finish {
            inv_world: 0.5,
            inv_scale: Some(0.25),
        };
        let comm = crate::comm::SingleComm;
        let of = bufs.sync(
            &comm,
            &mut sums,
            &vars,
            &[0, 1],
            0,
            1 << 20,
            finish,
            true,
            &mut store,
        )?;
        assert!(!of);
        let reference = ((Tensor::new(&[1f32, -2.0, 4.0], &d)? * 0.5)? * 0.25)?;
        let got = store.get(vars[0].as_tensor()).unwrap();
        assert_eq!(got.to_vec1::<f32>()?, reference.to_vec1::<f32>()?);
        assert!(store.get(vars[1].as_tensor()).is_none());
        assert!(sums.iter().all(Option::is_none));
        let mut sums = vec![Some(Tensor::new(&[f32::INFINITY, 0.0, 0.0], &d)?), None];
        assert!(bufs.sync(
            &comm,
            &mut sums,
            &vars,
            &[0, 1],
            0,
            1 << 20,
            finish,
            true,
            &mut store
        )?);
        Ok(())
    }

    /// Only the variables `synced` lists are laid out in the buckets: a frozen one moves no
    /// bytes, keeps whatever sum it has, and gets no gradient.
    #[test]
    fn the_buckets_lay_out_the_synced_variables_only() -> Result<()> {
        let d = candle_core::Device::Cpu;
        let vars = [
            Var::zeros(1000, DType::F32, &d)?,
            Var::zeros(3, DType::F32, &d)?,
        ];
        let frozen = Tensor::ones(1000, DType::F32, &d)?;
        let mut sums = vec![
            Some(frozen.clone()),
            Some(Tensor::new(&[2f32, 4.0, 6.0], &d)?),
        ];
        let mut bufs = SyncBuffers::default();
        assert!(bufs.fits(&sums));
        let mut store = GradStore::default();
        let finish = Finish {
            inv_world: 0.5,
            inv_scale: None,
        };
        let comm = crate::comm::SingleComm;
        bufs.sync(
            &comm,
            &mut sums,
            &vars,
            &[1],
            0,
            1 << 20,
            finish,
            false,
            &mut store,
        )?;
        // Send and receive buffers sized for the 3 synced values, not the 1003.
        assert_eq!(bufs.bytes(), 2 * 3 * 4);
        let got = store.get(vars[1].as_tensor()).unwrap();
        assert_eq!(got.to_vec1::<f32>()?, vec![1.0, 2.0, 3.0]);
        assert!(store.get(vars[0].as_tensor()).is_none());
        assert!(sums[0].is_some() && sums[1].is_none());
        Ok(())
    }
}
