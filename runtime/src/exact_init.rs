//! Variables created for a low-precision model with exact f32 initial values: the f32 master
//! weights start from the initialisation itself, and the model's bf16/fp16 copy is rounded
//! from them (rather than the masters being widened from already-rounded values).
//!
//! [`Accelerator::var_builder`] hands the model a `VarBuilder` whose backend draws each new
//! variable in f32, keeps that f32 tensor for the master, and puts its low-precision rounding
//! into the user's `VarMap`; [`Accelerator::prepare`](crate::Accelerator::prepare) then takes
//! the kept f32 values as the masters.

use crate::accelerator::Accelerator;
use crate::stateful::Shared;
use candle_core::{DType, Device, Result, Shape, Tensor, TensorId, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};
use std::collections::HashMap;

/// The exact f32 initial value of each low-precision variable, by the variable's tensor id.
pub(crate) type ExactMasters = Shared<HashMap<TensorId, Tensor>>;

/// A `VarMap` backend that initialises in f32 and stores the low-precision rounding.
struct ExactInit {
    varmap: VarMap,
    masters: ExactMasters,
    low: DType,
}

impl SimpleBackend for ExactInit {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        // Another dtype than the model's, or a name the map already has: the VarMap's own rules.
        let known = self.varmap.data().lock().unwrap().contains_key(name);
        if dtype != self.low || known {
            return self.varmap.get(s, name, h, dtype, dev);
        }
        let exact = h.var(s, DType::F32, dev)?.as_tensor().detach();
        let copy = Var::from_tensor(&exact.to_dtype(self.low)?)?;
        self.masters.lock().insert(copy.as_tensor().id(), exact);
        self.varmap
            .data()
            .lock()
            .unwrap()
            .insert(name.to_string(), copy.clone());
        Ok(copy.as_tensor().clone())
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        self.varmap.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.varmap.contains_tensor(name)
    }
}

impl Accelerator {
    /// A `VarBuilder` over `varmap` for building the model: variables on this process's device,
    /// in the compute dtype for a request of f32 under mixed precision (see
    /// [`param_dtype`](Self::param_dtype)), the request otherwise.
    ///
    /// Under bf16/fp16 each variable is initialised in f32 and its f32 value becomes the master
    /// weight when the model is prepared, so the masters start from the exact initialisation
    /// and only the model's copy is rounded. `VarBuilder::from_varmap(&varmap,
    /// accelerator.param_dtype(DType::F32), ..)` also works, with masters widened from the
    /// rounded values. `#[accelerate]` writes this call for `VarBuilder::from_varmap(..)`.
    ///
    /// ```no_run
    /// # fn main() -> ivme::Result<()> {
    /// let accelerator = ivme::Accelerator::builder().precision(ivme::Precision::Bf16).build()?;
    /// let varmap = candle_nn::VarMap::new();
    /// let layer = candle_nn::linear(8, 1, accelerator.var_builder(&varmap, candle_core::DType::F32))?;
    /// # let _ = layer; Ok(()) }
    /// ```
    pub fn var_builder(&self, varmap: &VarMap, requested: DType) -> VarBuilder<'static> {
        let dtype = self.param_dtype(requested);
        if dtype == DType::F32 || dtype != self.mixed.policy().compute_dtype() {
            return VarBuilder::from_varmap(varmap, dtype, self.device());
        }
        let backend = ExactInit {
            varmap: varmap.clone(),
            masters: self.mixed.exact_masters().clone(),
            low: dtype,
        };
        VarBuilder::from_backend(Box::new(backend), dtype, self.device().clone())
    }

    /// The exact f32 initial value kept for `var`, if [`var_builder`](Self::var_builder) made
    /// it and it still rounds to the variable's value; taken, since the master then owns it.
    /// A variable set after it was made (weights loaded from a file, a custom initialisation)
    /// no longer matches, and its master is widened from its current value instead.
    pub(crate) fn take_exact_master(&self, var: &Var) -> crate::error::Result<Option<Tensor>> {
        let Some(exact) = self
            .mixed
            .exact_masters()
            .lock()
            .remove(&var.as_tensor().id())
        else {
            return Ok(None);
        };
        let now = var.as_tensor().to_dtype(DType::F32)?;
        let rounded = exact.to_dtype(var.dtype())?.to_dtype(DType::F32)?;
        let differ = rounded.ne(&now)?.to_dtype(DType::F32)?.sum_all()?;
        Ok((differ.to_scalar::<f32>()? == 0.0).then_some(exact))
    }
}

