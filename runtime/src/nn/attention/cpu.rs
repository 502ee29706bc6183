//! The CPU kernels of [`super::attention`]: a forward and a backward that work on blocks of query
//! rows, with gemm for the three products of each block and one pass per row for the softmax.
//!
//! A block of `BLOCK` query rows needs only the keys some row of it sees (the causal and window
//! limits cut the others), so its scores are a `(rows, keys seen)` temporary. The inputs are read
//! through their strides (a transposed `q` is not copied); bf16 and f16 are widened to f32 once
//! per head for `k`, `v` and once per block for `q`, `dO`.

use rayon::prelude::*;

use super::exp;
pub(crate) use super::matrix::View;
use super::matrix::{load, mm, store, Kernel, Mat};

/// Query rows per block: a block's scores are `BLOCK × t_k` f32.
const BLOCK: usize = 64;

/// The fewest units of work the backward splits a kv head's query heads into (when the batch
/// and the kv heads give fewer): enough for the cores of a usual machine, and independent of
/// the thread count so that results are.
const MIN_UNITS: usize = 8;

/// Which keys each query row sees before the additive mask.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub tq: usize,
    pub tk: usize,
    /// Causal (also set by a sliding window).
    pub causal: bool,
    pub window: Option<usize>,
}

impl Geometry {
    /// The keys `[lo, hi)` query row `i` sees; queries are aligned to the end of the keys.
    pub fn visible(&self, i: usize) -> (usize, usize) {
        if !self.causal {
            return (0, self.tk);
        }
        let end = i as isize + self.tk as isize - self.tq as isize + 1;
        let hi = end.clamp(0, self.tk as isize);
        let lo = match self.window {
            // A window longer than the keys is no limit (and keeps the cast in range).
            Some(w) => (end - w.min(self.tk + 1) as isize).clamp(0, hi),
            None => 0,
        };
        (lo as usize, hi as usize)
    }

    /// The keys `[c0, c1)` some row of `[i0, i1)` sees (rows' ranges only move right).
    fn cols(&self, i0: usize, i1: usize) -> (usize, usize) {
        let c0 = self.visible(i0).0;
        (c0, self.visible(i1 - 1).1.max(c0))
    }
}

/// The additive mask in its own (unbroadcast) shape, each of its 4 dims 1 or the scores'.
#[derive(Debug, Clone)]
pub(crate) struct MaskRows {
    pub data: Vec<f32>,
    pub dims: [usize; 4],
}

impl MaskRows {
    /// Row `(b, h, i)`: one value per key, or one for all keys.
    fn row(&self, b: usize, h: usize, i: usize) -> MaskRow<'_> {
        let at = |axis: usize, x: usize| if self.dims[axis] == 1 { 0 } else { x };
        let row = (at(0, b) * self.dims[1] + at(1, h)) * self.dims[2] + at(2, i);
        let len = self.dims[3];
        if len == 1 {
            MaskRow::All(self.data[row])
        } else {
            MaskRow::Keys(&self.data[row * len..(row + 1) * len])
        }
    }
}

/// One row of the additive mask.
enum MaskRow<'a> {
    /// A value per key.
    Keys(&'a [f32]),
    /// One value for every key.
    All(f32),
}

/// The shapes and options of one attention call.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub dv: usize,
    pub geo: Geometry,
    pub scale: f32,
    pub softcap: Option<f32>,
    pub mask: Option<MaskRows>,
}

impl Plan {
    /// Turns the scaled scores of row `i` of head `(b, h)`, keys `c0..c0 + s.len()`, into
    /// `exp(score - max)` in place (zeros where masked) and returns `1 / Σ exp`, the factor that
    /// makes them probabilities (0 when the row sees no key: its probabilities are all zero).
    /// With a softcap, `th` receives `tanh(score / cap)` for the backward.
    fn exps(
        &self,
        b: usize,
        h: usize,
        i: usize,
        c0: usize,
        s: &mut [f32],
        th: Option<&mut [f32]>,
    ) -> f32 {
        let (lo, hi) = self.geo.visible(i);
        let (a, z) = (lo - c0, hi - c0);
        s[..a].fill(0.);
        s[z..].fill(0.);
        let row = &mut s[a..z];
        if let Some(cap) = self.softcap {
            let inv = 1. / cap;
            match th {
                Some(th) => row.iter_mut().zip(&mut th[a..z]).for_each(|(x, t)| {
                    *t = (*x * inv).tanh();
                    *x = cap * *t;
                }),
                None => row.iter_mut().for_each(|x| *x = cap * (*x * inv).tanh()),
            }
        }
        if let Some(mask) = &self.mask {
            match mask.row(b, h, i) {
                MaskRow::Keys(m) => row.iter_mut().zip(&m[lo..hi]).for_each(|(x, m)| *x += m),
                MaskRow::All(m) => row.iter_mut().for_each(|x| *x += m),
            }
        }
        let max = exp::max(row);
        if max == f32::NEG_INFINITY {
            row.fill(0.);
            return 0.;
        }
        1. / exp::exp_sum(row, max)
    }

