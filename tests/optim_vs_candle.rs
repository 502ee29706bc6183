//! ivme's optimizers against candle-nn's and against the update rules written out with plain
//! candle ops, on gradients from a real loss; state round trips; schedulers that advance only
//! on real optimizer steps.

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::Optimizer;
use ivme::optim::schedule::StepLr;
use ivme::optim::{
    AdamW, AnyOptimizer, AnyParams, Linked, LrSchedule, LrScheduler, ParamsAdamW, ParamsSgd, Sgd,
    StatefulOptimizer,
};

/// A two-layer perceptron's parameters: w1 (4×3), b1 (4), w2 (1×4), b2 (1), with fixed,
/// irregular values so every element gets a different gradient.
fn mlp_vars() -> Result<Vec<Var>> {
    let dev = Device::Cpu;
    let ramp = |n: usize, scale: f32, shift: f32| -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 * 1.7 + shift).sin()) * scale)
            .collect()
    };
    Ok(vec![
        Var::from_tensor(&Tensor::from_vec(ramp(12, 0.6, 0.3), (4, 3), &dev)?)?,
        Var::from_tensor(&Tensor::from_vec(ramp(4, 0.1, 1.1), 4, &dev)?)?,
        Var::from_tensor(&Tensor::from_vec(ramp(4, 0.5, 2.0), (1, 4), &dev)?)?,
        Var::from_tensor(&Tensor::from_vec(vec![0.05f32], 1, &dev)?)?,
    ])
}

/// Fresh variables holding the same values as `vars`.
fn clone_vars(vars: &[Var]) -> Result<Vec<Var>> {
    vars.iter()
        .map(|v| Var::from_tensor(&v.as_tensor().copy()?))
        .collect()
}

/// Mean squared error of the MLP on batch `k` (inputs and targets differ per step).
fn loss(vars: &[Var], k: usize) -> Result<Tensor> {
    let dev = Device::Cpu;
    let xs: Vec<f32> = (0..15).map(|i| ((i + 3 * k) as f32 * 0.37).cos()).collect();
    let ys: Vec<f32> = (0..5).map(|i| ((i + k) as f32 * 0.9).sin()).collect();
    let x = Tensor::from_vec(xs, (5, 3), &dev)?;
    let y = Tensor::from_vec(ys, (5, 1), &dev)?;
    let h = x
        .matmul(&vars[0].as_tensor().t()?)?
        .broadcast_add(vars[1].as_tensor())?
        .tanh()?;
    let out = h
        .matmul(&vars[2].as_tensor().t()?)?
        .broadcast_add(vars[3].as_tensor())?;
    (out - y)?.sqr()?.mean_all()
}

fn values(vars: &[Var]) -> Result<Vec<Vec<f32>>> {
    vars.iter()
        .map(|v| v.as_tensor().flatten_all()?.to_vec1::<f32>())
        .collect()
}

fn assert_bitwise(a: &[Var], b: &[Var], what: &str) -> Result<()> {
    for (i, (x, y)) in values(a)?.iter().zip(values(b)?.iter()).enumerate() {
        let xb: Vec<u32> = x.iter().map(|f| f.to_bits()).collect();
        let yb: Vec<u32> = y.iter().map(|f| f.to_bits()).collect();
        assert_eq!(xb, yb, "{what}: variable {i} differs: {x:?} vs {y:?}");
    }
    Ok(())
}

fn assert_close(a: &[Var], b: &[Var], what: &str) -> Result<()> {
    for (i, (x, y)) in values(a)?.iter().zip(values(b)?.iter()).enumerate() {
        for (p, q) in x.iter().zip(y) {
            let tol = 1e-6 * p.abs().max(1.0);
            assert!((p - q).abs() <= tol, "{what}: variable {i}: {x:?} vs {y:?}");
        }
    }
    Ok(())
}

fn adamw_matches_candle(weight_decay: f64) -> Result<()> {
    let ours_vars = mlp_vars()?;
    let theirs_vars = clone_vars(&ours_vars)?;
    let params = ParamsAdamW {
        lr: 0.01,
        weight_decay,
        ..ParamsAdamW::default()
    };
    let mut ours = AdamW::new(ours_vars.clone(), params.clone())?;
    let mut theirs = candle_nn::AdamW::new(theirs_vars.clone(), params)?;
    for k in 0..6 {
        ours.backward_step(&loss(&ours_vars, k)?)?;
        theirs.backward_step(&loss(&theirs_vars, k)?)?;
        assert_bitwise(&ours_vars, &theirs_vars, &format!("AdamW step {k}"))?;
    }
    // The parameters moved: the comparison is not between two untouched copies.
    assert_ne!(values(&ours_vars)?, values(&mlp_vars()?)?);
    Ok(())
}

