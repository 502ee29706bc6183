//! Stage 2's collectives, a quarter bucket at a time: the reduce-scatter of the window's sums
//! and the all-gather of the updated slices.
//!
//! The flat parameter space (shard.rs) is walked in chunks of a quarter of `bucket_bytes`
//! (see [`chunk`]). Each chunk is one collective whose per-rank counts are the parts of the
//! chunk that each rank's slice holds (zero for most ranks: slices are contiguous), so the
//! elements land exactly where one whole-space collective would put them. Two chunk-sized host
//! buffers carry every chunk, and a window sum is dropped as soon as its last element is
//! packed, so the sync never holds a second copy of the whole gradient (or, gathering, of the
//! whole weights) on top of the one candle's backward made. Gathered weights are written
//! straight into the variables' own CPU storage; elsewhere (a GPU) each variable is assembled
//! and set once.

use super::WindowEnd;
use crate::comm::Communicator;
use crate::error::Result;
use crate::optim::fused;
use crate::train::bucket::SyncBuffers;
use crate::train::shard::{Partial, Sharded};
use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Tensor, Var};

/// Elements of `elem_bytes` each in one collective's chunk. Stage 2 stages its collectives
/// through four host buffers (the reduce-scatter's send and receive buffers, the all-gather's
/// own part and result), a quarter of a bucket each, so that together they take one bucket:
/// the allocator keeps freed blocks of that size for the next step (under `ivme launch`'s
/// settings), and four bucket-sized ones raised a step's peak by as much (bench_zero, 2 ranks:
/// 774 MiB against 717 with quarter buckets, at the same speed).
fn chunk(bucket_bytes: usize, elem_bytes: usize) -> usize {
    (bucket_bytes / 4 / elem_bytes).max(1)
}

/// Where each rank's slice starts in the flat space, then where the last one ends.
fn bounds(counts: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(counts.len() + 1);
    let mut at = 0;
    out.push(0);
    for c in counts {
        at += c;
        out.push(at);
    }
    out
}

/// The flat ranges of the parameters `skip` leaves in (consecutive ones merged): what a
/// collective over the flat space has to carry.
fn kept(offsets: &[usize], sizes: &[usize], skip: impl Fn(usize) -> bool) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for i in (0..sizes.len()).filter(|&i| !skip(i) && sizes[i] > 0) {
        let (a, b) = (offsets[i], offsets[i] + sizes[i]);
        match out.last_mut() {
            Some(last) if last.1 == a => last.1 = b,
            _ => out.push((a, b)),
        }
    }
    out
}

/// The chunks of at most `step` elements the ranges `kept` are walked in.
fn chunks(kept: &[(usize, usize)], step: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
    kept.iter()
        .flat_map(move |&(a, b)| (a..b).step_by(step).map(move |x| (x, (x + step).min(b))))
}

/// How many elements of the flat range `a..b` each rank's slice holds.
fn shares(bounds: &[usize], a: usize, b: usize) -> Vec<usize> {
    bounds
        .windows(2)
        .map(|w| b.min(w[1]).saturating_sub(a.max(w[0])))
        .collect()
}

/// The parameters of `offsets`/`sizes` that overlap the flat range `a..b`, each with the
/// overlap (flat `from..to`) and its first element within the parameter.
fn overlapping<'a>(
    offsets: &'a [usize],
    sizes: &'a [usize],
    a: usize,
    b: usize,
) -> impl Iterator<Item = (usize, usize, usize)> + 'a {
    let first = offsets.partition_point(|&o| o < a).saturating_sub(1);
    (first..offsets.len())
        .take_while(move |&i| offsets[i] < b)
        .filter_map(move |i| {
            let (from, to) = (a.max(offsets[i]), b.min(offsets[i] + sizes[i]));
            (from < to).then_some((i, from, to))
        })
}

