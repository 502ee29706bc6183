//! AdamW with decoupled weight decay, computing candle-nn's numbers with state that can be
//! saved, restored and re-bound to f32 master weights.

use super::parts::{span_of, InParts};
use super::runs::{self, Run};
use super::state_io::{check_count, check_replacement, find_tensor, read_f64, read_u64, to_f32};
use super::{Linked, OptimizerLink, OptimizerState, StatefulOptimizer};
use crate::error::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};
use std::sync::Arc;

/// AdamW (Loshchilov & Hutter) that gives the same numbers as [`candle_nn::AdamW`] on the same
/// gradients, with its moments and step count exposed through [`StatefulOptimizer`].
///
/// The moments are always f32, whatever the parameters' dtype: an f16 or bf16 parameter is
/// widened to f32 for the update and the result narrowed back. For f32 parameters no cast is
/// made, so the update is bit for bit candle-nn's. As in candle-nn, variables whose dtype is not
/// a float are dropped at construction and variables missing from a [`GradStore`] are left
/// untouched by a step (their moments do not decay either).
///
/// The learning rate lives in the shared [`OptimizerLink`], so an
/// [`LrScheduler`](super::LrScheduler) attached to this optimizer changes it; the `lr` field of
/// the [`ParamsAdamW`] given to `new` is only the starting value.
#[derive(Debug)]
pub struct AdamW {
    vars: Vec<Var>,
    /// The part of each variable it updates: all of it, or (sharded) a run (`runs.rs`).
    runs: Vec<Option<Run>>,
    /// `(exp_avg, exp_avg_sq)` for the variable at the same position in `vars`, in f32.
    moments: Vec<(Var, Var)>,
    params: ParamsAdamW,
    step_t: u64,
    /// The learning rate and bias corrections of the step under way.
    open: Option<Open>,
    link: Arc<OptimizerLink>,
}

impl Optimizer for AdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, params: ParamsAdamW) -> candle_core::Result<Self> {
        validate(&params)?;
        let vars: Vec<Var> = vars.into_iter().filter(|v| v.dtype().is_float()).collect();
        let moments = vars
            .iter()
            .map(|v| {
                let m = Var::zeros(v.shape(), DType::F32, v.device())?;
                let s = Var::zeros(v.shape(), DType::F32, v.device())?;
                Ok((m, s))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let link = OptimizerLink::new(params.lr);
        Ok(AdamW {
            runs: vec![None; vars.len()],
            vars,
            moments,
            params,
            step_t: 0,
            open: None,
            link,
        })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.open_step();
        self.step_open(grads)
    }

    fn learning_rate(&self) -> f64 {
        self.link.lr()
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.link.set_lr(lr)
    }
}

impl InParts for AdamW {
    fn open_step(&mut self) {
        self.step_t += 1;
        self.link.record_step();
        let lr = self.link.lr();
        let p = &self.params;
        // Bias corrections are computed in f64 and applied as tensor scalings, in candle-nn's
        // order, so f32 parameters get exactly candle-nn's numbers.
        let t = i32::try_from(self.step_t).unwrap_or(i32::MAX);
        self.open = Some(Open {
            lr,
            scale_m: 1f64 / (1f64 - p.beta1.powi(t)),
            scale_v: 1f64 / (1f64 - p.beta2.powi(t)),
            decay: 1f64 - lr * p.weight_decay,
        });
    }