#[test]
fn adamw_is_bitwise_candle_nn_without_weight_decay() -> Result<()> {
    adamw_matches_candle(0.0)
}

#[test]
fn adamw_is_bitwise_candle_nn_with_weight_decay() -> Result<()> {
    adamw_matches_candle(0.1)
}

#[test]
fn plain_sgd_is_bitwise_candle_nn() -> Result<()> {
    let ours_vars = mlp_vars()?;
    let theirs_vars = clone_vars(&ours_vars)?;
    let params = ParamsSgd {
        lr: 0.05,
        ..ParamsSgd::default()
    };
    let mut ours = Sgd::new(ours_vars.clone(), params)?;
    let mut theirs = candle_nn::SGD::new(theirs_vars.clone(), 0.05)?;
    for k in 0..5 {
        ours.backward_step(&loss(&ours_vars, k)?)?;
        theirs.backward_step(&loss(&theirs_vars, k)?)?;
        assert_bitwise(&ours_vars, &theirs_vars, &format!("SGD step {k}"))?;
    }
    assert_ne!(values(&ours_vars)?, values(&mlp_vars()?)?);
    Ok(())
}

/// PyTorch's SGD rule, written out with plain candle tensors kept outside any optimizer.
fn reference_sgd(p: ParamsSgd, steps: usize) -> Result<Vec<Var>> {
    let vars = mlp_vars()?;
    let mut bufs: Vec<Option<Tensor>> = vec![None; vars.len()];
    for k in 0..steps {
        let grads = loss(&vars, k)?.backward()?;
        for (var, buf) in vars.iter().zip(bufs.iter_mut()) {
            let theta = var.as_tensor();
            let mut d = grads
                .get(theta)
                .expect("every variable has a gradient")
                .clone();
            d = (&d + theta.affine(p.weight_decay, 0.0)?)?;
            if p.momentum != 0.0 {
                let next = match buf.take() {
                    None => d.copy()?,
                    Some(b) => (b.affine(p.momentum, 0.0)? + d.affine(1.0 - p.dampening, 0.0)?)?,
                };
                d = if p.nesterov {
                    (&d + next.affine(p.momentum, 0.0)?)?
                } else {
                    next.clone()
                };
                *buf = Some(next);
            }
            var.set(&(theta - d.affine(p.lr, 0.0)?)?)?;
        }
    }
    Ok(vars)
}

#[test]
fn sgd_momentum_variants_match_the_written_out_rule() -> Result<()> {
    let cases = [
        ParamsSgd {
            lr: 0.05,
            momentum: 0.9,
            ..ParamsSgd::default()
        },
        ParamsSgd {
            lr: 0.05,
            momentum: 0.9,
            nesterov: true,
            ..ParamsSgd::default()
        },
        ParamsSgd {
            lr: 0.05,
            momentum: 0.8,
            dampening: 0.3,
            ..ParamsSgd::default()
        },
        ParamsSgd {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.01,
            nesterov: true,
            ..ParamsSgd::default()
        },
        ParamsSgd {
            lr: 0.05,
            weight_decay: 0.1,
            ..ParamsSgd::default()
        },
    ];
    for p in cases {
        let vars = mlp_vars()?;
        let mut opt = Sgd::new(vars.clone(), p)?;
        for k in 0..5 {
            opt.backward_step(&loss(&vars, k)?)?;
        }
        let want = reference_sgd(p, 5)?;
        assert_close(&vars, &want, &format!("{p:?}"))?;
        // Momentum changes the trajectory: plain SGD ends elsewhere.
        if p.momentum != 0.0 {
            let plain = reference_sgd(
                ParamsSgd {
                    lr: p.lr,
                    ..ParamsSgd::default()
                },
                5,
            )?;
            assert_ne!(values(&vars)?, values(&plain)?);
        }
    }
    Ok(())
}