/// Copies elements `from..from + dst.len()` of flattened `t` into `dst`; in place for f32 CPU
/// tensors, through a copy of that part only elsewhere.
pub(super) fn copy_out(t: &Tensor, from: usize, dst: &mut [f32]) -> Result<()> {
    if fused::fits(t) {
        fused::with_ref(t, |data| {
            dst.copy_from_slice(&data[from..from + dst.len()]);
            Ok(())
        })?;
    } else {
        let part = t.flatten_all()?.narrow(0, from, dst.len())?;
        dst.copy_from_slice(&part.to_dtype(DType::F32)?.to_vec1::<f32>()?);
    }
    Ok(())
}

/// Writes the (native-endian) bytes of `t`'s elements in `wire` (f32, bf16 or f16) into `out`
/// (exactly their size), rounded as candle's `to_dtype` rounds (`from_f32`). An f32 CPU tensor
/// (a master) is read in place, with no intermediate tensor or vector.
pub(super) fn write_bytes(t: &Tensor, wire: DType, out: &mut [u8]) -> Result<()> {
    if fused::fits(t) {
        fused::with_ref(t, |data| {
            match wire {
                DType::BF16 => out
                    .chunks_exact_mut(2)
                    .zip(data)
                    .for_each(|(o, &x)| o.copy_from_slice(&half::bf16::from_f32(x).to_ne_bytes())),
                DType::F16 => out
                    .chunks_exact_mut(2)
                    .zip(data)
                    .for_each(|(o, &x)| o.copy_from_slice(&half::f16::from_f32(x).to_ne_bytes())),
                _ => out.copy_from_slice(bytemuck::cast_slice(data)),
            }
            Ok(())
        })?;
        return Ok(());
    }
    let t = t.to_dtype(wire)?;
    let bytes: Vec<u8> = match wire {
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|x| x.to_ne_bytes())
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|x| x.to_ne_bytes())
            .collect(),
        _ => t
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|x| x.to_ne_bytes())
            .collect(),
    };
    out.copy_from_slice(&bytes);
    Ok(())
}

/// Writes elements given as `wire` bytes into a contiguous CPU tensor's own storage, from its
/// element `at` on, converted to the storage's dtype as candle's `to_dtype` would.
struct WriteAt<'a> {
    at: usize,
    bytes: &'a [u8],
    wire: DType,
}

impl WriteAt<'_> {
    /// Whether `var` can be written this way: on the CPU, contiguous, and in a dtype the wire
    /// converts to exactly.
    fn fits(var: &Var, wire: DType) -> bool {
        let dtype = var.dtype();
        var.device().is_cpu()
            && var.layout().contiguous_offsets().is_some()
            && (dtype == wire
                || (wire == DType::F32 && matches!(dtype, DType::BF16 | DType::F16 | DType::F64)))
    }
}

impl InplaceOp1 for WriteAt<'_> {
    fn name(&self) -> &'static str {
        "ivme-write-gathered"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, _)) = layout.contiguous_offsets() else {
            candle_core::bail!("{}: the variable is not contiguous", self.name());
        };
        let at = start + self.at;
        let f32s = || {
            self.bytes
                .chunks_exact(4)
                .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        };
        let pairs = || self.bytes.chunks_exact(2).map(|b| [b[0], b[1]]);
        match (storage, self.wire) {
            (CpuStorage::F32(d), DType::F32) => {
                let n = self.bytes.len() / 4;
                bytemuck::cast_slice_mut::<f32, u8>(&mut d[at..at + n]).copy_from_slice(self.bytes)
            }
            (CpuStorage::F64(d), DType::F32) => d[at..]
                .iter_mut()
                .zip(f32s())
                .for_each(|(x, v)| *x = v as f64),
            (CpuStorage::BF16(d), DType::F32) => d[at..]
                .iter_mut()
                .zip(f32s())
                .for_each(|(x, v)| *x = half::bf16::from_f32(v)),
            (CpuStorage::F16(d), DType::F32) => d[at..]
                .iter_mut()
                .zip(f32s())
                .for_each(|(x, v)| *x = half::f16::from_f32(v)),
            (CpuStorage::BF16(d), DType::BF16) => d[at..]
                .iter_mut()
                .zip(pairs())
                .for_each(|(x, b)| *x = half::bf16::from_ne_bytes(b)),
            (CpuStorage::F16(d), DType::F16) => d[at..]
                .iter_mut()
                .zip(pairs())
                .for_each(|(x, b)| *x = half::f16::from_ne_bytes(b)),
            (s, wire) => candle_core::bail!(
                "{}: cannot write {wire:?} values into {:?} storage",
                self.name(),
                BackendStorage::dtype(&*s)
            ),
        }
        Ok(())
    }
}

