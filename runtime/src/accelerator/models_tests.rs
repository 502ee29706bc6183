//! Tests of model and optimizer registration (`models.rs`).

use crate::optim::{AdamW, ParamsAdamW};
use crate::Accelerator;
use candle_core::{DType, Device};
use candle_nn::{Init, Optimizer, VarMap};

/// A fine-tune's layout: an optimizer over the head only. What trains and what is frozen
/// are listed by name, and a variable two optimizers would step is refused at prepare.
#[test]
fn what_the_optimizers_hold_trains_and_a_variable_held_twice_is_refused() {
    let mut acc = Accelerator::builder().cpu(true).build().unwrap();
    let varmap = VarMap::new();
    let get = |name: &str, n: usize| {
        varmap
            .get(n, name, Init::Const(0.5), DType::F32, &Device::Cpu)
            .unwrap()
    };
    let (_w, head) = (get("backbone.w", 4), get("head.w", 2));
    let head = candle_core::Var::from_tensor(&head).unwrap();
    let varmap = acc.prepare(varmap).unwrap();
    let opt = AdamW::new(vec![head.clone()], ParamsAdamW::default()).unwrap();
    let _opt = acc.prepare(opt).unwrap();
    assert_eq!(acc.trained_names(), ["head.w"]);
    assert_eq!(acc.frozen_names(), ["backbone.w"]);

    let again = AdamW::new(vec![head], ParamsAdamW::default()).unwrap();
    let e = acc.prepare(again).unwrap_err().to_string();
    assert!(
        e.contains("`head.w` is held by two prepared optimizers"),
        "{e}"
    );
    drop(varmap);
}

/// Under overlap, an optimizer that cannot step in parts and a second optimizer on one
/// model are refused at `prepare`, saying what to do, and leave nothing registered: the
/// variable can still be given an optimizer that fits.
#[test]
fn overlap_refuses_what_it_cannot_step_and_registers_nothing_then() {
    use crate::optim::{Linked, OptimizerLink, OptimizerState, StatefulOptimizer};
    use candle_core::Var;
    use std::sync::Arc;

    /// An optimizer of the user's own, over ivme's AdamW.
    #[derive(Debug)]
    struct Mine(AdamW);
    impl Optimizer for Mine {
        type Config = ParamsAdamW;
        fn new(vars: Vec<Var>, p: ParamsAdamW) -> candle_core::Result<Self> {
            Ok(Mine(AdamW::new(vars, p)?))
        }
        fn step(&mut self, g: &candle_core::backprop::GradStore) -> candle_core::Result<()> {
            self.0.step(g)
        }
        fn learning_rate(&self) -> f64 {
            self.0.learning_rate()
        }
        fn set_learning_rate(&mut self, lr: f64) {
            self.0.set_learning_rate(lr)
        }
    }
    impl Linked for Mine {
        fn link(&self) -> &Arc<OptimizerLink> {
            self.0.link()
        }
    }
    impl StatefulOptimizer for Mine {
        fn vars(&self) -> &[Var] {
            self.0.vars()
        }
        fn replace_vars(&mut self, vars: Vec<Var>) -> crate::Result<()> {
            self.0.replace_vars(vars)
        }
        fn state_dict(&self) -> crate::Result<OptimizerState> {
            self.0.state_dict()
        }
        fn load_state_dict(&mut self, state: &OptimizerState) -> crate::Result<()> {
            self.0.load_state_dict(state)
        }
    }

    let mut acc = Accelerator::builder()
        .cpu(true)
        .overlap(true)
        .build()
        .unwrap();
    let varmap = VarMap::new();
    for name in ["a", "b"] {
        varmap
            .get(4, name, Init::Const(0.5), DType::F32, &Device::Cpu)
            .unwrap();
    }
    let var = |n: &str| varmap.data().lock().unwrap()[n].clone();
    let (a, b) = (var("a"), var("b"));
    let _varmap = acc.prepare(varmap.clone()).unwrap();
    let e = acc
        .prepare_optimizer(&varmap, Mine::new(vec![a.clone()], ParamsAdamW::default()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("steps the optimizer in parts") && e.contains("Mine"),
        "{e}"
    );
    // Nothing was registered: ivme's AdamW takes the same variable.
    let _opt = acc
        .prepare(AdamW::new(vec![a], ParamsAdamW::default()).unwrap())
        .unwrap();
    let e = acc
        .prepare(AdamW::new(vec![b], ParamsAdamW::default()).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("this model already has one"), "{e}");
    assert_eq!(acc.trained_names(), ["a"]);
}

/// A frozen backbone's gradients, which candle computes anyway, are not summed over the
/// window, synced or handed back: only the head's are, with plain candle's values.
#[test]
fn a_frozen_variable_is_neither_accumulated_nor_returned() {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .grad_accum(2)
        .build()
        .unwrap();
    let varmap = VarMap::new();
    let get = |name: &str, n: usize| {
        varmap
            .get(n, name, Init::Const(0.5), DType::F32, &Device::Cpu)
            .unwrap()
    };
    let (w, h) = (get("backbone.w", 1000), get("head.w", 1000));
    let (w, h) = (
        candle_core::Var::from_tensor(&w).unwrap(),
        candle_core::Var::from_tensor(&h).unwrap(),
    );
    let _varmap = acc.prepare(varmap).unwrap();
    let opt = AdamW::new(vec![h.clone()], ParamsAdamW::default()).unwrap();
    let _opt = acc.prepare(opt).unwrap();
    // loss = sum(w * h * x): d/dh = w * x, d/dw = h * x.
    let loss = |x: f64| {
        (w.as_tensor() * h.as_tensor())
            .unwrap()
            .affine(x, 0.0)
            .unwrap()
            .sum_all()
            .unwrap()
    };
    let first = acc.backward(&loss(1.0)).unwrap();
    assert!(!first.is_sync_step());
    // Only the head's window sum is held: 1000 f32 values.
    assert_eq!(acc.held_bytes().unwrap().gradients, 1000 * 4);
    let grads = acc.backward(&loss(3.0)).unwrap();
    assert!(grads.get(&w).is_none(), "a frozen variable has no gradient");
    // The window's mean: (0.5 * 1 + 0.5 * 3) / 2 = 1.0 for every element.
    let g = grads.get(&h).expect("the head's gradient");
    assert_eq!(g.to_vec1::<f32>().unwrap(), vec![1.0f32; 1000]);
}