    /// [`Self::exps`] normalised: the row's probabilities.
    fn probs(
        &self,
        b: usize,
        h: usize,
        i: usize,
        c0: usize,
        s: &mut [f32],
        th: Option<&mut [f32]>,
    ) {
        let inv = self.exps(b, h, i, c0, s, th);
        for x in s.iter_mut() {
            *x *= inv;
        }
    }
}

/// The output `(b, h_q, t_q, d_v)`, dense.
pub(crate) fn forward<T: Kernel>(p: &Plan, q: View<T>, k: View<T>, v: View<T>) -> Vec<T> {
    let Plan { hq, d, dv, geo, .. } = *p;
    let rep = hq / p.hkv;
    let mut out = vec![T::of(0.); p.b * hq * geo.tq * dv];
    out.par_chunks_mut(geo.tq * dv)
        .enumerate()
        .for_each(|(bh, out)| {
            let (b, h) = (bh / hq, bh % hq);
            let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
            let km = load(&k, (b, h / rep), 0..geo.tk, d, &mut kbuf);
            let vm = load(&v, (b, h / rep), 0..geo.tk, dv, &mut vbuf);
            out.par_chunks_mut(BLOCK * dv)
                .enumerate()
                .for_each(|(blk, out)| {
                    let (i0, n) = (blk * BLOCK, out.len() / dv);
                    let (c0, c1) = geo.cols(i0, i0 + n);
                    let w = c1 - c0;
                    if w == 0 {
                        return;
                    }
                    let mut qbuf = Vec::new();
                    let qm = load(&q, (b, h), i0..i0 + n, d, &mut qbuf);
                    let mut s = vec![0f32; n * w];
                    mm(
                        &mut s,
                        w,
                        [n, w, d],
                        false,
                        qm,
                        km.skip_rows(c0).t(),
                        p.scale,
                    );
                    // exp(s - max) · v, then each row divided by its Σ exp.
                    let inv: Vec<f32> = s
                        .chunks_mut(w)
                        .enumerate()
                        .map(|(r, row)| p.exps(b, h, i0 + r, c0, row, None))
                        .collect();
                    let em = Mat::dense(&s, w);
                    store(out, |o| {
                        mm(o, dv, [n, dv, w], false, em, vm.skip_rows(c0), 1.);
                        for (row, inv) in o.chunks_mut(dv).zip(&inv) {
                            for x in row {
                                *x *= inv;
                            }
                        }
                    });
                });
        });
    out
}

