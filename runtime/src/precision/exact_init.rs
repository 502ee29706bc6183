//! The variables [`Accelerator::var_builder`] creates: drawn from ivme's seeded generator, and
//! under low precision with exact f32 initial values for the masters.
//!
//! Each new variable's initial value is drawn in f32 from a generator keyed by the seed (the
//! builder's, or the last `set_seed`'s) and the variable's name ([`draw_init`]), as candle's `Init` hint describes it:
//! the same model starts from the same weights in every run with that seed, on every rank, on
//! the CPU (whose candle generator cannot be seeded) and on a GPU alike.
//!
//! Under bf16/fp16 the f32 draw is kept for the master weight and the variable in the user's
//! `VarMap` is its rounding; [`Accelerator::prepare`](crate::Accelerator::prepare) then takes
//! the kept f32 values as the masters (rather than widening already-rounded values).

use crate::rng::draw_init;
use crate::stateful::Shared;
use candle_core::{DType, Device, Result, Shape, Tensor, TensorId, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarMap};
use std::collections::HashMap;

/// The exact f32 initial value of each low-precision variable, by the variable's tensor id.
pub(crate) type ExactMasters = Shared<HashMap<TensorId, Tensor>>;

/// A `VarMap` backend that draws new variables from the seed, in f32, and keeps the f32 value
/// of those it rounds to the model's low precision.
pub(crate) struct SeededInit {
    varmap: VarMap,
    seed: u64,
    masters: ExactMasters,
    /// The mixed-precision compute dtype, whose variables keep their f32 draw for the master.
    low: Option<DType>,
}

impl SeededInit {
    /// A backend over `varmap` drawing from `seed`; with `low` set (the mixed-precision compute
    /// dtype) the f32 draw of each variable made in that dtype is kept in `masters`.
    pub(crate) fn new(
        varmap: VarMap,
        seed: u64,
        masters: ExactMasters,
        low: Option<DType>,
    ) -> Self {
        SeededInit {
            varmap,
            seed,
            masters,
            low,
        }
    }
}

/// Makes `name` a variable of `varmap` holding `exact` in `dtype`; when `dtype` is `low` (the
/// mixed-precision compute dtype) the f32 `exact` is kept in `masters` for the master weight.
pub(crate) fn add_variable(
    varmap: &VarMap,
    name: &str,
    exact: Tensor,
    dtype: DType,
    low: Option<DType>,
    masters: &ExactMasters,
) -> Result<Tensor> {
    let var = Var::from_tensor(&exact.to_dtype(dtype)?)?;
    if low == Some(dtype) {
        masters.lock().insert(var.as_tensor().id(), exact);
    }
    varmap
        .data()
        .lock()
        .unwrap()
        .insert(name.to_string(), var.clone());
    Ok(var.as_tensor().clone())
}

impl SimpleBackend for SeededInit {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        // A name the map already has, or an integer dtype: the VarMap's own rules.
        let known = self.varmap.data().lock().unwrap().contains_key(name);
        if known || !dtype.is_float() {
            return self.varmap.get(s, name, h, dtype, dev);
        }
        // BatchNorm's statistics stay f32 under bf16/fp16: candle's BatchNorm updates them
        // with f32 batch statistics (buffers.rs).
        let dtype = if self.low.is_some() && crate::precision::is_batch_norm_statistic(name) {
            DType::F32
        } else {
            dtype
        };
        let drawn = draw_init(self.seed, name, h, &s).map_err(candle_core::Error::wrap)?;
        add_variable(
            &self.varmap,
            name,
            drawn.to_device(dev)?,
            dtype,
            self.low,
            &self.masters,
        )
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        self.varmap.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.varmap.contains_tensor(name)
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

    /// The weight and bias of a `linear(fan_in, out)` layer built through `var_builder` with
    /// `seed`.
    fn seeded_linear(seed: u64, fan_in: usize, out: usize) -> (Vec<f32>, Vec<f32>) {
        let acc = Accelerator::builder().cpu(true).seed(seed).build().unwrap();
        let varmap = VarMap::new();
        let layer = candle_nn::linear(fan_in, out, acc.var_builder(&varmap, DType::F32)).unwrap();
        (values(layer.weight()), values(layer.bias().unwrap()))
    }

    fn mean_and_std(v: &[f32]) -> (f32, f32) {
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
        (mean, var.sqrt())
    }

    #[test]
    fn the_seed_decides_the_initial_weights_drawn_as_candles_hints_say() {
        let (w, b) = seeded_linear(7, 64, 32);
        assert_eq!(
            seeded_linear(7, 64, 32),
            (w.clone(), b.clone()),
            "same seed"
        );
        let (w8, b8) = seeded_linear(8, 64, 32);
        assert!(w8 != w && b8 != b, "another seed draws other weights");
        // Each variable's draw depends on its name, not on when it was made.
        let acc = Accelerator::builder().cpu(true).seed(7).build().unwrap();
        let varmap = VarMap::new();
        let vb = acc.var_builder(&varmap, DType::F32);
        let hint = Init::Randn {
            mean: 0.0,
            stdev: 1.0,
        };
        let first = vb.get_with_hints(16, "a", hint).unwrap();
        let varmap = VarMap::new();
        let vb = acc.var_builder(&varmap, DType::F32);
        vb.get_with_hints(16, "b", hint).unwrap();
        let later = vb.get_with_hints(16, "a", hint).unwrap();
        assert_eq!(values(&first), values(&later));

        // And the draws follow candle's hints: plain candle draws the same hints from its own
        // (unseedable) generator, the reference for their distribution.
        let (fan_in, out) = (256, 512);
        let varmap = VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let plain = candle_nn::linear(fan_in, out, vb).unwrap();
        let (w, b) = seeded_linear(3, fan_in, out);
        let (w_mean, w_std) = mean_and_std(&w);
        let (p_mean, p_std) = mean_and_std(&values(plain.weight()));
        assert!((w_mean - p_mean).abs() < 0.003, "{w_mean} vs {p_mean}");
        assert!((w_std / p_std - 1.0).abs() < 0.02, "{w_std} vs {p_std}");
        let plain_b = values(plain.bias().unwrap());
        let bound = |v: &[f32]| v.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(bound(&b) <= 1.0 / (fan_in as f32).sqrt(), "{}", bound(&b));
        assert!((bound(&b) / bound(&plain_b) - 1.0).abs() < 0.05);
        let (_, b_std) = mean_and_std(&b);
        let (_, pb_std) = mean_and_std(&plain_b);
        assert!((b_std / pb_std - 1.0).abs() < 0.15, "{b_std} vs {pb_std}");
    }

    #[test]
    fn in_f32_the_builder_is_the_varmaps_own() {
        let (master, compute) = masters(Precision::No, Init::Const(0.1));
        assert_eq!(values(&master), values(&compute));
        assert_eq!(values(&master)[0], 0.1f32);
    }
}