/// Steps `a` twice, moves its state to `b` (fresh variables, same values), then steps both
/// three more times and checks they stay bitwise equal.
fn round_trip<O: StatefulOptimizer>(make: impl Fn(Vec<Var>) -> Result<O>) -> Result<()> {
    let a_vars = mlp_vars()?;
    let mut a = make(a_vars.clone())?;
    for k in 0..2 {
        a.backward_step(&loss(&a_vars, k)?)?;
    }
    let state = a.state_dict().map_err(candle_core::Error::from)?;
    let b_vars = clone_vars(&a_vars)?;
    let mut b = make(b_vars.clone())?;
    b.load_state_dict(&state)
        .map_err(candle_core::Error::from)?;
    assert_eq!(b.link().steps(), 2);
    for k in 2..5 {
        a.backward_step(&loss(&a_vars, k)?)?;
        b.backward_step(&loss(&b_vars, k)?)?;
        assert_bitwise(&a_vars, &b_vars, &format!("after resume, step {k}"))?;
    }
    Ok(())
}

#[test]
fn adamw_state_round_trip_resumes_exactly() -> Result<()> {
    round_trip(|vars| {
        let p = ParamsAdamW {
            lr: 0.02,
            ..ParamsAdamW::default()
        };
        AdamW::new(vars, p)
    })
}

#[test]
fn sgd_state_round_trip_resumes_exactly() -> Result<()> {
    round_trip(|vars| {
        let p = ParamsSgd {
            lr: 0.05,
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.01,
            ..ParamsSgd::default()
        };
        Sgd::new(vars, p)
    })
}

#[test]
fn a_fresh_adamw_without_the_state_does_not_resume() -> Result<()> {
    // Guards the round-trip test: bias correction and moments must really carry over.
    let a_vars = mlp_vars()?;
    let mut a = AdamW::new(a_vars.clone(), ParamsAdamW::default())?;
    for k in 0..2 {
        a.backward_step(&loss(&a_vars, k)?)?;
    }
    let b_vars = clone_vars(&a_vars)?;
    let mut b = AdamW::new(b_vars.clone(), ParamsAdamW::default())?;
    a.backward_step(&loss(&a_vars, 2)?)?;
    b.backward_step(&loss(&b_vars, 2)?)?;
    assert_ne!(values(&a_vars)?, values(&b_vars)?);
    Ok(())
}

#[test]
fn adamw_on_replaced_f32_vars_updates_the_replacements() -> Result<()> {
    let dev = Device::Cpu;
    let low = Var::from_tensor(&Tensor::new(&[0.5f32, -0.5], &dev)?.to_dtype(DType::F16)?)?;
    let mut opt = AdamW::new(vec![low.clone()], ParamsAdamW::default())?;
    let master = Var::new(&[0.5f32, -0.5], &dev)?;
    opt.replace_vars(vec![master.clone()])
        .map_err(candle_core::Error::from)?;
    let reference = Var::new(&[0.5f32, -0.5], &dev)?;
    let mut theirs = candle_nn::AdamW::new(vec![reference.clone()], ParamsAdamW::default())?;
    let x = Tensor::new(&[1.5f32, -2.0], &dev)?;
    opt.backward_step(&(master.as_tensor() * &x)?.sum_all()?)?;
    theirs.backward_step(&(reference.as_tensor() * &x)?.sum_all()?)?;
    assert_bitwise(&[master], &[reference], "master weights")?;
    // The replaced f16 variable is no longer the optimizer's business.
    let low_now = low.as_tensor().to_dtype(DType::F32)?.to_vec1::<f32>()?;
    assert_eq!(low_now, vec![0.5, -0.5]);
    Ok(())
}

#[test]
fn step_lr_advances_once_per_real_optimizer_step() -> Result<()> {
    let vars = mlp_vars()?;
    let params = ParamsSgd {
        lr: 1.0,
        ..ParamsSgd::default()
    };
    let mut opt = Sgd::new(vars.clone(), params)?;
    let mut sched = LrScheduler::new(&opt, StepLr::new(1, 0.5).map_err(candle_core::Error::from)?);
    assert_eq!(sched.lr(), 1.0);
    // Scheduler calls with no optimizer step in between (accumulation micro-steps, or a
    // scheduler stepped too often) change nothing.
    sched.step();
    sched.step();
    assert_eq!(opt.learning_rate(), 1.0);

    opt.backward_step(&loss(&vars, 0)?)?;
    sched.step();
    assert_eq!(sched.lr(), 0.5);
    assert_eq!(opt.learning_rate(), 0.5);
    for _ in 0..4 {
        sched.step();
    }
    assert_eq!(opt.learning_rate(), 0.5);

    opt.backward_step(&loss(&vars, 1)?)?;
    sched.step();
    sched.step();
    assert_eq!(opt.learning_rate(), 0.25);
    Ok(())
}