/// The gradients of `q`, `k` and `v` (dense, in the inputs' shapes) from `go`, the gradient of
/// the output; the probabilities are recomputed block by block.
pub(crate) fn backward<T: Kernel>(
    p: &Plan,
    [q, k, v, go]: [View<T>; 4],
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
) {
    let Plan {
        hq, hkv, d, geo, ..
    } = *p;
    let (dvw, tk) = (p.dv, geo.tk);
    let rep = hq / hkv;
    // The query heads of a kv head are split into `parts` units (each with its own dk, dv
    // accumulators) only as far as needed for `MIN_UNITS` units of work: a number fixed by the
    // shapes alone, so that the sums, and with them the gradients, are the same bits whatever
    // the number of threads (a rank with one thread and a process with two compute alike).
    let groups = p.b * hkv;
    let parts = (1..=rep)
        .find(|&s| rep % s == 0 && groups * s >= MIN_UNITS)
        .unwrap_or(rep);
    let per = rep / parts;
    let units = groups * parts;
    // With one unit per kv head, f32 gradients accumulate in place.
    let (mut dk_tmp, mut dv_tmp) = (Vec::new(), Vec::new());
    let direct = parts == 1 && T::as_f32(dk).is_some();
    let (dk_acc, dv_acc): (&mut [f32], &mut [f32]) = match (
        T::as_f32_mut(dk).filter(|_| direct),
        T::as_f32_mut(dv).filter(|_| direct),
    ) {
        (Some(a), Some(b)) => (a, b),
        _ => {
            dk_tmp.resize(units * tk * d, 0.);
            dv_tmp.resize(units * tk * dvw, 0.);
            (&mut dk_tmp[..], &mut dv_tmp[..])
        }
    };
    let blocks = |tq: usize| {
        (0..tq)
            .step_by(BLOCK)
            .map(move |i0| (i0, BLOCK.min(tq - i0)))
    };
    dq.par_chunks_mut(per * geo.tq * d)
        .zip(dk_acc.par_chunks_mut(tk * d))
        .zip(dv_acc.par_chunks_mut(tk * dvw))
        .enumerate()
        .for_each(|(u, ((dq, dk), dv))| {
            let (b, kvh) = (u / parts / hkv, u / parts % hkv);
            let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
            let km = load(&k, (b, kvh), 0..tk, d, &mut kbuf);
            let vm = load(&v, (b, kvh), 0..tk, dvw, &mut vbuf);
            let (mut qbuf, mut gbuf) = (Vec::new(), Vec::new());
            for (j, dq) in dq.chunks_mut(geo.tq * d).enumerate() {
                let h = (u * per + j) % hq;
                for (i0, n) in blocks(geo.tq) {
                    let (c0, c1) = geo.cols(i0, i0 + n);
                    let w = c1 - c0;
                    if w == 0 {
                        continue;
                    }
                    let qm = load(&q, (b, h), i0..i0 + n, d, &mut qbuf);
                    let gm = load(&go, (b, h), i0..i0 + n, dvw, &mut gbuf);
                    let mut s = vec![0f32; n * w];
                    mm(
                        &mut s,
                        w,
                        [n, w, d],
                        false,
                        qm,
                        km.skip_rows(c0).t(),
                        p.scale,
                    );
                    let mut th = vec![0f32; if p.softcap.is_some() { n * w } else { 0 }];
                    let mut th_rows = th.chunks_mut(w.max(1));
                    for (r, row) in s.chunks_mut(w).enumerate() {
                        p.probs(b, h, i0 + r, c0, row, th_rows.next());
                    }
                    // dP = dO · Vᵀ, then dS = P ∘ (dP − Σ P ∘ dP), through the softcap's tanh.
                    let mut ds = vec![0f32; n * w];
                    mm(&mut ds, w, [n, w, dvw], false, gm, vm.skip_rows(c0).t(), 1.);
                    for (r, (dr, pr)) in ds.chunks_mut(w).zip(s.chunks(w)).enumerate() {
                        let dot: f32 = dr.iter().zip(pr).map(|(g, p)| g * p).sum();
                        dr.iter_mut().zip(pr).for_each(|(g, p)| *g = p * (*g - dot));
                        if p.softcap.is_some() {
                            let t = &th[r * w..(r + 1) * w];
                            dr.iter_mut().zip(t).for_each(|(g, t)| *g *= 1. - t * t);
                        }
                    }
                    let (dsm, pm) = (Mat::dense(&ds, w), Mat::dense(&s, w));
                    let kc = km.skip_rows(c0);
                    store(&mut dq[i0 * d..(i0 + n) * d], |o| {
                        mm(o, d, [n, d, w], false, dsm, kc, p.scale)
                    });
                    mm(&mut dk[c0 * d..], d, [w, d, n], true, dsm.t(), qm, p.scale);
                    mm(&mut dv[c0 * dvw..], dvw, [w, dvw, n], true, pm.t(), gm, 1.);
                }
            }
        });
    if !direct {
        reduce(&dk_tmp, parts, tk * d, dk);
        reduce(&dv_tmp, parts, tk * dvw, dv);
    }
}

/// `out[g] = Σ_u acc[g · parts + u]`, over chunks of `len` elements (the units of a kv head).
fn reduce<T: Kernel>(acc: &[f32], parts: usize, len: usize, out: &mut [T]) {
    out.par_chunks_mut(len.max(1))
        .enumerate()
        .for_each(|(g, out)| {
            let src = &acc[g * parts * len..(g + 1) * parts * len];
            let mut sum = src[..len].to_vec();
            for part in src[len..].chunks(len) {
                sum.iter_mut().zip(part).for_each(|(s, x)| *s += x);
            }
            out.iter_mut().zip(&sum).for_each(|(o, &x)| *o = T::of(x));
        });
}
