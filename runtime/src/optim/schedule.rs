//! Learning-rate schedules and the scheduler that applies one to an optimizer.
//!
//! A schedule is a pure function from "real optimizer steps taken" to a multiplier of the base
//! learning rate. The [`LrScheduler`] reads the step count from the optimizer's
//! [`OptimizerLink`](crate::optim::OptimizerLink) instead of counting its own calls, so it
//! advances exactly once per real optimizer step however often `step()` is called:
//! accumulation micro-steps, skipped fp16 steps and calls on every rank do not move it
//! (DESIGN.md, decision 1).

pub use super::scheduler::LrScheduler;
use crate::error::{Error, Result};
use std::f64::consts::PI;
use std::fmt;

/// A learning-rate schedule: the multiplier of the base learning rate after a number of real
/// optimizer steps.
pub trait LrSchedule: Send {
    /// The multiplier of the base learning rate once `step` real optimizer steps have been
    /// taken (`step = 0` is the rate of the very first step).
    fn factor(&self, step: u64) -> f64;
    /// A short name saved with the scheduler's state, checked when it is loaded back.
    fn name(&self) -> &'static str;
}

/// Keeps the base learning rate unchanged.
#[derive(Debug, Clone, Copy, Default)]
pub struct ConstantLr;

impl LrSchedule for ConstantLr {
    fn factor(&self, _step: u64) -> f64 {
        1.0
    }
    fn name(&self) -> &'static str {
        "constant"
    }
}

/// Multiplies the learning rate by `gamma` every `step_size` steps: factor
/// `gamma^(step / step_size)` (integer division).
#[derive(Debug, Clone, Copy)]
pub struct StepLr {
    step_size: u64,
    gamma: f64,
}

impl StepLr {
    /// A step decay by `gamma` every `step_size` optimizer steps.
    pub fn new(step_size: u64, gamma: f64) -> Result<Self> {
        if step_size == 0 {
            return Err(Error::config(
                "step_size",
                0,
                "use the number of optimizer steps between decays, at least 1",
            ));
        }
        check_gamma(gamma)?;
        Ok(StepLr { step_size, gamma })
    }
}

impl LrSchedule for StepLr {
    fn factor(&self, step: u64) -> f64 {
        powi(self.gamma, step / self.step_size)
    }
    fn name(&self) -> &'static str {
        "step"
    }
}

/// Multiplies the learning rate by `gamma` every step: factor `gamma^step`.
#[derive(Debug, Clone, Copy)]
pub struct ExponentialLr {
    gamma: f64,
}

impl ExponentialLr {
    /// An exponential decay by `gamma` per optimizer step.
    pub fn new(gamma: f64) -> Result<Self> {
        check_gamma(gamma)?;
        Ok(ExponentialLr { gamma })
    }
}

impl LrSchedule for ExponentialLr {
    fn factor(&self, step: u64) -> f64 {
        powi(self.gamma, step)
    }
    fn name(&self) -> &'static str {
        "exponential"
    }
}

/// Rises linearly from 0 to 1 over `warmup` steps, then falls linearly to 0 at `total` steps
/// and stays there.
#[derive(Debug, Clone, Copy)]
pub struct WarmupLinear {
    warmup: u64,
    total: u64,
}

impl WarmupLinear {
    /// A linear warm-up over `warmup` steps followed by a linear decay reaching 0 at `total`.
    pub fn new(warmup: u64, total: u64) -> Result<Self> {
        check_warmup(warmup, total)?;
        Ok(WarmupLinear { warmup, total })
    }
}

impl LrSchedule for WarmupLinear {
    fn factor(&self, step: u64) -> f64 {
        warmup_then(step, self.warmup, self.total, |progress| 1.0 - progress)
    }
    fn name(&self) -> &'static str {
        "warmup_linear"
    }
}

/// Rises linearly from 0 to 1 over `warmup` steps, then falls along a half cosine to 0 at
/// `total` steps and stays there.
#[derive(Debug, Clone, Copy)]
pub struct WarmupCosine {
    warmup: u64,
    total: u64,
}

impl WarmupCosine {
    /// A linear warm-up over `warmup` steps followed by a half-cosine decay reaching 0 at
    /// `total`.
    pub fn new(warmup: u64, total: u64) -> Result<Self> {
        check_warmup(warmup, total)?;
        Ok(WarmupCosine { warmup, total })
    }
}