#[test]
fn scheduled_lr_is_the_one_the_optimizer_uses() -> Result<()> {
    // Two steps at lr 1.0 then 0.5 under StepLR equal plain SGD steps at those rates.
    let vars = mlp_vars()?;
    let mut opt = Sgd::new(
        vars.clone(),
        ParamsSgd {
            lr: 1.0,
            ..ParamsSgd::default()
        },
    )?;
    let mut sched = LrScheduler::new(&opt, StepLr::new(1, 0.5).map_err(candle_core::Error::from)?);
    let ref_vars = clone_vars(&vars)?;
    let mut plain = candle_nn::SGD::new(ref_vars.clone(), 1.0)?;
    for k in 0..2 {
        opt.backward_step(&loss(&vars, k)?)?;
        sched.step();
        plain.backward_step(&loss(&ref_vars, k)?)?;
        plain.set_learning_rate(plain.learning_rate() * 0.5);
    }
    assert_bitwise(&vars, &ref_vars, "scheduled SGD")?;
    Ok(())
}

#[test]
fn an_optimizer_chosen_at_run_time_is_the_one_it_names() -> Result<()> {
    let params = ParamsAdamW {
        lr: 0.01,
        weight_decay: 0.1,
        ..ParamsAdamW::default()
    };
    let (ours_vars, theirs_vars) = (mlp_vars()?, mlp_vars()?);
    let mut ours = AnyOptimizer::new(ours_vars.clone(), AnyParams::AdamW(params.clone()))?;
    let mut theirs = candle_nn::AdamW::new(theirs_vars.clone(), params)?;
    let (sgd_vars, plain_vars) = (mlp_vars()?, mlp_vars()?);
    let sgd = ParamsSgd {
        lr: 0.05,
        ..ParamsSgd::default()
    };
    let mut any_sgd = AnyOptimizer::new(sgd_vars.clone(), AnyParams::Sgd(sgd))?;
    let mut plain = candle_nn::SGD::new(plain_vars.clone(), 0.05)?;
    for k in 0..4 {
        ours.backward_step(&loss(&ours_vars, k)?)?;
        theirs.backward_step(&loss(&theirs_vars, k)?)?;
        assert_bitwise(
            &ours_vars,
            &theirs_vars,
            &format!("AnyOptimizer::AdamW step {k}"),
        )?;
        any_sgd.backward_step(&loss(&sgd_vars, k)?)?;
        plain.backward_step(&loss(&plain_vars, k)?)?;
        assert_bitwise(
            &sgd_vars,
            &plain_vars,
            &format!("AnyOptimizer::Sgd step {k}"),
        )?;
    }
    assert_eq!(ours.link().steps(), 4);
    assert_ne!(values(&ours_vars)?, values(&mlp_vars()?)?);
    Ok(())
}

#[test]
fn an_optimizer_chosen_at_run_time_resumes_exactly() -> Result<()> {
    round_trip(|vars| {
        let p = ParamsSgd {
            lr: 0.05,
            momentum: 0.9,
            ..ParamsSgd::default()
        };
        AnyOptimizer::new(vars, AnyParams::Sgd(p))
    })
}

#[test]
fn a_schedule_chosen_at_run_time_follows_real_steps() -> Result<()> {
    let vars = mlp_vars()?;
    let mut opt = Sgd::new(
        vars.clone(),
        ParamsSgd {
            lr: 1.0,
            ..ParamsSgd::default()
        },
    )?;
    let chosen: Box<dyn LrSchedule> =
        Box::new(StepLr::new(1, 0.5).map_err(candle_core::Error::from)?);
    let mut sched = LrScheduler::new(&opt, chosen);
    sched.step();
    assert_eq!(opt.learning_rate(), 1.0);
    opt.backward_step(&loss(&vars, 0)?)?;
    sched.step();
    sched.step();
    assert_eq!(opt.learning_rate(), 0.5);
    Ok(())
}
