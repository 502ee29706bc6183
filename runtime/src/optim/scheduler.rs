//! The scheduler that applies a learning-rate schedule to an optimizer, stepping with the
//! optimizer's real steps (see [`schedule`](super::schedule) for the schedules themselves).

use super::schedule::LrSchedule;
use super::{Linked, OptimizerLink};
use crate::error::{Error, Result};
use crate::stateful::{StateDict, Stateful};
use std::fmt;
use std::sync::Arc;

/// Applies a schedule to an optimizer: sets the optimizer's learning rate to
/// `base_lr * factor(steps)`, where `steps` is the number of real steps the optimizer has taken.
///
/// ```
/// use candle_core::{Device, Var};
/// use candle_nn::Optimizer;
/// use ivme::optim::schedule::StepLr;
/// use ivme::optim::{LrScheduler, ParamsSgd, Sgd};
///
/// let w = Var::new(&[1.0f32], &Device::Cpu)?;
/// let mut opt = Sgd::new(vec![w.clone()], ParamsSgd { lr: 1.0, ..Default::default() })?;
/// let mut sched = LrScheduler::new(&opt, StepLr::new(1, 0.5)?);
/// opt.backward_step(&w.as_tensor().sum_all()?)?;
/// sched.step();
/// sched.step(); // no optimizer step in between: nothing changes
/// assert_eq!(sched.lr(), 0.5);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct LrScheduler {
    link: Arc<OptimizerLink>,
    schedule: Box<dyn LrSchedule>,
    base_lr: f64,
}

impl LrScheduler {
    /// Attaches `schedule` to `opt`, taking the optimizer's current learning rate as the base
    /// and applying the schedule to it at once.
    pub fn new(opt: &impl Linked, schedule: impl LrSchedule + 'static) -> Self {
        let link = Arc::clone(opt.link());
        let base_lr = link.lr();
        let scheduler = LrScheduler {
            link,
            schedule: Box::new(schedule),
            base_lr,
        };
        scheduler.apply();
        scheduler
    }

    /// Brings the optimizer's learning rate up to date with the steps it has taken; calling
    /// it again before the next optimizer step changes nothing.
    pub fn step(&mut self) {
        self.apply();
    }

    fn apply(&self) {
        let factor = self.schedule.factor(self.link.steps());
        self.link.set_lr(self.base_lr * factor);
    }

    /// The learning rate the optimizer's next step will use.
    pub fn lr(&self) -> f64 {
        self.link.lr()
    }

    /// The learning rate the schedule's factors multiply.
    pub fn base_lr(&self) -> f64 {
        self.base_lr
    }

    /// The schedule's name (as saved in the state).
    pub fn name(&self) -> &'static str {
        self.schedule.name()
    }

    /// The scheduler's state: the schedule's name, the base learning rate and the current one.
    pub fn state_dict(&self) -> serde_json::Value {
        serde_json::json!({
            "schedule": self.schedule.name(),
            "base_lr": self.base_lr,
            "lr": self.link.lr(),
        })
    }

    /// Restores a state saved by [`state_dict`](Self::state_dict) from a scheduler running the
    /// same schedule. The optimizer's learning rate is set to the saved one, so loading the
    /// optimizer's state before or after this gives the same result.
    pub fn load_state_dict(&mut self, state: &serde_json::Value) -> Result<()> {
        let saved = state
            .get("schedule")
            .and_then(|v| v.as_str())
            .ok_or_else(|| {
                Error::Usage(
                    "scheduler state has no `schedule` name: load a state saved by an ivme \
                 LrScheduler"
                        .into(),
                )
            })?;
        if saved != self.schedule.name() {
            return Err(Error::Usage(format!(
                "scheduler state is for a `{saved}` schedule but this scheduler runs `{}`: \
                 build the scheduler with the same schedule as the run that saved it",
                self.schedule.name()
            )));
        }
        let number = |key: &str| {
            state
                .get(key)
                .and_then(|v| v.as_f64())
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| {
                    Error::Usage(format!(
                        "scheduler state has no valid `{key}` (a finite number >= 0): load a \
                         state saved by an ivme LrScheduler"
                    ))
                })
        };
        let base_lr = number("base_lr")?;
        let lr = number("lr")?;
        self.base_lr = base_lr;
        self.link.set_lr(lr);
        Ok(())
    }
}

/// Lets a scheduler be registered for checkpointing (its state is JSON only).
impl Stateful for LrScheduler {
    fn state_dict(&self) -> Result<StateDict> {
        Ok(StateDict::json(LrScheduler::state_dict(self)))
    }
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        LrScheduler::load_state_dict(self, &state.json)
    }
}

impl fmt::Debug for LrScheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LrScheduler")
            .field("schedule", &self.schedule.name())
            .field("base_lr", &self.base_lr)
            .field("lr", &self.link.lr())
            .field("steps", &self.link.steps())
            .finish()
    }
}