impl LrSchedule for WarmupCosine {
    fn factor(&self, step: u64) -> f64 {
        warmup_then(step, self.warmup, self.total, |progress| {
            0.5 * (1.0 + (PI * progress).cos())
        })
    }
    fn name(&self) -> &'static str {
        "warmup_cosine"
    }
}

/// Rises linearly from 0 to 1 over `warmup` steps, then keeps the base learning rate: the
/// usual schedule for fine-tuning.
#[derive(Debug, Clone, Copy)]
pub struct WarmupConstant {
    warmup: u64,
}

impl WarmupConstant {
    /// A linear warm-up over `warmup` steps (0: none), then the base rate for good.
    pub fn new(warmup: u64) -> Self {
        WarmupConstant { warmup }
    }
}

impl LrSchedule for WarmupConstant {
    fn factor(&self, step: u64) -> f64 {
        warmup_then(step, self.warmup, u64::MAX, |_| 1.0)
    }
    fn name(&self) -> &'static str {
        "warmup_constant"
    }
}

/// A schedule given by a function of the step count. The function should return a finite,
/// non-negative multiplier: its value is used as is.
pub struct LambdaLr {
    f: Box<dyn Fn(u64) -> f64 + Send>,
}

impl LambdaLr {
    /// A schedule whose factor after `step` real optimizer steps is `f(step)`.
    pub fn new(f: impl Fn(u64) -> f64 + Send + 'static) -> Self {
        LambdaLr { f: Box::new(f) }
    }
}

impl fmt::Debug for LambdaLr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LambdaLr(<fn>)")
    }
}

impl LrSchedule for LambdaLr {
    fn factor(&self, step: u64) -> f64 {
        (self.f)(step)
    }
    fn name(&self) -> &'static str {
        "lambda"
    }
}

/// `x^n` for a step count, saturating the exponent (a decaying factor is 0 long before).
fn powi(x: f64, n: u64) -> f64 {
    x.powi(i32::try_from(n).unwrap_or(i32::MAX))
}

/// Linear warm-up to 1 over `warmup` steps, then `decay(progress)` with progress going from 0
/// at `warmup` to 1 at `total`; 0 from `total` on.
fn warmup_then(step: u64, warmup: u64, total: u64, decay: impl Fn(f64) -> f64) -> f64 {
    if step < warmup {
        step as f64 / warmup as f64
    } else if step >= total {
        0.0
    } else {
        decay((step - warmup) as f64 / (total - warmup) as f64)
    }
}

fn check_gamma(gamma: f64) -> Result<()> {
    if gamma.is_finite() && gamma >= 0.0 {
        Ok(())
    } else {
        Err(Error::config(
            "gamma",
            gamma,
            "use a finite decay factor >= 0, e.g. 0.1 (1 keeps the rate constant)",
        ))
    }
}

