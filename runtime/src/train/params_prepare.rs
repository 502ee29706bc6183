//! Making a prepared model's parameter set and pointing optimizers at it: which variables an
//! optimizer steps, their f32 masters and low-precision copies, the part-by-part stepper under
//! `overlap`, and the slice's optimizer under sharding.

use crate::error::{Error, Result};
use crate::optim::parts::PartStepper;
use crate::optim::StatefulOptimizer;
use crate::train::params::ParamSet;
use crate::train::shard::{Sharded, Stepper};
use candle_core::{DType, TensorId, Var};

/// What an optimizer adopting one variable gets: the master it steps, and (when the model
/// computes with a separate low-precision copy) the (copy, master) pair to refresh after.
pub(crate) type Adopted = (Var, Option<(Var, Var)>);

/// One variable of a model being prepared: its name, the variable the model computes with,
/// its f32 master (the variable itself where there is no separate one) and whether it is a
/// buffer.
pub(crate) struct NewVariable {
    pub name: String,
    pub compute: Var,
    pub master: Var,
    pub buffer: bool,
}

impl NewVariable {
    /// A frozen variable: nothing steps it, so it has no master of its own.
    pub(crate) fn frozen(name: String, var: Var) -> Self {
        NewVariable {
            name,
            compute: var.clone(),
            master: var,
            buffer: false,
        }
    }
}

impl ParamSet {
    /// A model's parameter set from its variables in name order and (under sharding) this
    /// process's slice. Nothing trains until an optimizer adopts its variables.
    pub(crate) fn new(vars: Vec<NewVariable>, shard: Option<Sharded>) -> ParamSet {
        let n = vars.len();
        let (mut names, mut compute, mut master, mut buffer) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for v in vars {
            names.push(v.name);
            compute.push(v.compute);
            master.push(v.master);
            buffer.push(v.buffer);
        }
        ParamSet {
            names,
            compute,
            master,
            buffer,
            trained: vec![false; n],
            probed: false,
            reached: vec![false; n],
            sums: vec![None; n],
            buffers: Default::default(),
            shard,
            units: None,
            overlap: None,
        }
    }

    /// The index of the variable `id` the model computes with, if it is this model's.
    pub(crate) fn position_of(&self, id: TensorId) -> Option<usize> {
        self.compute.iter().position(|c| c.as_tensor().id() == id)
    }

    /// Whether any of `ids` is one of this model's variables or masters.
    pub(crate) fn holds_any(&self, ids: &[TensorId]) -> bool {
        self.compute
            .iter()
            .chain(&self.master)
            .any(|v| ids.contains(&v.as_tensor().id()))
    }

    /// The name of the variable whose master is `id`.
    pub(crate) fn name_of_master(&self, id: TensorId) -> Option<String> {
        let i = self.master.iter().position(|v| v.as_tensor().id() == id)?;
        Some(self.names[i].clone())
    }

    /// Marks variable `i` as stepped by an optimizer being prepared, with `low` the run's
    /// compute dtype: a variable registered frozen (without a master) gets its f32 master now.
    /// Refuses a variable another optimizer already holds.
    pub(crate) fn adopt(&mut self, i: usize, low: DType) -> Result<Adopted> {
        if self.trained[i] {
            return Err(Error::Prepare(format!(
                "`{}` is held by two prepared optimizers (or twice by one): each variable \
                 belongs to one optimizer, since two would each step it with their own state; \
                 split the variables between them",
                self.names[i]
            )));
        }
        self.trained[i] = true;
        let (compute, buffer) = (&self.compute[i], self.buffer[i]);
        let unmastered = self.master[i].as_tensor().id() == compute.as_tensor().id();
        if unmastered && !buffer && low != DType::F32 && compute.dtype() == low {
            // Registered as frozen (no master): this optimizer steps it after all.
            self.master[i] = Var::from_tensor(&compute.as_tensor().to_dtype(DType::F32)?)?;
        }
        let master = self.master[i].clone();
        // A buffer's value is the model's own; its master only mirrors it (buffers.rs).
        let copy = (!buffer && compute.as_tensor().id() != master.as_tensor().id())
            .then(|| (compute.clone(), master.clone()));
        Ok((master, copy))
    }

    /// Whether `backward` already steps an optimizer of this model in parts (overlap).
    pub(crate) fn has_part_stepper(&self) -> bool {
        self.overlap.is_some()
    }

    /// Hands `backward` the optimizer that steps this model in parts (overlap).
    pub(crate) fn set_part_stepper(&mut self, stepper: Option<PartStepper>) {
        self.overlap = stepper;
    }

    /// Points `opt` at this sharded model's slice: it must hold every variable of the model
    /// (`ids`); ivme's optimizers update the pieces a slice boundary cuts in the weights
    /// themselves, another gets copies of those pieces. Returns the pieces' names, in the
    /// optimizer's order; [`set_slice_stepper`](Self::set_slice_stepper) then hands its step
    /// to the sync.
    pub(crate) fn adopt_slice<O: StatefulOptimizer>(
        &mut self,
        opt: &mut O,
        ids: &[TensorId],
    ) -> Result<Vec<String>> {
        let whole = ids.len() == self.compute.len()
            && self
                .compute
                .iter()
                .all(|c| ids.contains(&c.as_tensor().id()));
        if !whole {
            return Err(Error::Prepare(
                "under sharding an optimizer updates all of one prepared model's variables: \
                 build it over `varmap.all_vars()` (one optimizer per model); to train part of \
                 a pretrained model under sharding, read the frozen part as constants \
                 (`accelerator.load_base(..)` and `base_var_builder`, docs/finetune.md), so \
                 the VarMap holds only what trains"
                    .into(),
            ));
        }
        self.trained.iter_mut().for_each(|t| *t = true);
        let shard = self.shard.as_mut().expect("a sharded model");
        if shard.stepper.is_some() {
            return Err(Error::Prepare(
                "this sharded model already has a prepared optimizer; under sharding each \
                 model has exactly one"
                    .into(),
            ));
        }
        let runs = shard.runs.clone();
        let took_runs = runs.iter().any(Option::is_some)
            && crate::optim::runs::rebind(opt, shard.masters.clone(), runs)?;
        if !took_runs {
            shard.copy_runs()?;
            opt.rebind_fresh(shard.masters.clone())?;
        }
        let names = &self.names;
        Ok(shard
            .plan
            .pieces
            .iter()
            .map(|p| crate::checkpoint::layout::run_name(&names[p.param], p.from, p.len))
            .collect())
    }

    /// Hands the sync the step of this sharded model's optimizer over its slice.
    pub(crate) fn set_slice_stepper(&mut self, stepper: Stepper) {
        self.shard.as_mut().expect("a sharded model").stepper = Some(stepper);
    }
}