    fn step_open(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        let Some(Open {
            lr,
            scale_m,
            scale_v,
            decay,
        }) = self.open
        else {
            candle_core::bail!("AdamW: a part of a step before the step was opened")
        };
        let p = &self.params;
        let fused =
            super::fused::AdamWStep::new((p.beta1, p.beta2), (scale_m, scale_v), p.eps, decay, lr);
        for ((var, (m, v)), run) in self.vars.iter().zip(&self.moments).zip(&self.runs) {
            let Some(grad) = grads.get(var) else {
                continue;
            };
            let theta_t = &runs::target(var, *run)?;
            let (m_t, v_t) = (m.as_tensor(), v.as_tensor());
            if super::fused::enabled()
                && [theta_t, m_t, v_t, grad]
                    .iter()
                    .all(|t| super::fused::fits(t))
                && grad.shape() == theta_t.shape()
            {
                // One pass in place; the same numbers as the ops below.
                super::fused::adamw(theta_t, m_t, v_t, grad, fused)?;
                continue;
            }
            let theta = to_f32(theta_t)?;
            let g = to_f32(grad)?;
            let next_m = ((m.as_tensor() * p.beta1)? + (&g * (1.0 - p.beta1))?)?;
            let next_v = ((v.as_tensor() * p.beta2)? + (g.sqr()? * (1.0 - p.beta2))?)?;
            let m_hat = (&next_m * scale_m)?;
            let v_hat = (&next_v * scale_v)?;
            let update = (m_hat / (v_hat.sqrt()? + p.eps)?)?;
            let next_theta = ((theta * decay)? - (update * lr)?)?;
            m.set(&next_m)?;
            v.set(&next_v)?;
            runs::write(var, *run, &next_theta.to_dtype(var.dtype())?)?;
        }
        Ok(())
    }

    fn step_span(&mut self, var: &Var, from: usize, grad: &Tensor) -> candle_core::Result<bool> {
        let Some(o) = self.open else {
            candle_core::bail!("AdamW: a part of a step before the step was opened")
        };
        let id = var.as_tensor().id();
        let Some(i) = self.vars.iter().position(|v| v.as_tensor().id() == id) else {
            return Ok(false);
        };
        if self.runs[i].is_some() || !super::fused::enabled() {
            return Ok(false);
        }
        let len = grad.elem_count();
        let (m, v) = &self.moments[i];
        let theta = span_of(self.vars[i].as_tensor(), from, len)?;
        let (m, v) = (
            span_of(m.as_tensor(), from, len)?,
            span_of(v.as_tensor(), from, len)?,
        );
        if ![&theta, &m, &v, grad].iter().all(|t| super::fused::fits(t)) {
            return Ok(false);
        }
        let p = &self.params;
        let fused = super::fused::AdamWStep::new(
            (p.beta1, p.beta2),
            (o.scale_m, o.scale_v),
            p.eps,
            o.decay,
            o.lr,
        );
        super::fused::adamw(&theta, &m, &v, grad, fused)?;
        Ok(true)
    }
}

/// What every variable's update of the open step uses (`InParts`).
#[derive(Debug, Clone, Copy)]
struct Open {
    lr: f64,
    scale_m: f64,
    scale_v: f64,
    decay: f64,
}

impl AdamW {
    /// The hyper-parameters, with `lr` set to the learning rate the next step will use.
    pub fn params(&self) -> ParamsAdamW {
        ParamsAdamW {
            lr: self.link.lr(),
            ..self.params.clone()
        }
    }

    /// Steps taken so far (the `t` of the bias correction).
    pub fn step_count(&self) -> u64 {
        self.step_t
    }

    /// [`rebind_fresh`](StatefulOptimizer::rebind_fresh) where variable `i` may be updated
    /// only on `runs[i]` (`runs.rs`).
    pub(crate) fn rebind_runs(&mut self, vars: Vec<Var>, runs: Vec<Option<Run>>) -> Result<()> {
        if self.step_t != 0 {
            return Err(Error::Usage(
                "AdamW: shard an optimizer before its first step (prepare it before training)"
                    .into(),
            ));
        }
        self.moments = vars
            .iter()
            .zip(&runs)
            .map(|(v, r)| {
                let shape = runs::shape(v, *r);
                let m = Var::zeros(shape.clone(), DType::F32, v.device())?;
                let s = Var::zeros(shape, DType::F32, v.device())?;
                Ok((m, s))
            })
            .collect::<Result<Vec<_>>>()?;
        self.vars = vars;
        self.runs = runs;
        Ok(())
    }
}

impl Linked for AdamW {
    fn link(&self) -> &Arc<OptimizerLink> {
        &self.link
    }
}

impl StatefulOptimizer for AdamW {
    fn vars(&self) -> &[Var] {
        &self.vars
    }

