//! One optimizer step taken in parts: the step is opened once (its count, learning rate and
//! bias corrections fixed), then each variable, or each run of a variable's elements, is
//! updated as its gradient becomes final. The overlapped gradient sync (`train/sync/overlap.rs`)
//! steps what a bucket brought while the next buckets are still being averaged; the numbers
//! are those of one whole step, since every element's update depends only on its own gradient
//! and state and on what the opening fixed.

use super::{AdamW, AnyOptimizer, Sgd};
use crate::error::Result;
use crate::precision::refresh_copy;
use crate::stateful::Shared;
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use std::any::Any;

/// An optimizer whose step can be taken in parts.
pub(crate) trait InParts {
    /// Starts a step: counts it and fixes what every variable's update uses.
    fn open_step(&mut self);
    /// Updates the variables that have a gradient in `grads`, with the open step's constants.
    fn step_open(&mut self, grads: &GradStore) -> candle_core::Result<()>;
    /// Updates elements `from..from + grad.elem_count()` of `var` (flattened) alone, with
    /// `grad` (flat, f32) as their gradient; says `false`, changing nothing, where it cannot
    /// (the op-by-op path, a variable it updates only in part, SGD's first momentum step):
    /// the variable is then stepped whole once its gradient is complete.
    fn step_span(&mut self, var: &Var, from: usize, grad: &Tensor) -> candle_core::Result<bool>;
}

/// The flat view of elements `from..from + len` of `t`, sharing its memory.
pub(super) fn span_of(t: &Tensor, from: usize, len: usize) -> candle_core::Result<Tensor> {
    t.flatten_all()?.narrow(0, from, len)
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

    fn step_span(&mut self, var: &Var, from: usize, grad: &Tensor) -> candle_core::Result<bool> {
        match self {
            AnyOptimizer::AdamW(o) => o.step_span(var, from, grad),
            AnyOptimizer::Sgd(o) => o.step_span(var, from, grad),
        }
    }
}

/// What a part of a step is.
pub(crate) enum Part<'a> {
    /// Open the step.
    Open,
    /// Update these variables (keyed by master variable), then refresh their low-precision
    /// copies.
    Vars(&'a GradStore),
    /// Update a run of one master variable's elements with its gradient ([`InParts::step_span`]);
    /// the answer says whether it did.
    Span {
        /// The master variable.
        var: &'a Var,
        /// The run's first element (flattened).
        from: usize,
        /// The run's gradient, flat.
        grad: &'a Tensor,
    },
    /// Every run of this master variable was updated: refresh its low-precision copy.
    Done(&'a Var),
}

/// Takes a prepared optimizer's step in parts (see the module docs).
pub(crate) struct PartStepper(Box<dyn FnMut(Part<'_>) -> Result<bool>>);

impl PartStepper {
    /// Takes one part of the step; says whether it did (a [`Part::Span`] may be left for the
    /// whole variable).
    pub(crate) fn step(&mut self, part: Part<'_>) -> Result<bool> {
        (self.0)(part)
    }
}

impl std::fmt::Debug for PartStepper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PartStepper")
    }
}

/// Whether [`stepper`] takes an optimizer of type `O`: ivme's AdamW, Sgd or AnyOptimizer.
pub(crate) fn steps_in_parts<O: Any>() -> bool {
    use std::any::TypeId;
    [
        TypeId::of::<AdamW>(),
        TypeId::of::<Sgd>(),
        TypeId::of::<AnyOptimizer>(),
    ]
    .contains(&TypeId::of::<O>())
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
    let step: fn(&mut dyn Any, &Part<'_>) -> candle_core::Result<bool> =
        if is(std::any::TypeId::of::<AdamW>()) {
            |o, p| run(of::<AdamW>(o), p)
        } else if is(std::any::TypeId::of::<Sgd>()) {
            |o, p| run(of::<Sgd>(o), p)
        } else if is(std::any::TypeId::of::<AnyOptimizer>()) {
            |o, p| run(of::<AnyOptimizer>(o), p)
        } else {
            return None;
        };
    let opt = opt.clone();
    let refresh = move |done: &dyn Fn(&Var) -> bool| -> Result<()> {
        for (copy, master) in copies.iter().filter(|(_, m)| done(m)) {
            refresh_copy(copy, master)?;
        }
        Ok(())
    };
    Some(PartStepper(Box::new(move |part: Part<'_>| {
        let did = step(&mut *opt.lock() as &mut dyn Any, &part)?;
        match part {
            Part::Vars(g) => refresh(&|m| g.get(m.as_tensor()).is_some())?,
            Part::Done(v) => refresh(&|m| m.as_tensor().id() == v.as_tensor().id())?,
            Part::Open | Part::Span { .. } => {}
        }
        Ok(did)
    })))
}

/// Takes `part` on `o`; says whether it did.
fn run<T: InParts>(o: &mut T, part: &Part<'_>) -> candle_core::Result<bool> {
    match part {
        Part::Open => o.open_step(),
        Part::Vars(g) => o.step_open(g)?,
        Part::Span { var, from, grad } => return o.step_span(var, *from, grad),
        Part::Done(_) => {}
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{ParamsAdamW, ParamsSgd};
    use candle_core::{Device, Tensor};
    use candle_nn::Optimizer;

    /// Two steps taken in parts (one variable at a time, in any order, each in two runs where
    /// the optimizer can) equal two whole steps bit for bit, and count as two steps.
    /// Returns how many variables were stepped in runs.
    fn check<O: Optimizer + InParts + crate::optim::Linked>(make: impl Fn(Vec<Var>) -> O) -> usize {
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
        let mut spans = 0;
        for round in 0..2 {
            let grad = |i: usize| {
                let g: Vec<f32> = (0..5)
                    .map(|j| 0.3 - 0.07 * (i + j + round) as f32)
                    .collect();
                Tensor::new(g, &dev).unwrap()
            };
            let mut all = GradStore::default();
            for (i, v) in whole.iter().enumerate() {
                all.insert(v.as_tensor(), grad(i));
            }
            a.step(&all).unwrap();
            b.open_step();
            for i in [2, 0, 1] {
                // In two runs where the optimizer can (SGD's first momentum step cannot).
                let g = grad(i);
                if b.step_span(&parts[i], 0, &g.narrow(0, 0, 2).unwrap())
                    .unwrap()
                {
                    assert!(b
                        .step_span(&parts[i], 2, &g.narrow(0, 2, 3).unwrap())
                        .unwrap());
                    spans += 1;
                    continue;
                }
                let mut one = GradStore::default();
                one.insert(parts[i].as_tensor(), g);
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
        spans
    }

    #[test]
    fn a_step_in_parts_is_the_whole_step() {
        let adamw = ParamsAdamW {
            weight_decay: 0.1,
            ..Default::default()
        };
        assert_eq!(check(|v| AdamW::new(v, adamw.clone()).unwrap()), 6);
        let sgd = ParamsSgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
            ..Default::default()
        };
        // The first step starts the momentum buffers whole; the second updates runs.
        assert_eq!(check(|v| Sgd::new(v, sgd).unwrap()), 3);
    }
}
