//! ZeRO stage 3 at the facade: the run's [`Gathering`] (train/sync/gathered.rs), made when the
//! first model is prepared and installed on the thread that built the Accelerator, each
//! prepared model's units, and the refusals of what stage 3 cannot do.

use crate::accelerator::Accelerator;
use crate::activations::WeightsInstalled;
use crate::error::{Error, Result};
use crate::setup::config::Sharding;
use crate::train::params::NewVariable;
use crate::train::shard::Sharded;
use crate::train::sync::gathered::{Gathering, Units};
use candle_core::Device;
use std::cell::RefCell;
use std::rc::Rc;

/// A run's stage-3 state: the segments' hands on the units, installed on the thread.
pub(super) struct Zero3 {
    gathering: Rc<Gathering>,
    _installed: WeightsInstalled,
}

/// Whether the run checkpoints activations: asked for, or implied by stage 3 (which gathers
/// the blocks' weights per checkpointed segment). Refuses stage 3 where its weights cannot be
/// freed and filled: off the CPU.
pub(super) fn checkpointing(asked: bool, sharding: Sharding, device: &Device) -> Result<bool> {
    if sharding != Sharding::Parameters {
        return Ok(asked);
    }
    if device.is_cpu() {
        return Ok(true);
    }
    Err(Error::config(
        ivme_settings::SHARDING.name,
        format!("parameters, on {device:?}"),
        "stage 3 frees and refills the blocks' weights in CPU memory only in this version: \
         use sharding = gradients (stage 2) with activation_checkpointing on the GPU",
    ))
}

impl Accelerator {
    /// Under stage 3, the units of a model being prepared (of `vars`, sliced by `shard`),
    /// handed to the run's gathering, made now for the first model.
    pub(super) fn units_of(
        &mut self,
        shard: &Sharded,
        vars: &[NewVariable],
    ) -> Option<Rc<RefCell<Units>>> {
        if shard.stage != Sharding::Parameters {
            return None;
        }
        let units = Rc::new(RefCell::new(Units::new(
            vars.iter().map(|v| v.name.clone()).collect(),
            vars.iter().map(|v| v.compute.clone()).collect(),
            vars.iter().map(|v| v.buffer).collect(),
            shard.plan.clone(),
            shard.masters.clone(),
        )));
        let zero3 = self.zero3.get_or_insert_with(|| {
            let window = self.training.window().clone();
            let gathering = Rc::new(Gathering::new(self.comm.clone(), window));
            Zero3 {
                _installed: WeightsInstalled::install(gathering.clone()),
                gathering,
            }
        });
        zero3.gathering.add(units.clone());
        Some(units)
    }

    /// Refuses a stage-3 backward whose forward gathered no unit: every weight would be held
    /// whole, which is stage 2 at a higher price.
    pub(super) fn check_units_ran(&self) -> Result<()> {
        match &self.zero3 {
            Some(z) if !z.gathering.any_unit() => Err(Error::Usage(format!(
                "{} = parameters (ZeRO-3) shards the weights of checkpointed segments that \
                 name their unit, and this forward ran none: run each block through \
                 ivme::activations::segment(&x, \"model.layers.3\", move |x| block.forward(x)) \
                 (the block's VarMap prefix), use a model from ivme::models, or use \
                 sharding = gradients",
                ivme_settings::SHARDING.name
            ))),
            _ => Ok(()),
        }
    }
}