fn check_warmup(warmup: u64, total: u64) -> Result<()> {
    if total == 0 {
        return Err(Error::config(
            "total",
            0,
            "use the total number of optimizer steps of the run, at least 1",
        ));
    }
    if warmup > total {
        return Err(Error::config(
            "warmup",
            warmup,
            format!("use at most `total` ({total}) warm-up steps, or raise `total`"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{Linked, OptimizerLink};
    use std::sync::Arc;

    struct FakeOpt(Arc<OptimizerLink>);
    impl Linked for FakeOpt {
        fn link(&self) -> &Arc<OptimizerLink> {
            &self.0
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12
    }

    #[test]
    fn warmup_constant_rises_then_holds() {
        let s = WarmupConstant::new(4);
        let got: Vec<f64> = (0..7).map(|k| s.factor(k)).collect();
        assert_eq!(got, [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]);
        assert_eq!(s.factor(u64::MAX - 1), 1.0);
        assert_eq!(WarmupConstant::new(0).factor(0), 1.0);
    }

    #[test]
    fn step_and_exponential_factors() -> Result<()> {
        let s = StepLr::new(3, 0.1)?;
        let got: Vec<f64> = (0..7).map(|t| s.factor(t)).collect();
        let want = [1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.1 * 0.1];
        assert!(got.iter().zip(want).all(|(g, w)| close(*g, w)), "{got:?}");
        let e = ExponentialLr::new(0.5)?;
        assert_eq!([e.factor(0), e.factor(1), e.factor(3)], [1.0, 0.5, 0.125]);
        assert_eq!(ConstantLr.factor(1_000_000), 1.0);
        assert_eq!(e.factor(u64::MAX), 0.0);
        Ok(())
    }

    #[test]
    fn warmup_linear_factors() -> Result<()> {
        let s = WarmupLinear::new(4, 8)?;
        let got: Vec<f64> = (0..11).map(|t| s.factor(t)).collect();
        let want = [0.0, 0.25, 0.5, 0.75, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0];
        assert_eq!(got, want);
        // No warm-up starts at the full rate.
        assert_eq!(WarmupLinear::new(0, 2)?.factor(0), 1.0);
        Ok(())
    }

    #[test]
    fn warmup_cosine_factors() -> Result<()> {
        let s = WarmupCosine::new(2, 6)?;
        let half_sqrt2 = std::f64::consts::FRAC_1_SQRT_2 / 2.0;
        let want = [
            0.0,
            0.5,
            1.0,
            0.5 + half_sqrt2, // cos(pi/4)
            0.5,
            0.5 - half_sqrt2,
            0.0,
            0.0,
        ];
        for (t, w) in want.iter().enumerate() {
            assert!(
                close(s.factor(t as u64), *w),
                "step {t}: {}",
                s.factor(t as u64)
            );
        }
        // warmup == total: ramp, then straight to 0.
        let s = WarmupCosine::new(2, 2)?;
        assert_eq!([s.factor(1), s.factor(2)], [0.5, 0.0]);
        Ok(())
    }

    #[test]
    fn invalid_schedules_say_what_to_do() {
        let errs = [
            StepLr::new(0, 0.5).unwrap_err(),
            StepLr::new(1, -0.5).unwrap_err(),
            ExponentialLr::new(f64::INFINITY).unwrap_err(),
            WarmupLinear::new(5, 4).unwrap_err(),
            WarmupCosine::new(0, 0).unwrap_err(),
        ];
        let msgs: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        assert!(msgs[0].contains("step_size") && msgs[0].contains("at least 1"));
        assert!(msgs[1].contains("gamma") && msgs[1].contains(">= 0"));
        assert!(msgs[2].contains("gamma"));
        assert!(msgs[3].contains("warmup") && msgs[3].contains("at most `total` (4)"));
        assert!(msgs[4].contains("total") && msgs[4].contains("at least 1"));
    }

    #[test]
    fn scheduler_follows_the_optimizer_step_count() {
        let opt = FakeOpt(OptimizerLink::new(2.0));
        let mut sched = LrScheduler::new(&opt, LambdaLr::new(|t| 1.0 / (t as f64 + 1.0)));
        assert_eq!(sched.lr(), 2.0);
        opt.0.record_step();
        sched.step();
        sched.step();
        assert_eq!(sched.lr(), 1.0);
        opt.0.record_step();
        opt.0.record_step();
        sched.step();
        // Three real steps: factor 1 / (3 + 1).
        assert_eq!(opt.0.lr(), 0.5);
        assert_eq!(sched.base_lr(), 2.0);
    }

    #[test]
    fn warmup_starts_at_zero() -> Result<()> {
        let opt = FakeOpt(OptimizerLink::new(0.1));
        let sched = LrScheduler::new(&opt, WarmupLinear::new(10, 100)?);
        assert_eq!(opt.0.lr(), 0.0);
        assert_eq!(sched.base_lr(), 0.1);
        Ok(())
    }

    #[test]
    fn state_round_trip_and_name_check() -> Result<()> {
        let a = FakeOpt(OptimizerLink::new(1.0));
        let mut sa = LrScheduler::new(&a, ExponentialLr::new(0.5)?);
        a.0.record_step();
        sa.step();
        let state = sa.state_dict();
        assert_eq!(state["schedule"], "exponential");

        let b = FakeOpt(OptimizerLink::new(7.0));
        let mut sb = LrScheduler::new(&b, ExponentialLr::new(0.5)?);
        sb.load_state_dict(&state)?;
        assert_eq!((sb.base_lr(), sb.lr()), (1.0, 0.5));
        // With the optimizer's step count restored too, the schedule carries on.
        b.0.set_steps(2);
        sb.step();
        assert_eq!(sb.lr(), 0.25);

        let c = FakeOpt(OptimizerLink::new(1.0));
        let mut sc = LrScheduler::new(&c, ConstantLr);
        let err = sc.load_state_dict(&state).unwrap_err().to_string();
        assert!(
            err.contains("`exponential`") && err.contains("`constant`"),
            "{err}"
        );
        let err = sc
            .load_state_dict(&serde_json::json!({}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("schedule"), "{err}");
        Ok(())
    }
}