#[cfg(test)]
mod tests {
    use crate::{Accelerator, Precision};
    use candle_core::{DType, Device, Tensor};
    use candle_nn::{Init, VarMap};

    fn masters(precision: Precision, init: Init) -> (Tensor, Tensor) {
        masters_after(precision, init, |_| {})
    }

    /// Builds `w` through `var_builder`, runs `change` on the VarMap, prepares, and returns
    /// `w`'s master and the model's copy.
    fn masters_after(
        precision: Precision,
        init: Init,
        change: impl FnOnce(&VarMap),
    ) -> (Tensor, Tensor) {
        let mut acc = Accelerator::builder()
            .cpu(true)
            .precision(precision)
            .build()
            .unwrap();
        let varmap = VarMap::new();
        let vb = acc.var_builder(&varmap, DType::F32);
        let w = vb.get_with_hints((4, 64), "w", init).unwrap();
        assert_eq!(w.dtype(), precision.compute_dtype());
        change(&varmap);
        acc.prepare(varmap.clone()).unwrap();
        let (_, master) = acc
            .named_master_vars()
            .into_iter()
            .find(|(n, _)| n == "w")
            .unwrap();
        let compute = varmap.data().lock().unwrap()["w"].as_tensor().clone();
        (master.as_tensor().clone(), compute)
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    #[test]
    fn low_precision_masters_start_from_the_exact_f32_initialisation() {
        for p in [Precision::Bf16, Precision::Fp16] {
            // 0.1 has no exact bf16/f16 value: plain candle's f32 initialisation is the reference.
            let (master, compute) = masters(p, Init::Const(0.1));
            let reference = Tensor::full(0.1f32, (4, 64), &Device::Cpu).unwrap();
            assert_eq!(master.dtype(), DType::F32);
            assert_eq!(values(&master), values(&reference), "{p}: master");
            let rounded = reference.to_dtype(p.compute_dtype()).unwrap();
            assert_eq!(values(&compute), values(&rounded), "{p}: the model's copy");
            // A random initialisation keeps its f32 digits in the master too.
            let (master, compute) = masters(
                p,
                Init::Randn {
                    mean: 0.0,
                    stdev: 1.0,
                },
            );
            let widened = values(&compute);
            let exact = values(&master);
            let kept = exact.iter().zip(&widened).filter(|(m, c)| m != c).count();
            assert!(
                kept > exact.len() / 2,
                "{p}: {kept} of {} masters beyond the copy",
                exact.len()
            );
            let again = values(&master.to_dtype(p.compute_dtype()).unwrap());
            assert_eq!(again, widened, "{p}: the copy is the master rounded");
        }
    }

    #[test]
    fn weights_set_after_building_become_the_masters() {
        // Loading pretrained weights (`varmap.load(..)`) sets the variables in place: the
        // masters must start from those, not from the initialisation they replaced.
        let loaded = Tensor::full(0.25f32, (4, 64), &Device::Cpu).unwrap();
        let (master, compute) = masters_after(Precision::Bf16, Init::Const(0.1), |vm| {
            let w = vm.data().lock().unwrap()["w"].clone();
            w.set(&loaded.to_dtype(DType::BF16).unwrap()).unwrap();
        });
        assert_eq!(values(&master), values(&loaded));
        assert_eq!(values(&compute), values(&loaded));
    }

    #[test]
    fn in_f32_the_builder_is_the_varmaps_own() {
        let (master, compute) = masters(Precision::No, Init::Const(0.1));
        assert_eq!(values(&master), values(&compute));
        assert_eq!(values(&master)[0], 0.1f32);
    }
}