impl Sharded {
    /// Stage 2: every rank sends its window sums (`sums`, each dropped once packed), bucket by
    /// bucket, and receives its slice's sum, which becomes the mean gradient of each piece in
    /// `store`, with this process's share of the overflow check and of the squared norm. The
    /// variables `skip` flags (stage 3's units, whose slices were summed during backward) are
    /// not sent.
    pub(in crate::train) fn reduce_scatter(
        &self,
        end: &WindowEnd,
        buffers: &mut SyncBuffers,
        sums: &mut [Option<Tensor>],
        want_norm: bool,
        skip: &[bool],
        store: &mut GradStore,
    ) -> Result<Partial> {
        let (comm, position, inv_scale) = (end.comm, end.position, end.inv_scale);
        let (bucket_bytes, check_overflow) = (end.settings.bucket_bytes(), end.check_overflow);
        let plan = &self.plan;
        let (world, rank) = (comm.world_size(), comm.rank());
        let present: Vec<bool> = sums.iter().map(Option::is_some).collect();
        // A piece that is a whole variable (the usual case) receives its mean into the window
        // sum's own storage, as the unsharded sync does, and hands that on: no second buffer
        // for it. That needs sums on the CPU, in f32, that share no memory (`fits`; `buffers`
        // only lends its scratch for that check); the other pieces (at most the first and the
        // last of the slice) get a run of their own.
        let in_place = buffers.fits(sums);
        let mut whole_piece: Vec<Option<usize>> = vec![None; plan.sizes.len()];
        for (k, p) in plan.pieces.iter().enumerate() {
            if in_place && present[p.param] && p.from == 0 && p.len == plan.sizes[p.param] {
                whole_piece[p.param] = Some(k);
            }
        }
        let total: usize = plan.sizes.iter().sum();
        let bounds = bounds(&plan.counts);
        let (lo, hi) = (bounds[rank], bounds[rank + 1]);
        let step = chunk(bucket_bytes, 4);
        let mut send = vec![0f32; step.min(total)];
        let mut recv = vec![0f32; step.min(hi - lo)];
        let factor = (inv_scale / world as f64) as f32;
        let mut runs: Vec<Vec<f32>> = plan
            .pieces
            .iter()
            .map(|p| match whole_piece[p.param] {
                Some(_) => Vec::new(),
                None => Vec::with_capacity(p.len),
            })
            .collect();
        let mut partial = Partial::default();
        let kept = kept(&plan.offsets, &plan.sizes, |i| skip[i]);
        for (a, b) in chunks(&kept, step) {
            for (i, from, to) in overlapping(&plan.offsets, &plan.sizes, a, b) {
                let off = plan.offsets[i];
                let dst = &mut send[from - a..to - a];
                match &sums[i] {
                    Some(g) => copy_out(g, from - off, dst)?,
                    // Every rank sends the same layout: a variable without a gradient, zeros.
                    None => dst.fill(0.0),
                }
                if to == off + plan.sizes[i] && whole_piece[i].is_none() {
                    // Its last element is packed: the whole gradient is not needed any more.
                    sums[i] = None;
                }
            }
            let counts = shares(&bounds, a, b);
            let got = &mut recv[..counts[rank]];
            comm.reduce_scatter_sum_into(&send[..b - a], got, &counts, position)?;
            // `got` holds the flat elements `first..first + got.len()`.
            let first = a.max(lo);
            for (p, run) in plan.pieces.iter().zip(runs.iter_mut()) {
                let start = plan.offsets[p.param] + p.from;
                let (from, to) = (start.max(first), (start + p.len).min(first + got.len()));
                if from >= to || !present[p.param] {
                    continue;
                }
                let mean = got[from - first..to - first].iter().map(|x| x * factor);
                if check_overflow || want_norm {
                    for x in mean.clone() {
                        partial.overflow |= check_overflow && !x.is_finite();
                        if want_norm {
                            partial.squares += (x as f64) * (x as f64);
                        }
                    }
                }
                match (whole_piece[p.param], &sums[p.param]) {
                    // Elements already packed: writing them cannot change what is sent.
                    (Some(_), Some(sum)) => fused::with_mut(sum, |data| {
                        let at = from - start;
                        data[at..at + (to - from)]
                            .iter_mut()
                            .zip(mean)
                            .for_each(|(d, x)| *d = x);
                        Ok(())
                    })?,
                    _ => run.extend(mean),
                }
            }
        }
        for (k, ((p, m), run)) in plan.pieces.iter().zip(&self.masters).zip(runs).enumerate() {
            if !present[p.param] {
                continue;
            }
            let g = match whole_piece[p.param] {
                Some(_) => sums[p.param]
                    .take()
                    .expect("a whole piece keeps its sum")
                    .reshape(self.piece_shape(k))?,
                None => Tensor::from_vec(run, self.piece_shape(k), m.device())?,
            };
            store.insert(m.as_tensor(), g);
        }
        sums.iter_mut().for_each(|s| *s = None);
        Ok(partial)
    }

