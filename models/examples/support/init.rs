//! Seeded initialisation for the examples: candle's CPU random initialisation is seeded by the
//! OS (`Device::Cpu.set_seed` is an error), so two runs never start from the same weights.
//!
//! Include it with `#[path = "support/init.rs"] mod init;`.

use candle_core::{DType, Device};
use candle_nn::VarMap;
use ivme::rng::Rng;

/// Replaces candle's random initialisation (seeded by the OS, so different in every process)
/// with values from ivme's seeded generator, so that separate runs start from the same
/// weights. Constant tensors (norm scales, biases) keep their value.
pub fn reinit(varmap: &VarMap, seed: u64, std: f32) -> candle_core::Result<()> {
    let mut vars: Vec<_> = varmap.data().lock().unwrap().clone().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut rng = Rng::new(seed);
    for (_, var) in vars {
        let t = var.as_tensor().to_dtype(DType::F32)?.flatten_all()?;
        let constant = (t.max(0)? - t.min(0)?)?.to_scalar::<f32>()? == 0.0;
        if !constant {
            let fresh = rng.randn(0.0, std, var.shape(), &Device::Cpu)?;
            var.set(&fresh.to_dtype(var.dtype())?.to_device(var.device())?)?;
        }
    }
    Ok(())
}
