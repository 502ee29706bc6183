//! Freeing a variable's storage and filling it again, the variable itself unchanged: ZeRO-3's
//! way of holding a block's weights only while its segment runs.
//!
//! A candle `Var` cannot change size, and a model keeps its own handles on its weights, so the
//! weights cannot be swapped for other tensors. What can change is the storage behind them:
//! every handle (the model's, the `VarMap`'s, the graph's) shares one, and an in-place op is
//! handed it mutably. [`release`] replaces it with an empty one (the memory is returned at
//! once) and [`fill`] with the whole value again, so the model computes with the same
//! variables, gradients keep their keys, and nothing in the model's code changes. Between the
//! two the variable must not be read: its layout still says its shape, but no element is
//! there (train/sync/gathered.rs keeps the variables of a unit released only outside its
//! segment). CPU storage only; the builder refuses ZeRO-3 elsewhere.

use crate::error::{Error, Result};
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Var};

/// Whether `var` can be released and filled: on the CPU, contiguous from its storage's first
/// element (a variable of its own, as a `VarMap` makes).
pub(crate) fn fits(var: &Var) -> bool {
    var.device().is_cpu() && var.layout().contiguous_offsets() == Some((0, var.elem_count()))
}

/// Frees `var`'s storage: its elements are gone until [`fill`] puts them back.
pub(crate) fn release(var: &Var) -> Result<()> {
    var.as_tensor().inplace_op1(&Release)?;
    Ok(())
}

/// Gives `var` a storage of its whole size again, holding `bytes`: its elements as `wire`
/// (f32, bf16 or f16, native-endian), converted to the variable's dtype as candle's
/// `to_dtype` rounds.
pub(crate) fn fill(var: &Var, bytes: &[u8], wire: DType) -> Result<()> {
    let want = var.elem_count() * wire.size_in_bytes();
    if bytes.len() != want {
        return Err(Error::Usage(format!(
            "ZeRO-3: {} bytes gathered for a variable of {} {wire:?} elements",
            bytes.len(),
            var.elem_count()
        )));
    }
    var.as_tensor().inplace_op1(&Fill {
        bytes,
        wire,
        dtype: var.dtype(),
    })?;
    Ok(())
}

struct Release;

impl InplaceOp1 for Release {
    fn name(&self) -> &'static str {
        "ivme-release-weights"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        *storage = match storage {
            CpuStorage::F32(_) => CpuStorage::F32(Vec::new()),
            CpuStorage::BF16(_) => CpuStorage::BF16(Vec::new()),
            CpuStorage::F16(_) => CpuStorage::F16(Vec::new()),
            CpuStorage::F64(_) => CpuStorage::F64(Vec::new()),
            other => candle_core::bail!(
                "{}: ZeRO-3 shards float weights, not {:?}",
                self.name(),
                candle_core::backend::BackendStorage::dtype(&*other)
            ),
        };
        Ok(())
    }
}

struct Fill<'a> {
    bytes: &'a [u8],
    wire: DType,
    dtype: DType,
}

impl Fill<'_> {
    fn f32s(&self) -> impl Iterator<Item = f32> + '_ {
        self.bytes
            .chunks_exact(4)
            .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn pairs(&self) -> impl Iterator<Item = [u8; 2]> + '_ {
        self.bytes.chunks_exact(2).map(|b| [b[0], b[1]])
    }
}

impl InplaceOp1 for Fill<'_> {
    fn name(&self) -> &'static str {
        "ivme-fill-weights"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        *storage = match (self.dtype, self.wire) {
            (DType::F32, DType::F32) => CpuStorage::F32(self.f32s().collect()),
            (DType::F64, DType::F32) => CpuStorage::F64(self.f32s().map(f64::from).collect()),
            (DType::BF16, DType::F32) => {
                CpuStorage::BF16(self.f32s().map(half::bf16::from_f32).collect())
            }
            (DType::F16, DType::F32) => {
                CpuStorage::F16(self.f32s().map(half::f16::from_f32).collect())
            }
            (DType::BF16, DType::BF16) => {
                CpuStorage::BF16(self.pairs().map(half::bf16::from_ne_bytes).collect())
            }
            (DType::F16, DType::F16) => {
                CpuStorage::F16(self.pairs().map(half::f16::from_ne_bytes).collect())
            }
            (dtype, wire) => {
                candle_core::bail!("{}: cannot fill {dtype:?} from {wire:?}", self.name())
            }
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Module, Tensor};

    /// A released weight frees its memory while the model's own handle on it stays; filled,
    /// the same handle computes with the new values and backward keys its gradient by it.
    #[test]
    fn a_model_computes_with_its_own_handle_after_a_release_and_a_fill() -> Result<()> {
        let w = Var::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
        let linear = candle_nn::Linear::new(w.as_tensor().clone(), None);
        release(&w)?;
        let (storage, _) = w.as_tensor().storage_and_layout();
        match &*storage {
            candle_core::Storage::Cpu(CpuStorage::F32(v)) => assert!(v.is_empty()),
            _ => panic!("an f32 CPU storage"),
        }
        drop(storage);
        assert_eq!(w.dims(), [2, 2]);
        let values = [5f32, 6., 7., 8.];
        fill(&w, bytemuck::cast_slice(&values), DType::F32)?;
        let x = Tensor::new(&[[1f32, 1.]], &Device::Cpu)?;
        let y = linear.forward(&x)?;
        assert_eq!(y.to_vec2::<f32>()?, [[11., 15.]]);
        let grads = y.sum_all()?.backward()?;
        assert_eq!(
            grads.get(w.as_tensor()).unwrap().to_vec2::<f32>()?,
            [[1., 1.], [1., 1.]]
        );
        // bf16 weights filled from f32 round as to_dtype does; filled from bf16, exactly.
        let h = Var::from_tensor(&Tensor::zeros(3, DType::BF16, &Device::Cpu)?)?;
        let wide = [1.0f32 / 3.0, 2.5, -7.1];
        fill(&h, bytemuck::cast_slice(&wide), DType::F32)?;
        let want = Tensor::new(&wide, &Device::Cpu)?.to_dtype(DType::BF16)?;
        assert_eq!(
            h.as_tensor().to_dtype(DType::F32)?.to_vec1::<f32>()?,
            want.to_dtype(DType::F32)?.to_vec1::<f32>()?
        );
        assert!(
            fill(&h, &[0u8; 4], DType::BF16).is_err(),
            "a wrong size is refused"
        );
        Ok(())
    }
}