    /// Writes every process's updated slice into the model's weights, chunk by chunk.
    /// Weights in bf16/f16 travel at their own size, half of f32's: each process rounds its own
    /// slice, which gives the values the f32 gather would have rounded to. Variables flagged in
    /// `skip` (a model's buffers, which hold their own value) keep it, and their dtype does not
    /// count. Where this process's masters are the weights themselves (f32), its own slice is
    /// in place already and only the other processes' parts are written; on one process with
    /// every master in place there is nothing to do.
    pub(crate) fn gather_into(
        &self,
        comm: &dyn Communicator,
        bucket_bytes: usize,
        compute: &[Var],
        skip: Option<&[bool]>,
    ) -> Result<()> {
        let plan = &self.plan;
        let skipped = |i: usize| skip.is_some_and(|s| s[i]);
        let mut weights = compute.iter().enumerate().filter(|(i, _)| !skipped(*i));
        let dtype = weights
            .clone()
            .next()
            .map_or(DType::F32, |(_, v)| v.dtype());
        let half =
            matches!(dtype, DType::BF16 | DType::F16) && weights.all(|(_, v)| v.dtype() == dtype);
        let (wire, eb) = if half { (dtype, 2) } else { (DType::F32, 4) };
        let total: usize = plan.sizes.iter().sum();
        let bounds = bounds(&plan.counts);
        let (lo, hi) = (bounds[comm.rank()], bounds[comm.rank() + 1]);
        // The variables whose part in this slice the optimizer updated in place.
        let mut in_place = vec![false; compute.len()];
        for (p, &aliased) in plan.pieces.iter().zip(&self.aliased) {
            in_place[p.param] = aliased && WriteAt::fits(&compute[p.param], wire);
        }
        if comm.world_size() == 1
            && plan
                .pieces
                .iter()
                .all(|p| in_place[p.param] || skipped(p.param))
        {
            return Ok(());
        }
        let step = chunk(bucket_bytes, eb);
        let mut whole = vec![0u8; step.min(total) * eb];
        let mut mine = vec![0u8; step.min(hi - lo) * eb];
        // Variables that cannot be written in place (not on the CPU), assembled whole.
        let mut staged: Vec<Option<Vec<u8>>> = vec![None; compute.len()];
        // Skipped variables (buffers, stage 3's units) are not carried at all.
        let kept = kept(&plan.offsets, &plan.sizes, skipped);
        for (a, b) in chunks(&kept, step) {
            let mut len = 0;
            for (k, p) in plan.pieces.iter().enumerate() {
                let start = plan.offsets[p.param] + p.from;
                let (from, to) = (start.max(a), (start + p.len).min(b));
                if from < to {
                    let dst = &mut mine[len..len + (to - from) * eb];
                    write_bytes(
                        &self.flat(k)?.narrow(0, from - start, to - from)?,
                        wire,
                        dst,
                    )?;
                    len += dst.len();
                }
            }
            debug_assert_eq!(len, b.min(hi).saturating_sub(a.max(lo)) * eb);
            let counts = shares(&bounds, a, b);
            let got = &mut whole[..(b - a) * eb];
            comm.all_gather_into(&mine[..len], got, &counts, eb)?;
            for (i, from, to) in overlapping(&plan.offsets, &plan.sizes, a, b) {
                if skipped(i) {
                    continue;
                }
                let (var, off) = (&compute[i], plan.offsets[i]);
                let bytes = &got[(from - a) * eb..(to - a) * eb];
                if WriteAt::fits(var, wire) {
                    // Around this slice when the variable's part in it is in place already.
                    let parts = match in_place[i] {
                        true => [(from, to.min(lo)), (from.max(hi), to)],
                        false => [(from, to), (to, to)],
                    };
                    for (x, y) in parts.into_iter().filter(|(x, y)| x < y) {
                        var.as_tensor().inplace_op1(&WriteAt {
                            at: x - off,
                            bytes: &got[(x - a) * eb..(y - a) * eb],
                            wire,
                        })?;
                    }
                    continue;
                }
                let buf = staged[i].get_or_insert_with(|| Vec::with_capacity(plan.sizes[i] * eb));
                buf.extend_from_slice(bytes);
                if to == off + plan.sizes[i] {
                    let buf = staged[i].take().unwrap_or_default();
                    let t = Tensor::from_raw_buffer(&buf, wire, var.dims(), var.device())?;
                    var.set(&t.to_dtype(var.dtype())?)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_is_cut_where_the_ranks_slices_meet() {
        let b = bounds(&[3, 4, 4]);
        assert_eq!(b, vec![0, 3, 7, 11]);
        assert_eq!(shares(&b, 0, 11), vec![3, 4, 4]);
        assert_eq!(shares(&b, 2, 5), vec![1, 2, 0]);
        assert_eq!(shares(&b, 8, 11), vec![0, 0, 3]);
        let (offsets, sizes) = ([0, 6, 7], [6, 1, 4]);
        let seen: Vec<_> = overlapping(&offsets, &sizes, 5, 8).collect();
        assert_eq!(seen, vec![(0, 5, 6), (1, 6, 7), (2, 7, 8)]);
        let seen: Vec<_> = overlapping(&offsets, &sizes, 0, 3).collect();
        assert_eq!(seen, vec![(0, 0, 3)]);
        // Skipped parameters leave gaps; neighbours merge; chunks stop at each range's end.
        let (offsets, sizes) = ([0, 6, 7, 11], [6, 1, 4, 2]);
        let ranges = kept(&offsets, &sizes, |i| i == 1);
        assert_eq!(ranges, vec![(0, 6), (7, 13)]);
        let walked: Vec<_> = chunks(&ranges, 4).collect();
        assert_eq!(walked, vec![(0, 4), (4, 6), (7, 11), (11, 13)]);
    }
}