    fn replace_vars(&mut self, vars: Vec<Var>) -> Result<()> {
        check_replacement(&self.vars, &vars, "AdamW")?;
        self.vars = vars;
        Ok(())
    }

    fn rebind_fresh(&mut self, vars: Vec<Var>) -> Result<()> {
        let whole = vec![None; vars.len()];
        self.rebind_runs(vars, whole)
    }

    fn state_dict(&self) -> Result<OptimizerState> {
        let tensors = self
            .moments
            .iter()
            .map(|(m, v)| {
                // A copy, not a view: the moments are overwritten in place by later steps.
                Ok(vec![
                    ("exp_avg".to_string(), m.as_tensor().copy()?),
                    ("exp_avg_sq".to_string(), v.as_tensor().copy()?),
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let scalars = serde_json::json!({
            "step": self.step_t,
            "lr": self.link.lr(),
            "beta1": self.params.beta1,
            "beta2": self.params.beta2,
            "eps": self.params.eps,
            "weight_decay": self.params.weight_decay,
        });
        Ok(OptimizerState { tensors, scalars })
    }

    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        check_count(state, self.vars.len(), "AdamW")?;
        let s = &state.scalars;
        let step = read_u64(s, "step", "AdamW")?;
        let params = ParamsAdamW {
            lr: read_f64(s, "lr", "AdamW")?,
            beta1: read_f64(s, "beta1", "AdamW")?,
            beta2: read_f64(s, "beta2", "AdamW")?,
            eps: read_f64(s, "eps", "AdamW")?,
            weight_decay: read_f64(s, "weight_decay", "AdamW")?,
        };
        validate(&params)?;
        // Everything is checked before anything is changed, so a bad state leaves the
        // optimizer as it was.
        let mut restored = Vec::with_capacity(self.vars.len());
        for (i, (var, entry)) in self.vars.iter().zip(&state.tensors).enumerate() {
            let shape = runs::shape(var, self.runs[i]);
            let m = find_tensor(entry, "exp_avg", i, &shape, var.device(), "AdamW")?;
            let v = find_tensor(entry, "exp_avg_sq", i, &shape, var.device(), "AdamW")?;
            if entry.len() != 2 {
                return Err(Error::Usage(format!(
                    "AdamW state for variable {i} has {} tensors, expected exactly `exp_avg` and \
                     `exp_avg_sq`: load a state saved by an ivme AdamW",
                    entry.len()
                )));
            }
            restored.push((m, v));
        }
        for ((m, v), (m_dst, v_dst)) in restored.iter().zip(&self.moments) {
            m_dst.set(m)?;
            v_dst.set(v)?;
        }
        self.step_t = step;
        self.link.set_steps(step);
        self.link.set_lr(params.lr);
        self.params = params;
        Ok(())
    }
}

/// Rejects hyper-parameters that would make the update meaningless (division by zero in the
/// bias correction, growing weights).
fn validate(p: &ParamsAdamW) -> Result<()> {
    let fix = |key: &str, value: f64, fix: &str| Err(Error::config(key, value, fix));
    if !(p.lr.is_finite() && p.lr >= 0.0) {
        return fix("lr", p.lr, "use a finite learning rate >= 0, e.g. 1e-3");
    }
    if !(0.0..1.0).contains(&p.beta1) {
        return fix("beta1", p.beta1, "use a value in [0, 1), e.g. 0.9");
    }
    if !(0.0..1.0).contains(&p.beta2) {
        return fix("beta2", p.beta2, "use a value in [0, 1), e.g. 0.999");
    }
    if !(p.eps.is_finite() && p.eps >= 0.0) {
        return fix("eps", p.eps, "use a small finite value >= 0, e.g. 1e-8");
    }
    if !(p.weight_decay.is_finite() && p.weight_decay >= 0.0) {
        return fix(
            "weight_decay",
            p.weight_decay,
            "use a finite value >= 0, e.g. 0.01 (0 disables decay)",
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn params(wd: f64) -> ParamsAdamW {
        ParamsAdamW {
            lr: 0.1,
            weight_decay: wd,
            ..ParamsAdamW::default()
        }
    }

    /// The AdamW update written out once more with plain f32 arithmetic.
    fn reference_step(
        theta: f32,
        g: f32,
        m: &mut f32,
        v: &mut f32,
        t: i32,
        p: &ParamsAdamW,
    ) -> f32 {
        *m = *m * p.beta1 as f32 + g * (1.0 - p.beta1) as f32;
        *v = *v * p.beta2 as f32 + g * g * (1.0 - p.beta2) as f32;
        let m_hat = *m / (1.0 - p.beta1.powi(t)) as f32;
        let v_hat = *v / (1.0 - p.beta2.powi(t)) as f32;
        theta * (1.0 - p.lr * p.weight_decay) as f32
            - p.lr as f32 * m_hat / (v_hat.sqrt() + p.eps as f32)
    }

    fn round_f16(xs: &[f32]) -> Result<Vec<f32>> {
        let t = Tensor::new(xs, &Device::Cpu)?.to_dtype(DType::F16)?;
        Ok(t.to_dtype(DType::F32)?.to_vec1::<f32>()?)
    }

    #[test]
    fn f16_parameter_keeps_f32_moments_and_matches_f32_maths() -> Result<()> {
        let dev = Device::Cpu;
        let init = [0.5f32, -1.25, 2.0];
        let w = Var::from_tensor(&Tensor::new(&init, &dev)?.to_dtype(DType::F16)?)?;
        let x = Tensor::new(&[1.0f32, 2.0, -3.0], &dev)?.to_dtype(DType::F16)?;
        let p = params(0.01);
        let mut opt = AdamW::new(vec![w.clone()], p.clone())?;
        let (mut m, mut v) = ([0f32; 3], [0f32; 3]);
        let mut theta: Vec<f32> = init.to_vec();
        for t in 1..=3 {
            let loss = (w.as_tensor() * &x)?.sum_all()?;
            opt.backward_step(&loss)?;
            // d(loss)/dw = x, exactly representable in f16.
            let g = [1.0f32, 2.0, -3.0];
            let stored = round_f16(&theta)?;
            for i in 0..3 {
                theta[i] = reference_step(stored[i], g[i], &mut m[i], &mut v[i], t, &p);
            }
            let got = w.as_tensor().to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let want = round_f16(&theta)?;
            for i in 0..3 {
                // One f16 ulp: the f32 maths may land on either side of a rounding boundary.
                let tol = 1e-3 * want[i].abs().max(1.0);
                assert!(
                    (got[i] - want[i]).abs() <= tol,
                    "step {t} var {i}: {} vs {}",
                    got[i],
                    want[i]
                );
            }
        }
        assert_eq!(w.dtype(), DType::F16);
        let state = opt.state_dict()?;
        assert_eq!(state.tensors[0][0].1.dtype(), DType::F32);
        assert_eq!(state.scalars["step"], 3);
        Ok(())
    }

    #[test]
    fn missing_gradient_leaves_variable_untouched_and_counts_step() -> Result<()> {
        let dev = Device::Cpu;
        let a = Var::new(&[1.0f32, 2.0], &dev)?;
        let b = Var::new(&[3.0f32], &dev)?;
        let mut opt = AdamW::new(vec![a.clone(), b.clone()], params(0.1))?;
        opt.backward_step(&a.as_tensor().sum_all()?)?;
        assert_eq!(b.as_tensor().to_vec1::<f32>()?, vec![3.0]);
        assert_ne!(a.as_tensor().to_vec1::<f32>()?, vec![1.0, 2.0]);
        assert_eq!(opt.link().steps(), 1);
        assert_eq!(opt.step_count(), 1);
        Ok(())
    }

    #[test]
    fn learning_rate_goes_through_the_link() -> Result<()> {
        let v = Var::new(&[1.0f32], &Device::Cpu)?;
        let mut opt = AdamW::new(vec![v], params(0.0))?;
        assert_eq!(opt.learning_rate(), 0.1);
        opt.set_learning_rate(0.25);
        assert_eq!(opt.link().lr(), 0.25);
        opt.link().set_lr(0.5);
        assert_eq!(opt.learning_rate(), 0.5);
        assert_eq!(opt.params().lr, 0.5);
        Ok(())
    }

    #[test]
    fn bad_hyper_parameters_are_rejected() {
        let bad = [
            ParamsAdamW {
                beta1: 1.0,
                ..params(0.0)
            },
            ParamsAdamW {
                beta2: -0.1,
                ..params(0.0)
            },
            ParamsAdamW {
                lr: f64::NAN,
                ..params(0.0)
            },
            ParamsAdamW {
                eps: -1.0,
                ..params(0.0)
            },
            ParamsAdamW {
                weight_decay: -0.5,
                ..params(0.0)
            },
        ];
        for p in bad {
            let err = AdamW::new(vec![], p.clone()).unwrap_err().to_string();
            assert!(err.contains("use"), "{p:?}: {err}");
        }
    }

    #[test]
    fn non_float_variables_are_dropped() -> Result<()> {
        let dev = Device::Cpu;
        let f = Var::new(&[1.0f32], &dev)?;
        let i = Var::new(&[1u32], &dev)?;
        let opt = AdamW::new(vec![i, f.clone()], params(0.0))?;
        assert_eq!(opt.vars().len(), 1);
        assert!(opt.vars()[0].as_tensor().id() == f.as_tensor().id());
        Ok(())
    }

    #[test]
    fn replace_vars_checks_count_and_shapes() -> Result<()> {
        let dev = Device::Cpu;
        let a = Var::new(&[1.0f32, 2.0], &dev)?;
        let mut opt = AdamW::new(vec![a], params(0.0))?;
        let err = opt.replace_vars(vec![]).unwrap_err().to_string();
        assert!(err.contains("got 0 variables"), "{err}");
        let wrong = Var::new(&[1.0f32, 2.0, 3.0], &dev)?;
        let err = opt.replace_vars(vec![wrong]).unwrap_err().to_string();
        assert!(err.contains("variable 0"), "{err}");
        let right = Var::new(&[5.0f32, 6.0], &dev)?;
        opt.replace_vars(vec![right.clone()])?;
        assert!(opt.vars()[0].as_tensor().id() == right.as_tensor().id());
        Ok(())
    }

    #[test]
    fn load_state_dict_names_the_bad_variable_and_changes_nothing() -> Result<()> {
        let dev = Device::Cpu;
        let a = Var::new(&[1.0f32, 2.0], &dev)?;
        let b = Var::new(&[3.0f32], &dev)?;
        let mut opt = AdamW::new(vec![a.clone(), b.clone()], params(0.0))?;
        let loss = (a.as_tensor().sum_all()? + b.as_tensor().sum_all()?)?;
        opt.backward_step(&loss)?;
        let mut state = opt.state_dict()?;
        state.tensors[1][1].1 = Tensor::zeros(4, DType::F32, &dev)?;
        state.scalars["step"] = 7.into();
        let err = opt.load_state_dict(&state).unwrap_err().to_string();
        assert!(
            err.contains("variable 1") && err.contains("exp_avg_sq"),
            "{err}"
        );
        assert_eq!(opt.step_count(), 1);
        state.tensors.pop();
        let err = opt.load_state_dict(&state).unwrap_err().to_string();
        assert!(err.contains("has 1 variables"), "{err}");
        Ok(())
    }
}
