//! `(b, heads, t, d)` against `(b, t, heads, d)`: the kernels compute in the first, and
//! [`attention_bthd`](super::attention_bthd)'s tensors lie in the second.

use std::mem::MaybeUninit;

use candle_core::{Layout, Result, Shape};
use rayon::prelude::*;

use super::AttentionOp;

/// The dense `(a, c, b, d)` copy of a dense `(a, b, c, d)` tensor, rows written in parallel.
fn swap_heads_and_time<T: Copy + Send + Sync>(src: &[T], dims: [usize; 4]) -> Vec<T> {
    let mut v = Vec::with_capacity(src.len());
    swap_heads_and_time_into(&mut v.spare_capacity_mut()[..src.len()], src, dims);
    // SAFETY: the swap wrote every one of the `src.len()` elements.
    unsafe { v.set_len(src.len()) };
    v
}

/// Writes every element of `dst`, the dense `(a, c, b, d)` copy of the dense `(a, b, c, d)`
/// `src`, rows `(i, j)` in parallel.
pub(super) fn swap_heads_and_time_into<T: Copy + Send + Sync>(
    dst: &mut [MaybeUninit<T>],
    src: &[T],
    [a, b, c, d]: [usize; 4],
) {
    assert!(dst.len() == src.len() && src.len() == a * b * c * d);
    if b * d == 0 {
        return;
    }
    dst.par_chunks_mut(b * d)
        .with_min_len((16_384 / (b * d)).max(1))
        .enumerate()
        .for_each(|(row, out)| {
            let (i, j) = (row / c, row % c);
            for (k, out) in out.chunks_mut(d).enumerate() {
                let from = ((i * b + k) * c + j) * d;
                for (o, &x) in out.iter_mut().zip(&src[from..from + d]) {
                    o.write(x);
                }
            }
        });
}

impl AttentionOp {
    /// A tensor's layout as the kernels read it, `(b, heads, t, d)`.
    pub(super) fn heads_first(&self, l: &Layout) -> Result<Layout> {
        if self.bthd {
            l.transpose(1, 2)
        } else {
            Ok(l.clone())
        }
    }

    /// A kernel's dense `(b, heads, t, d)` result in the op's own layout.
    pub(super) fn to_own_layout<T: Copy + Send + Sync>(
        &self,
        v: Vec<T>,
        dims: [usize; 4],
    ) -> Vec<T> {
        if self.bthd {
            swap_heads_and_time(&v, dims)
        } else {
            v
        }
    }

    /// The output's shape in the op's own layout.
    pub(super) fn out_shape(&self) -> Shape {
        let [b, h, t, d] = self.dims()[3];
        if self.bthd {
            Shape::from((b, t, h, d))
        } else {
            Shape::from((b, h, t, d))
        }
    }
}
