//! The attention kernels' matrices: a 4-d tensor read through its layout, an f32 matrix view,
//! one head's rows widened to f32, a product through gemm on the calling thread, and a block
//! written back in the tensor's dtype.

use crate::nn::elem::Elem;
use candle_core::{Layout, Result};
use half::{bf16, f16};

/// An element type the kernels take: f32 is used in place, the half types are widened.
pub(crate) trait Kernel: Elem {
    /// The elements as f32 when they are f32.
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    /// The elements as mutable f32 when they are f32.
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]>;
}

impl Kernel for f32 {
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]> {
        Some(s)
    }
}

macro_rules! widened {
    ($t:ty) => {
        impl Kernel for $t {
            fn as_f32(_: &[Self]) -> Option<&[f32]> {
                None
            }
            fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
                None
            }
        }
    };
}
widened!(bf16);
widened!(f16);

/// A 4-d tensor's elements read through its layout.
#[derive(Clone, Copy)]
pub(crate) struct View<'a, T> {
    data: &'a [T],
    start: usize,
    stride: [usize; 4],
}

impl<'a, T> View<'a, T> {
    /// Checks that `layout` has the `dims` expected and lies inside `data`.
    pub fn new(data: &'a [T], layout: &Layout, dims: [usize; 4], what: &str) -> Result<Self> {
        if layout.dims() != dims {
            candle_core::bail!(
                "ivme::nn::attention: {what} has shape {:?}, expected {dims:?}",
                layout.dims()
            )
        }
        let s = layout.stride();
        let stride = [s[0], s[1], s[2], s[3]];
        let reach: usize = (0..4).map(|a| (dims[a] - 1) * stride[a]).sum();
        if layout.start_offset() + reach >= data.len() {
            candle_core::bail!("ivme::nn::attention: {what}'s layout lies outside its storage")
        }
        Ok(Self {
            data,
            start: layout.start_offset(),
            stride,
        })
    }
}

/// An f32 matrix: element `(r, c)` is `data[off + r * rs + c * cs]`.
#[derive(Clone, Copy)]
pub(super) struct Mat<'a> {
    data: &'a [f32],
    off: usize,
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    pub(super) fn dense(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            off: 0,
            rs: cols,
            cs: 1,
        }
    }
    /// The matrix without its first `r` rows.
    pub(super) fn skip_rows(self, r: usize) -> Self {
        Self {
            off: self.off + r * self.rs,
            ..self
        }
    }
    pub(super) fn t(self) -> Self {
        Self {
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
    /// Panics unless a `rows × cols` matrix lies inside `data` (what makes `mm` sound).
    pub(super) fn check(&self, rows: usize, cols: usize) {
        assert!(self.off + (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len());
    }
}

/// Rows `r0..r0 + n` (`cols` wide) of head `(b, h)` as f32: in place for f32, else widened into `buf`.
pub(super) fn load<'a, T: Kernel>(
    v: &View<'a, T>,
    (b, h): (usize, usize),
    rows: std::ops::Range<usize>,
    cols: usize,
    buf: &'a mut Vec<f32>,
) -> Mat<'a> {
    let (r0, n) = (rows.start, rows.len());
    let base = v.start + b * v.stride[0] + h * v.stride[1] + r0 * v.stride[2];
    if let Some(data) = T::as_f32(v.data) {
        return Mat {
            data,
            off: base,
            rs: v.stride[2],
            cs: v.stride[3],
        };
    }
    buf.clear();
    buf.reserve(n * cols);
    for r in 0..n {
        let row = base + r * v.stride[2];
        if v.stride[3] == 1 {
            buf.extend(v.data[row..row + cols].iter().map(|x| x.f32()));
        } else {
            buf.extend((0..cols).map(|c| v.data[row + c * v.stride[3]].f32()));
        }
    }
    Mat::dense(buf, cols)
}

/// `dst = beta · a · b` (`m × n`, row stride `ld`), or `dst += beta · a · b` when `acc`;
/// `a` is `m × k`, `b` is `k × n`.
pub(super) fn mm(
    dst: &mut [f32],
    ld: usize,
    [m, n, k]: [usize; 3],
    acc: bool,
    a: Mat,
    b: Mat,
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!((m - 1) * ld + n <= dst.len());
    if k == 0 {
        if !acc {
            (0..m).for_each(|r| dst[r * ld..r * ld + n].fill(0.));
        }
        return;
    }
    a.check(m, k);
    b.check(k, n);
    // SAFETY: the three matrices lie inside their slices (checked above), `dst` is borrowed
    // mutably so it aliases neither input, and gemm runs on this thread only.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            ld as isize,
            acc,
            a.data.as_ptr().add(a.off),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr().add(b.off),
            b.cs as isize,
            b.rs as isize,
            1f32,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Writes `n × cols` values computed by `f` into `dst` (dense, T): directly for f32, else
/// through an f32 block.
pub(super) fn store<T: Kernel>(dst: &mut [T], f: impl FnOnce(&mut [f32])) {
    match T::as_f32_mut(dst) {
        Some(d) => f(d),
        None => {
            let mut buf = vec![0f32; dst.len()];
            f(&mut buf);
            dst.iter_mut().zip(&buf).for_each(|(d, &x)| *d = T::of(x));
        }
    }
}
