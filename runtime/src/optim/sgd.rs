//! Stochastic gradient descent with momentum, dampening, Nesterov and weight decay, with
//! state that can be saved, restored and re-bound to f32 master weights.

use super::parts::{span_of, InParts};
use super::runs::{self, Run};
use super::state_io::{check_count, check_replacement, find_tensor, read_f64, read_u64, to_f32};
use super::{Linked, OptimizerLink, OptimizerState, StatefulOptimizer};
use crate::error::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::Optimizer;
use std::sync::Arc;

/// The hyper-parameters of [`Sgd`], with PyTorch's meanings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParamsSgd {
    /// Learning rate (the starting value; a scheduler may change it).
    pub lr: f64,
    /// Momentum factor; 0 disables momentum and keeps no buffer.
    pub momentum: f64,
    /// Fraction of each new gradient held back from the momentum buffer.
    pub dampening: f64,
    /// L2 penalty added to the gradient (`g += weight_decay * θ`), not decoupled.
    pub weight_decay: f64,
    /// Nesterov momentum: step along `g + momentum * buf` instead of `buf`.
    pub nesterov: bool,
}

impl Default for ParamsSgd {
    /// Learning rate 0.01, no momentum, no dampening, no weight decay, no Nesterov.
    fn default() -> Self {
        ParamsSgd {
            lr: 0.01,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

/// SGD with PyTorch's update rule:
///
/// ```text
/// g = grad + weight_decay * θ
/// buf = g                                          (first step with a gradient)
/// buf = momentum * buf + (1 - dampening) * g       (later steps)
/// g = nesterov ? g + momentum * buf : buf          (only when momentum != 0)
/// θ = θ - lr * g
/// ```
///
/// With momentum and weight decay both 0 it is bit for bit candle-nn's [`candle_nn::SGD`] on
/// f32 parameters. Momentum buffers are f32 whatever the parameters' dtype; non-f32
/// parameters are widened for the update and narrowed back. Non-float variables are dropped at
/// construction and variables missing from a [`GradStore`] are skipped, as in candle-nn.
///
/// In [`StatefulOptimizer::state_dict`] a variable's entry is `[("momentum_buffer", buf)]`
/// once it has a buffer, and an empty list while it has none (momentum 0, or no gradient seen
/// yet); loading an empty entry clears the buffer, so the next step starts it afresh.
#[derive(Debug)]
pub struct Sgd {
    vars: Vec<Var>,
    /// The part of each variable it updates: all of it, or (sharded) a run (`runs.rs`).
    runs: Vec<Option<Run>>,
    /// The momentum buffer of the variable at the same position in `vars`, once it has one.
    buffers: Vec<Option<Var>>,
    params: ParamsSgd,
    step_t: u64,
    /// The learning rate of the step under way (`InParts`).
    open_lr: Option<f64>,
    link: Arc<OptimizerLink>,
}

impl Optimizer for Sgd {
    type Config = ParamsSgd;

    fn new(vars: Vec<Var>, params: ParamsSgd) -> candle_core::Result<Self> {
        validate(&params)?;
        let vars: Vec<Var> = vars.into_iter().filter(|v| v.dtype().is_float()).collect();
        let buffers = vec![None; vars.len()];
        Ok(Sgd {
            runs: vec![None; vars.len()],
            vars,
            buffers,
            link: OptimizerLink::new(params.lr),
            params,
            step_t: 0,
            open_lr: None,
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

impl InParts for Sgd {
    fn open_step(&mut self) {
        self.step_t += 1;
        self.link.record_step();
        self.open_lr = Some(self.link.lr());
    }

    fn step_open(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        let Some(lr) = self.open_lr else {
            candle_core::bail!("Sgd: a part of a step before the step was opened")
        };
        let p = self.params;
        let fused = self.fused_step(lr);
        for ((var, buffer), run) in self
            .vars
            .iter()
            .zip(self.buffers.iter_mut())
            .zip(&self.runs)
        {
            let Some(grad) = grads.get(var) else {
                continue;
            };
            let target = &runs::target(var, *run)?;
            // One pass in place once the momentum buffer exists (or without momentum); the
            // same numbers as the ops below.
            let buf = buffer.as_ref().map(|b| b.as_tensor());
            if super::fused::enabled()
                && (p.momentum == 0.0 || buf.is_some())
                && super::fused::fits(target)
                && super::fused::fits(grad)
                && buf.is_none_or(super::fused::fits)
                && grad.shape() == target.shape()
            {
                super::fused::sgd(target, buf.filter(|_| p.momentum != 0.0), grad, fused)?;
                continue;
            }
            let theta = to_f32(target)?;
            let mut g = to_f32(grad)?;
            if p.weight_decay != 0.0 {
                g = (g + (&theta * p.weight_decay)?)?;
            }
            if p.momentum != 0.0 {
                let buf = match buffer {
                    Some(buf) => {
                        let next = ((buf.as_tensor() * p.momentum)? + (&g * (1.0 - p.dampening))?)?;
                        buf.set(&next)?;
                        next
                    }
                    None => {
                        // A fresh storage: the gradient itself belongs to the caller's store.
                        let buf = Var::zeros(g.shape(), DType::F32, g.device())?;
                        buf.set(&g)?;
                        *buffer = Some(buf);
                        g.clone()
                    }
                };
                g = if p.nesterov {
                    (g + (buf * p.momentum)?)?
                } else {
                    buf
                };
            }
            let next_theta = theta.sub(&(g * lr)?)?;
            runs::write(var, *run, &next_theta.to_dtype(var.dtype())?)?;
        }
        Ok(())
    }

    fn step_span(&mut self, var: &Var, from: usize, grad: &Tensor) -> candle_core::Result<bool> {
        let Some(lr) = self.open_lr else {
            candle_core::bail!("Sgd: a part of a step before the step was opened")
        };
        let id = var.as_tensor().id();
        let Some(i) = self.vars.iter().position(|v| v.as_tensor().id() == id) else {
            return Ok(false);
        };
        let p = self.params;
        // A first momentum step starts the buffer from the whole gradient: left whole.
        if self.runs[i].is_some()
            || !super::fused::enabled()
            || (p.momentum != 0.0 && self.buffers[i].is_none())
        {
            return Ok(false);
        }
        let len = grad.elem_count();
        let target = span_of(self.vars[i].as_tensor(), from, len)?;
        let buf = match &self.buffers[i] {
            Some(b) if p.momentum != 0.0 => Some(span_of(b.as_tensor(), from, len)?),
            _ => None,
        };
        if !super::fused::fits(&target)
            || !super::fused::fits(grad)
            || !buf.as_ref().is_none_or(super::fused::fits)
        {
            return Ok(false);
        }
        super::fused::sgd(&target, buf.as_ref(), grad, self.fused_step(lr))?;
        Ok(true)
    }
}

impl Sgd {
    /// The constants of the fused pass at learning rate `lr`.
    fn fused_step(&self, lr: f64) -> super::fused::SgdStep {
        let p = self.params;
        super::fused::SgdStep {
            weight_decay: (p.weight_decay != 0.0).then_some(p.weight_decay as f32),
            momentum: p.momentum as f32,
            one_minus_dampening: (1.0 - p.dampening) as f32,
            nesterov: p.nesterov,
            lr: lr as f32,
        }
    }

    /// The hyper-parameters, with `lr` set to the learning rate the next step will use.
    pub fn params(&self) -> ParamsSgd {
        ParamsSgd {
            lr: self.link.lr(),
            ..self.params
        }
    }

    /// Steps taken so far.
    pub fn step_count(&self) -> u64 {
        self.step_t
    }

    /// [`rebind_fresh`](StatefulOptimizer::rebind_fresh) where variable `i` may be updated
    /// only on `runs[i]` (`runs.rs`).
    pub(crate) fn rebind_runs(&mut self, vars: Vec<Var>, runs: Vec<Option<Run>>) -> Result<()> {
        if self.step_t != 0 {
            return Err(Error::Usage(
                "Sgd: shard an optimizer before its first step (prepare it before training)".into(),
            ));
        }
        self.buffers = vec![None; vars.len()];
        self.vars = vars;
        self.runs = runs;
        Ok(())
    }
}

impl Linked for Sgd {
    fn link(&self) -> &Arc<OptimizerLink> {
        &self.link
    }
}

impl StatefulOptimizer for Sgd {
    fn vars(&self) -> &[Var] {
        &self.vars
    }

    fn replace_vars(&mut self, vars: Vec<Var>) -> Result<()> {
        check_replacement(&self.vars, &vars, "Sgd")?;
        self.vars = vars;
        Ok(())
    }

    fn rebind_fresh(&mut self, vars: Vec<Var>) -> Result<()> {
        let whole = vec![None; vars.len()];
        self.rebind_runs(vars, whole)
    }

    fn state_dict(&self) -> Result<OptimizerState> {
        let tensors = self
            .buffers
            .iter()
            .map(|b| match b {
                // A copy, not a view: the buffer is overwritten in place by later steps.
                Some(b) => Ok(vec![("momentum_buffer".to_string(), b.as_tensor().copy()?)]),
                None => Ok(vec![]),
            })
            .collect::<Result<Vec<_>>>()?;
        let p = &self.params;
        let scalars = serde_json::json!({
            "step": self.step_t,
            "lr": self.link.lr(),
            "momentum": p.momentum,
            "dampening": p.dampening,
            "weight_decay": p.weight_decay,
            "nesterov": p.nesterov,
        });
        Ok(OptimizerState { tensors, scalars })
    }

    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        check_count(state, self.vars.len(), "Sgd")?;
        let s = &state.scalars;
        let step = read_u64(s, "step", "Sgd")?;
        let nesterov = s.get("nesterov").and_then(|v| v.as_bool()).ok_or_else(|| {
            Error::Usage(
                "Sgd state has no boolean `nesterov`: load a state saved by an ivme Sgd".into(),
            )
        })?;
        let params = ParamsSgd {
            lr: read_f64(s, "lr", "Sgd")?,
            momentum: read_f64(s, "momentum", "Sgd")?,
            dampening: read_f64(s, "dampening", "Sgd")?,
            weight_decay: read_f64(s, "weight_decay", "Sgd")?,
            nesterov,
        };
        validate(&params)?;
        // Everything is checked before anything is changed, so a bad state leaves the
        // optimizer as it was.
        let mut restored = Vec::with_capacity(self.vars.len());
        for (i, (var, entry)) in self.vars.iter().zip(&state.tensors).enumerate() {
            match entry.len() {
                0 => restored.push(None),
                1 => {
                    let shape = runs::shape(var, self.runs[i]);
                    let t = find_tensor(entry, "momentum_buffer", i, &shape, var.device(), "Sgd")?;
                    restored.push(Some(t))
                }
                n => {
                    return Err(Error::Usage(format!(
                        "Sgd state for variable {i} has {n} tensors, expected at most one \
                         `momentum_buffer`: load a state saved by an ivme Sgd"
                    )))
                }
            }
        }
        for (dst, src) in self.buffers.iter_mut().zip(restored) {
            *dst = match src {
                // `set` keeps the existing storage, so views handed out earlier stay valid.
                Some(t) => match dst {
                    Some(buf) => {
                        buf.set(&t)?;
                        Some(buf.clone())
                    }
                    None => {
                        let buf = Var::zeros(t.shape(), DType::F32, t.device())?;
                        buf.set(&t)?;
                        Some(buf)
                    }
                },
                None => None,
            };
        }
        self.step_t = step;
        self.link.set_steps(step);
        self.link.set_lr(params.lr);
        self.params = params;
        Ok(())
    }
}

/// Rejects settings PyTorch also rejects, with what to use instead.
fn validate(p: &ParamsSgd) -> Result<()> {
    let nonneg = |key: &str, value: f64, example: &str| {
        if value.is_finite() && value >= 0.0 {
            Ok(())
        } else {
            Err(Error::config(
                key,
                value,
                format!("use a finite value >= 0, e.g. {example}"),
            ))
        }
    };
    nonneg("lr", p.lr, "0.01")?;
    nonneg("momentum", p.momentum, "0.9 (0 disables momentum)")?;
    nonneg("dampening", p.dampening, "0")?;
    nonneg("weight_decay", p.weight_decay, "1e-4 (0 disables decay)")?;
    if p.nesterov && (p.momentum <= 0.0 || p.dampening != 0.0) {
        return Err(Error::config(
            "nesterov",
            true,
            "Nesterov momentum needs momentum > 0 and dampening = 0: set them, or nesterov = false",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn momentum(m: f64) -> ParamsSgd {
        ParamsSgd {
            lr: 0.5,
            momentum: m,
            ..ParamsSgd::default()
        }
    }

    /// Loss `sum(w * x)` has gradient `x`, so each step's update is known in advance.
    fn step_linear(opt: &mut Sgd, w: &Var, x: &[f32]) -> Result<Vec<f32>> {
        let x = Tensor::new(x, &Device::Cpu)?;
        opt.backward_step(&(w.as_tensor() * x)?.sum_all()?)?;
        Ok(w.as_tensor().to_vec1::<f32>()?)
    }

    #[test]
    fn momentum_accumulates_by_hand_computed_values() -> Result<()> {
        let w = Var::new(&[1.0f32, -2.0], &Device::Cpu)?;
        let mut opt = Sgd::new(vec![w.clone()], momentum(0.5))?;
        assert!(opt.state_dict()?.tensors[0].is_empty());
        // buf = [1, 2]; w = [1, -2] - 0.5 * [1, 2]
        assert_eq!(step_linear(&mut opt, &w, &[1.0, 2.0])?, vec![0.5, -3.0]);
        // buf = 0.5 * [1, 2] + [1, 2] = [1.5, 3]; w -= 0.5 * buf
        assert_eq!(step_linear(&mut opt, &w, &[1.0, 2.0])?, vec![-0.25, -4.5]);
        let state = opt.state_dict()?;
        assert_eq!(state.tensors[0][0].0, "momentum_buffer");
        assert_eq!(state.tensors[0][0].1.to_vec1::<f32>()?, vec![1.5, 3.0]);
        Ok(())
    }

    #[test]
    fn nesterov_dampening_and_weight_decay_by_hand() -> Result<()> {
        let w = Var::new(&[2.0f32], &Device::Cpu)?;
        let p = ParamsSgd {
            lr: 0.25,
            momentum: 0.5,
            weight_decay: 0.5,
            nesterov: true,
            ..ParamsSgd::default()
        };
        let mut opt = Sgd::new(vec![w.clone()], p)?;
        // g = 1 + 0.5*2 = 2; buf = 2; g = 2 + 0.5*2 = 3; w = 2 - 0.25*3
        assert_eq!(step_linear(&mut opt, &w, &[1.0])?, vec![1.25]);
        // g = 1 + 0.625 = 1.625; buf = 1 + 1.625 = 2.625; g = 1.625 + 1.3125 = 2.9375
        assert_eq!(
            step_linear(&mut opt, &w, &[1.0])?,
            vec![1.25 - 0.25 * 2.9375]
        );

        let w = Var::new(&[0.0f32], &Device::Cpu)?;
        let p = ParamsSgd {
            lr: 1.0,
            momentum: 1.0,
            dampening: 0.75,
            ..ParamsSgd::default()
        };
        let mut opt = Sgd::new(vec![w.clone()], p)?;
        // The first step takes the whole gradient, dampening applies from the second on.
        assert_eq!(step_linear(&mut opt, &w, &[4.0])?, vec![-4.0]);
        assert_eq!(step_linear(&mut opt, &w, &[4.0])?, vec![-9.0]);
        Ok(())
    }

    #[test]
    fn bad_settings_are_rejected_with_a_fix() {
        let bad = [
            ParamsSgd {
                lr: -1.0,
                ..ParamsSgd::default()
            },
            ParamsSgd {
                momentum: f64::NAN,
                ..ParamsSgd::default()
            },
            ParamsSgd {
                nesterov: true,
                ..ParamsSgd::default()
            },
            ParamsSgd {
                nesterov: true,
                dampening: 0.1,
                ..momentum(0.9)
            },
        ];
        for p in bad {
            let err = Sgd::new(vec![], p).unwrap_err().to_string();
            assert!(
                err.contains("use") || err.contains("set them"),
                "{p:?}: {err}"
            );
        }
    }

    #[test]
    fn state_round_trip_restores_buffers_and_steps() -> Result<()> {
        let dev = Device::Cpu;
        let a = Var::new(&[1.0f32, 2.0], &dev)?;
        let b = Var::new(&[3.0f32], &dev)?;
        let mut opt = Sgd::new(vec![a.clone(), b.clone()], momentum(0.9))?;
        // Only `a` gets a gradient, so only `a` has a buffer.
        step_linear(&mut opt, &a, &[1.0, 1.0])?;
        let state = opt.state_dict()?;
        assert_eq!(state.tensors[1].len(), 0);
        assert_eq!(state.scalars["step"], 1);

        let a2 = Var::new(&[1.0f32, 2.0], &dev)?;
        let b2 = Var::new(&[3.0f32], &dev)?;
        let mut other = Sgd::new(vec![a2, b2], ParamsSgd::default())?;
        other.load_state_dict(&state)?;
        assert_eq!(other.params(), opt.params());
        assert_eq!(other.link().steps(), 1);
        let back = other.state_dict()?;
        assert_eq!(back.tensors[0][0].1.to_vec1::<f32>()?, vec![1.0, 1.0]);
        assert!(back.tensors[1].is_empty());

        let mut bad = state.clone();
        bad.tensors[0][0].0 = "exp_avg".into();
        let err = other.load_state_dict(&bad).unwrap_err().to_string();
        assert!(
            err.contains("variable 0") && err.contains("momentum_buffer"),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn bf16_parameter_uses_f32_buffer() -> Result<()> {
        let dev = Device::Cpu;
        let w = Var::from_tensor(&Tensor::new(&[1.0f32], &dev)?.to_dtype(DType::BF16)?)?;
        let mut opt = Sgd::new(vec![w.clone()], momentum(0.5))?;
        let x = Tensor::new(&[2.0f32], &dev)?.to_dtype(DType::BF16)?;
        opt.backward_step(&(w.as_tensor() * &x)?.sum_all()?)?;
        assert_eq!(w.dtype(), DType::BF16);
        assert_eq!(
            w.as_tensor().to_dtype(DType::F32)?.to_vec1::<f32>()?,
            vec![0.0]
        );
        assert_eq!(opt.state_dict()?.tensors[0][0].1.dtype(), DType::F32);
        Ok(())
    }
}
