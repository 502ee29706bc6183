//! Applying a staged tensor to a variable by moving its buffer in rather than copying it: the
//! last step of a load that read every file once into staging buffers.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp1, Layout, Tensor, Var};

use super::format::TensorInfo;
use super::read::{bytes_of, into_tensor, zeroed};
use crate::error::Result;

/// Moves buffers between tensors' storages ([`move_into`]'s two steps).
struct Exchange {
    slot: Mutex<Option<CpuStorage>>,
    /// Whether the second step found a buffer of the same dtype and size to swap with.
    swapped: AtomicBool,
}

/// Takes a tensor's whole buffer out, leaving it an empty one of the same dtype.
struct Take<'a>(&'a Exchange);
/// Swaps a tensor's buffer with the taken one, if they have the same dtype and size.
struct Put<'a>(&'a Exchange);

impl InplaceOp1 for Take<'_> {
    fn name(&self) -> &'static str {
        "ivme-take-staged-buffer"
    }
    fn cpu_fwd(&self, storage: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        let empty = zeroed(Path::new(""), storage.dtype(), 0).map_err(candle_core::Error::wrap)?;
        *self.0.slot.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(std::mem::replace(storage, empty));
        Ok(())
    }
}

impl InplaceOp1 for Put<'_> {
    fn name(&self) -> &'static str {
        "ivme-put-staged-buffer"
    }
    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let mut slot = self.0.slot.lock().unwrap_or_else(|p| p.into_inner());
        let Some(staged) = slot.as_mut() else {
            return Ok(());
        };
        let fits = layout.is_contiguous()
            && layout.start_offset() == 0
            && staged.dtype() == storage.dtype()
            && bytes_of(staged).len() == bytes_of(storage).len();
        if fits {
            std::mem::swap(storage, staged);
            self.0.swapped.store(true, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// Sets `var` to `staged`, a CPU tensor that nothing else refers to (one that
/// [`read_checked`](super::read::read_checked) returned), by moving its buffer into the
/// variable where both are plain CPU buffers of the same dtype and size, and by copying
/// (converting dtype and device as needed) otherwise. Every handle on the variable sees the new
/// values, as with [`Var::set`]; the variable's previous buffer is freed, and `staged` must not
/// be used again.
pub(crate) fn move_into(var: &Var, staged: Tensor) -> Result<()> {
    let plain =
        |t: &Tensor| t.device().is_cpu() && t.is_contiguous() && t.layout().start_offset() == 0;
    if !(plain(&staged) && plain(var.as_tensor()))
        || staged.dtype() != var.dtype()
        || staged.dims() != var.dims()
    {
        return Ok(var.set(&staged.to_dtype(var.dtype())?.to_device(var.device())?)?);
    }
    let ex = Exchange {
        slot: Mutex::new(None),
        swapped: false.into(),
    };
    staged.inplace_op1(&Take(&ex))?;
    var.as_tensor().inplace_op1(&Put(&ex))?;
    if !ex.swapped.load(Ordering::Relaxed) {
        // The variable's storage is larger than its shape (it shares one with others): copy.
        let buffer = ex.slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(buffer) = buffer {
            let info = TensorInfo {
                name: String::new(),
                dtype: staged.dtype(),
                shape: staged.dims().to_vec(),
                start: 0,
                end: 0,
            };
            var.set(&into_tensor(buffer, &info)?)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn a_staged_buffer_moves_into_a_variable_and_every_handle_sees_it() {
        let cpu = &Device::Cpu;
        let var = Var::new(&[[1f32, 2.0], [3.0, 4.0]], cpu).unwrap();
        let (handle, row) = (
            var.as_tensor().clone(),
            var.as_tensor().narrow(0, 1, 1).unwrap(),
        );
        let staged = Tensor::new(&[[5f32, 6.0], [7.0, 8.0]], cpu).unwrap();
        move_into(&var, staged).unwrap();
        assert_eq!(handle.to_vec2::<f32>().unwrap(), [[5.0, 6.0], [7.0, 8.0]]);
        assert_eq!(row.to_vec2::<f32>().unwrap(), [[7.0, 8.0]]);
        // Another dtype is converted and copied instead.
        let staged = Tensor::new(&[[1f32, 0.5], [0.25, 2.0]], cpu)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap();
        move_into(&var, staged).unwrap();
        assert_eq!(handle.to_vec2::<f32>().unwrap(), [[1.0, 0.5], [0.25, 2.0]]);
        // A shape that does not fit is an error, and leaves the variable as it was.
        let wrong = Tensor::new(&[1f32, 2.0, 3.0], cpu).unwrap();
        assert!(move_into(&var, wrong).is_err());
        assert_eq!(handle.to_vec2::<f32>().unwrap(), [[1.0, 0.5], [0.25, 2.0]]);
    }
}
