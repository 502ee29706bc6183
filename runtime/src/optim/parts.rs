//! One optimizer step taken in parts: the step is opened once (its count, learning rate and
//! bias corrections fixed), then each variable is updated as its gradient becomes final. The
//! overlapped gradient sync (`train/overlap.rs`) steps a bucket's variables while the next
//! bucket is still being averaged; the numbers are those of one whole step, since every
//! variable's update depends only on its own gradient and state and on what the opening fixed.

use super::{AdamW, AnyOptimizer, Sgd};
use crate::error::Result;
use crate::precision::refresh_copy;
use crate::stateful::Shared;
use candle_core::backprop::GradStore;
use candle_core::Var;
use std::any::Any;

/// An optimizer whose step can be taken in parts.
pub(crate) trait InParts {
    /// Starts a step: counts it and fixes what every variable's update uses.
    fn open_step(&mut self);
    /// Updates the variables that have a gradient in `grads`, with the open step's constants.
    fn step_open(&mut self, grads: &GradStore) -> candle_core::Result<()>;
}

impl InParts for AnyOptimizer {
    fn open_step(&mut self) {
        match self {
            AnyOptimizer::AdamW(o) => o.open_step(),
            AnyOptimizer::Sgd(o) => o.open_step(),
        }
    }

    fn step_open(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        match self {
            AnyOptimizer::AdamW(o) => o.step_open(grads),
            AnyOptimizer::Sgd(o) => o.step_open(grads),
        }
    }
}

/// What a part of a step is: the opening, or the variables whose gradients `grads` hold.
pub(crate) enum Part<'a> {
    /// Open the step.
    Open,
    /// Update these variables (keyed by master variable), then refresh their low-precision
    /// copies.
    Vars(&'a GradStore),
}

/// Takes a prepared optimizer's step in parts (see the module docs).
pub(crate) struct PartStepper(Box<dyn FnMut(Part<'_>) -> Result<()>>);

impl PartStepper {
    /// Takes one part of the step.
    pub(crate) fn step(&mut self, part: Part<'_>) -> Result<()> {
        (self.0)(part)
    }
}

impl std::fmt::Debug for PartStepper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PartStepper")
    }
}

/// A part stepper over `opt`, when it is ivme's AdamW, Sgd or AnyOptimizer (others step whole);
/// `copies` are the (low-precision copy, f32 master) pairs a part refreshes after updating.
pub(crate) fn stepper<O: Any + Send>(
    opt: &Shared<O>,
    copies: Vec<(Var, Var)>,
) -> Option<PartStepper> {
    fn of<T: InParts + Any>(o: &mut dyn Any) -> &mut T {
        o.downcast_mut::<T>().expect("checked by type before")
    }
    let is = |t: std::any::TypeId| std::any::TypeId::of::<O>() == t;
    let step: fn(&mut dyn Any, Option<&GradStore>) -> candle_core::Result<()> =
        if is(std::any::TypeId::of::<AdamW>()) {
            |o, g| run(of::<AdamW>(o), g)
        } else if is(std::any::TypeId::of::<Sgd>()) {
            |o, g| run(of::<Sgd>(o), g)
        } else if is(std::any::TypeId::of::<AnyOptimizer>()) {
            |o, g| run(of::<AnyOptimizer>(o), g)
        } else {
            return None;
        };
    let opt = opt.clone();
    Some(PartStepper(Box::new(move |part: Part<'_>| {
        let grads = match part {
            Part::Open => None,
            Part::Vars(g) => Some(g),
        };
        step(&mut *opt.lock() as &mut dyn Any, grads)?;
        if let Some(g) = grads {
            for (copy, master) in &copies {
                if g.get(master.as_tensor()).is_some() {
                    refresh_copy(copy, master)?;
                }
            }
        }
        Ok(())
    })))
}

fn run<T: InParts>(o: &mut T, grads: Option<&GradStore>) -> candle_core::Result<()> {
    match grads {
        None => {
            o.open_step();
            Ok(())
        }
        Some(g) => o.step_open(g),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{ParamsAdamW, ParamsSgd};
    use candle_core::{Device, Tensor};
    use candle_nn::Optimizer;

    /// Two steps taken in parts (one variable at a time, in any order) equal two whole steps
    /// bit for bit, and count as two steps.
    fn check<O: Optimizer + InParts + crate::optim::Linked>(make: impl Fn(Vec<Var>) -> O) {
        let dev = Device::Cpu;
        let vars = |k: f32| -> Vec<Var> {
            (0..3)
                .map(|i| {
                    let v: Vec<f32> = (0..5).map(|j| k + 0.1 * (i * 5 + j) as f32).collect();
                    Var::from_tensor(&Tensor::new(v, &dev).unwrap()).unwrap()
                })
                .collect()
        };
        let (whole, parts) = (vars(0.5), vars(0.5));
        let (mut a, mut b) = (make(whole.clone()), make(parts.clone()));
        for round in 0..2 {
            let grad = |i: usize| {
                let g: Vec<f32> = (0..5).map(|j| 0.3 - 0.07 * (i + j + round) as f32).collect();
                Tensor::new(g, &dev).unwrap()
            };
            let mut all = GradStore::default();
            for (i, v) in whole.iter().enumerate() {
                all.insert(v.as_tensor(), grad(i));
            }
            a.step(&all).unwrap();
            b.open_step();
            for i in [2, 0, 1] {
                let mut one = GradStore::default();
                one.insert(parts[i].as_tensor(), grad(i));
                b.step_open(&one).unwrap();
            }
        }
        for (x, y) in whole.iter().zip(&parts) {
            assert_eq!(
                x.as_tensor().to_vec1::<f32>().unwrap(),
                y.as_tensor().to_vec1::<f32>().unwrap()
            );
        }
        assert_eq!(b.link().steps(), 2);
    }

    #[test]
    fn a_step_in_parts_is_the_whole_step() {
        let adamw = ParamsAdamW {
            weight_decay: 0.1,
            ..Default::default()
        };
        check(|v| AdamW::new(v, adamw.clone()).unwrap());
        let sgd = ParamsSgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
            ..Default::default()
        };
        check(|v| Sgd::new(v, sgd).unwrap());
    }
}
