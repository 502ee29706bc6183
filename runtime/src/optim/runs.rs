//! Variables an optimizer updates only in part: under ZeRO sharding a process's slice may
//! start or end inside a variable, and ivme's optimizers then update that *run* of the
//! variable's flat elements in the variable's own memory, with state for the run alone,
//! instead of a copy of the run kept beside the weights.

use super::{AdamW, AnyOptimizer, Sgd};
use crate::error::Result;
use candle_core::{Shape, Tensor, Var};
use std::any::Any;

/// Elements `from..from + len` of a variable, flattened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    /// The first element.
    pub from: usize,
    /// How many elements.
    pub len: usize,
}

/// What a step updates: the variable itself, or its run (a flat view of the variable's
/// memory; a contiguous variable's run is contiguous).
pub(super) fn target(var: &Var, run: Option<Run>) -> candle_core::Result<Tensor> {
    match run {
        None => Ok(var.as_tensor().clone()),
        Some(r) => var.as_tensor().flatten_all()?.narrow(0, r.from, r.len),
    }
}

/// The shape of [`target`]: the state an optimizer keeps for it has this shape.
pub(super) fn shape(var: &Var, run: Option<Run>) -> Shape {
    match run {
        None => var.shape().clone(),
        Some(r) => Shape::from(r.len),
    }
}

/// Writes `value` (in [`target`]'s shape, the variable's dtype) where the step reads from.
pub(super) fn write(var: &Var, run: Option<Run>, value: &Tensor) -> candle_core::Result<()> {
    match run {
        None => var.set(value),
        Some(r) => var
            .as_tensor()
            .flatten_all()?
            .slice_set(&value.contiguous()?, 0, r.from),
    }
}

/// Points a fresh ivme optimizer (AdamW, Sgd, or either inside `AnyOptimizer`) at `vars`,
/// each whole or in part as `runs` says. Returns `false`, changing nothing, for any other
/// optimizer: it is then given copies of the runs.
pub(crate) fn rebind<O: Any>(opt: &mut O, vars: Vec<Var>, runs: Vec<Option<Run>>) -> Result<bool> {
    let opt: &mut dyn Any = opt;
    if let Some(o) = opt.downcast_mut::<AdamW>() {
        o.rebind_runs(vars, runs)?;
    } else if let Some(o) = opt.downcast_mut::<Sgd>() {
        o.rebind_runs(vars, runs)?;
    } else if let Some(o) = opt.downcast_mut::<AnyOptimizer>() {
        match o {
            AnyOptimizer::AdamW(o) => o.rebind_runs(vars, runs)?,
            AnyOptimizer::Sgd(o) => o.rebind_runs(vars, runs)?,
        }
    } else {
        return Ok(false);
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{ParamsAdamW, ParamsSgd, StatefulOptimizer};
    use candle_core::backprop::GradStore;
    use candle_core::Device;
    use candle_nn::Optimizer;

    /// A step over runs of a variable changes exactly those elements, as the same optimizer
    /// stepping a copy of each run would.
    fn check<O: StatefulOptimizer>(make: impl Fn(Vec<Var>) -> O) {
        let dev = Device::Cpu;
        let start: Vec<f32> = (0..12).map(|i| 0.1 * i as f32 - 0.4).collect();
        let grad: Vec<f32> = (0..12).map(|i| 0.3 - 0.05 * i as f32).collect();
        let (a, b) = (Run { from: 2, len: 5 }, Run { from: 9, len: 3 });
        // Two variables of shape (3, 4): one updated on elements 2..7, the other on 9..12.
        let w = Var::from_tensor(&Tensor::from_vec(start.clone(), (3, 4), &dev).unwrap()).unwrap();
        let u = Var::from_tensor(&Tensor::from_vec(start.clone(), (3, 4), &dev).unwrap()).unwrap();
        let mut opt = make(vec![w.clone()]);
        assert!(rebind(&mut opt, vec![w.clone(), u.clone()], vec![Some(a), Some(b)]).unwrap());
        // The same runs as variables of their own.
        let copies: Vec<Var> = [a, b]
            .iter()
            .map(|r| Var::new(&start[r.from..r.from + r.len], &dev).unwrap())
            .collect();
        let mut plain = make(copies.clone());
        for _ in 0..3 {
            let mut g = GradStore::default();
            let mut h = GradStore::default();
            for (v, c, r) in [(&w, &copies[0], a), (&u, &copies[1], b)] {
                let run = Tensor::new(&grad[r.from..r.from + r.len], &dev).unwrap();
                g.insert(v.as_tensor(), run.clone());
                h.insert(c.as_tensor(), run);
            }
            opt.step(&g).unwrap();
            plain.step(&h).unwrap();
        }
        for (v, c, r) in [(&w, &copies[0], a), (&u, &copies[1], b)] {
            let got: Vec<f32> = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            let want: Vec<f32> = c.as_tensor().to_vec1().unwrap();
            assert_eq!(&got[r.from..r.from + r.len], &want[..]);
            assert_eq!(&got[..r.from], &start[..r.from], "before the run");
            assert_eq!(&got[r.from + r.len..], &start[r.from + r.len..], "after it");
        }
        // The state is the runs' own, and loads back.
        let state = opt.state_dict().unwrap();
        assert_eq!(
            state.tensors[0].first().map(|(_, t)| t.dims().to_vec()),
            Some(vec![5])
        );
        opt.load_state_dict(&state).unwrap();
    }

    #[test]
    fn adamw_updates_runs_of_a_variable_in_place() {
        check(|v| {
            let p = ParamsAdamW {
                lr: 0.1,
                weight_decay: 0.01,
                ..Default::default()
            };
            AdamW::new(v, p).unwrap()
        });
    }

    #[test]
    fn sgd_with_momentum_updates_runs_of_a_variable_in_place() {
        check(|v| {
            let p = ParamsSgd {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.01,
                ..Default::default()
            };
            Sgd::new(v, p).unwrap()
        });
    }

    #[test]
    fn the_op_by_op_path_writes_runs_in_place_too() {
        // An f64 variable takes the op-by-op path.
        let dev = Device::Cpu;
        let w = Var::from_tensor(&Tensor::new(&[1.0f64, 2.0, 3.0, 4.0], &dev).unwrap()).unwrap();
        let p = ParamsSgd {
            lr: 0.5,
            ..Default::default()
        };
        let mut opt = Sgd::new(vec![w.clone()], p).unwrap();
        let run = Run { from: 1, len: 2 };
        assert!(rebind(&mut opt, vec![w.clone()], vec![Some(run)]).unwrap());
        let mut g = GradStore::default();
        g.insert(w.as_tensor(), Tensor::new(&[2.0f64, 4.0], &dev).unwrap());
        opt.step(&g).unwrap();
        let got: Vec<f64> = w.as_tensor().to_vec1().unwrap();
        assert_eq!(got, vec![1.0, 1.0, 1.0, 4.0]);
    }
}
