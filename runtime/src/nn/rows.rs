//! Where a tensor's rows lie in its storage, and outputs written row by row without being
//! zero-filled first: what the row-wise fused kernels share.

use std::mem::MaybeUninit;

use candle_core::Layout;
use rayon::prelude::*;

/// Where the rows of a layout lie: `rows` rows of `width` elements, row `r` starting at
/// `start + r * stride`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Rows {
    pub(super) start: usize,
    pub(super) stride: usize,
    pub(super) rows: usize,
    pub(super) width: usize,
}

impl Rows {
    /// The rows of `layout`, or an error naming the op and the input whose layout is not
    /// evenly strided rows (callers make such inputs contiguous first: only a bug of ours).
    pub(super) fn of_op(layout: &Layout, op: &str, what: &str) -> candle_core::Result<Rows> {
        Rows::of(layout).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "ivme::nn::{op}: {what} of layout {layout:?} is not evenly strided rows"
            ))
        })
    }

    /// `rows` dense rows of `width`.
    pub(super) fn dense(rows: usize, width: usize) -> Rows {
        Rows {
            start: 0,
            stride: width,
            rows,
            width,
        }
    }

    /// The rows of `layout`, or `None` when its elements are not evenly strided rows.
    pub(super) fn of(layout: &Layout) -> Option<Rows> {
        let dims = layout.dims();
        let strides = layout.stride();
        let Some((&width, lead)) = dims.split_last() else {
            return Some(Rows {
                start: layout.start_offset(),
                stride: 1,
                rows: 1,
                width: 1,
            });
        };
        if width > 1 && strides[dims.len() - 1] != 1 {
            return None;
        }
        let rows: usize = lead.iter().product();
        // The leading dimensions must fold into one of stride `stride[rank - 2]`.
        let stride = if lead.is_empty() {
            width
        } else {
            strides[lead.len() - 1]
        };
        for i in 0..lead.len().saturating_sub(1) {
            if dims[i] > 1 && strides[i] != strides[i + 1] * dims[i + 1] {
                return None;
            }
        }
        if rows > 1 && stride < width {
            return None;
        }
        Some(Rows {
            start: layout.start_offset(),
            stride,
            rows,
            width,
        })
    }

    /// Rows `first..first + n` of these.
    pub(super) fn skip(self, first: usize, n: usize) -> Rows {
        assert!(first + n <= self.rows);
        Rows {
            start: self.start + first * self.stride,
            rows: n,
            ..self
        }
    }

    pub(super) fn row<'a, T>(&self, data: &'a [T], r: usize) -> &'a [T] {
        let s = self.start + r * self.stride;
        &data[s..s + self.width]
    }
}

/// The fewest rows one rayon task takes, so that short rows are not one task each.
fn min_rows(width: usize) -> usize {
    (16_384 / width.max(1)).max(1)
}

/// A vector of `rows × width` elements whose rows `f(r, row)` writes in parallel, never
/// zero-filled first (`f` must write every element of its row).
pub(super) fn write_rows<T: Copy + Send>(
    rows: usize,
    width: usize,
    f: impl Fn(usize, &mut [MaybeUninit<T>]) + Sync,
) -> Vec<T> {
    let n = rows * width;
    let mut v = Vec::with_capacity(n);
    if width > 0 {
        v.spare_capacity_mut()[..n]
            .par_chunks_mut(width)
            .with_min_len(min_rows(width))
            .enumerate()
            .for_each(|(r, row)| f(r, row));
    }
    // SAFETY: every one of the `n` elements was written by `f` above (each row is `width`
    // elements and `f` writes its whole row), and `T` is `Copy` (no drop to run).
    unsafe { v.set_len(n) };
    v
}
