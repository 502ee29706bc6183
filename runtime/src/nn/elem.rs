//! The element types the CPU kernels take, each read and written as f32.

use candle_core::{CpuStorage, DType, Layout, Result};
use half::{bf16, f16};

/// A float the fused CPU kernels read and write; their arithmetic is f32.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    /// Widens to f32.
    fn f32(self) -> f32;
    /// Rounds an f32 to this type.
    fn of(v: f32) -> Self;
}

impl Elem for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn of(v: f32) -> Self {
        v
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn of(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn of(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// The contiguous elements a layout covers, or an error naming the op (its callers make their
/// inputs contiguous first, so this only fails on a bug of ours).
pub(crate) fn contiguous<'a, T>(data: &'a [T], layout: &Layout, op: &str) -> Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => candle_core::bail!("ivme::nn::{op}: expected a contiguous input"),
    }
}

/// The error for a dtype a kernel does not take, naming the op and the dtypes it does.
pub(crate) fn unsupported(op: &str, dtype: DType) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "ivme::nn::{op} takes f32, bf16 or f16 tensors, not {dtype:?}"
    ))
}

/// The dtype of a CPU storage (for error messages).
pub(crate) fn dtype_of(s: &CpuStorage) -> DType {
    candle_core::backend::BackendStorage::dtype(s)
}

/// The error for CPU storages of mixed dtypes or of one the kernels do not take, naming the op.
pub(crate) fn mixed(op: &str, storages: &[&CpuStorage]) -> candle_core::Error {
    let dtypes: Vec<DType> = storages.iter().map(|s| dtype_of(s)).collect();
    match dtypes
        .iter()
        .find(|d| !matches!(d, DType::F32 | DType::BF16 | DType::F16))
    {
        Some(&d) => unsupported(op, d),
        None => candle_core::Error::Msg(format!("ivme::nn::{op}: mixed dtypes {dtypes:?}")),
    }
}
