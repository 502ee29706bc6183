//! Registering a model and its optimizer with the Accelerator: every rank starts from rank 0's
//! weights; the f32 masters are made (exact ones from `var_builder`, or this rank's slice under
//! sharding); an optimizer is pointed at the masters and wrapped.

use crate::accelerator::Accelerator;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::optim::accelerated::OptimizerSlot;
use crate::optim::AcceleratedOptimizer;
use crate::optim::StatefulOptimizer;
use crate::precision::exact_init::SeededInit;
use crate::stateful::Shared;
use crate::train::params::{NewVariable, ParamSet};
use crate::train::shard::{Plan, Sharded};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, TensorId, Var};
use candle_nn::{VarBuilder, VarMap};

impl Accelerator {
    pub(crate) fn find_model(&self, varmap: &VarMap) -> Option<usize> {
        let first = varmap.all_vars().into_iter().next()?;
        let id = first.as_tensor().id();
        self.training
            .models()
            .iter()
            .position(|m| m.position_of(id).is_some())
    }

    /// Makes every rank start from rank 0's weights and sets up f32 masters.
    pub(crate) fn register_model(&mut self, varmap: &VarMap) -> Result<()> {
        self.register_model_holding(varmap, None)
    }

    /// [`register_model`](Self::register_model) knowing which variables the optimizer being
    /// prepared with it holds (`held`): without sharding, the others (frozen unless a later
    /// optimizer takes them) are not broadcast but checked equal across ranks by checksum, and
    /// get no f32 master.
    pub(crate) fn register_model_holding(
        &mut self,
        varmap: &VarMap,
        held: Option<&[TensorId]>,
    ) -> Result<()> {
        if self.find_model(varmap).is_some() {
            return Err(Error::Prepare(
                "this VarMap was already prepared; prepare each model once".into(),
            ));
        }
        // A LoRA target or unfreeze pattern that matched nothing would train nothing.
        self.finetune.check_targets()?;
        let sharded = self.sync.sharding() != crate::Sharding::No;
        let (mut vars, mut full, mut unsent) = (Vec::new(), Vec::new(), Vec::new());
        for (name, var) in named_vars(varmap)? {
            let id = var.as_tensor().id();
            let statistic = crate::precision::is_batch_norm_statistic(&name);
            let buffer = statistic || self.training.is_pending_buffer(id);
            self.mixed
                .check_variable(&name, var.dtype(), statistic, buffer)?;
            if held.is_some_and(|h| !h.contains(&id)) && !buffer && !sharded {
                // Frozen, nothing steps it: no broadcast (checked equal below), no master.
                self.mixed.exact_masters().lock().remove(&id);
                unsent.push((name.clone(), var.clone()));
                vars.push(NewVariable::frozen(name, var));
                continue;
            }
            let (master, value) = self.start_from_rank0(&var)?;
            full.extend(value);
            vars.push(NewVariable {
                name,
                compute: var,
                master,
                buffer,
            });
        }
        crate::train::frozen::check_equal(&*self.comm, &unsent)?;
        let shard = self.slice_of(&vars, &full)?;
        let units = shard.as_ref().and_then(|s| self.units_of(s, &vars));
        let mut model = ParamSet::new(vars, shard);
        if let Some(units) = units {
            model.set_units(units);
        }
        self.training.add_model(model);
        Ok(())
    }

    /// Makes `var` start from rank 0's value on every rank, broadcast in f32 (exact for
    /// f16/bf16 values, and MPI has no half types; a variable `var_builder` made starts from
    /// its exact f32 initialisation). Returns its f32 master and, under sharding (where the
    /// variable stands in until the slice is cut), the broadcast value the slice comes from.
    fn start_from_rank0(&self, var: &Var) -> Result<(Var, Option<Tensor>)> {
        let dt = var.dtype();
        let value = match self.take_exact_master(var)? {
            Some(exact) => exact,
            None => var.as_tensor().to_dtype(DType::F32)?,
        };
        let value = self.comm.broadcast(&value, 0)?;
        let sharded = self.sync.sharding() != crate::Sharding::No;
        let low = self.mixed.policy().compute_dtype();
        if !sharded && dt == low && dt != DType::F32 {
            let master = Var::from_tensor(&value)?;
            var.set(&value.to_dtype(dt)?)?;
            return Ok((master, None));
        }
        if self.state.world_size > 1 {
            var.set(&value.to_dtype(dt)?)?;
        }
        // An f32 variable now holds the value itself: the slice is cut from it, so a model is
        // not held twice while it is prepared.
        let value = match dt {
            DType::F32 if var.is_contiguous() => var.as_tensor().clone(),
            _ => value,
        };
        Ok((var.clone(), sharded.then_some(value)))
    }

    /// Under sharding, this process's slice of a model of `vars` whose f32 values are `full`.
    fn slice_of(&self, vars: &[NewVariable], full: &[Tensor]) -> Result<Option<Sharded>> {
        let stage = self.sync.sharding();
        if stage == crate::Sharding::No {
            return Ok(None);
        }
        let compute: Vec<Var> = vars.iter().map(|v| v.compute.clone()).collect();
        let sizes: Vec<usize> = compute.iter().map(|v| v.elem_count()).collect();
        let plan = Plan::new(&sizes, self.state.world_size, self.state.rank);
        Ok(Some(Sharded::new(stage, plan, full, &compute)?))
    }

    /// Points a user optimizer at the masters of a prepared model and wraps it.
    pub(crate) fn wrap_optimizer<O: StatefulOptimizer>(
        &mut self,
        mut opt: O,
    ) -> Result<AcceleratedOptimizer<O>> {
        if self.sync.sharding() != crate::Sharding::No {
            return self.wrap_sharded_optimizer(opt);
        }
        let overlap = match self.sync.overlap() {
            true => Some(self.overlap_model(&opt)?),
            false => None,
        };
        let (masters, copies) = self.adopt_all(opt.vars())?;
        if !copies.is_empty() {
            opt.replace_vars(masters)?;
        }
        let names = opt
            .vars()
            .iter()
            .map(|v| self.name_of(v).unwrap_or_default())
            .collect();
        let shared = Shared::new(opt);
        self.training.add_optimizer(Box::new(OptimizerSlot {
            opt: shared.clone(),
            names,
            flat: false,
        }));
        if let Some(k) = overlap {
            let stepper = crate::optim::parts::stepper(&shared, copies);
            self.training.models_mut()[k].set_part_stepper(stepper);
            return Ok(AcceleratedOptimizer::sharded(shared));
        }
        Ok(AcceleratedOptimizer::new(shared, copies)
            .with_clock(self.training.window().clock().clone()))
    }

    /// Marks each of `vars` (variables of prepared models) as stepped by the optimizer being
    /// prepared: their f32 masters, and the (low-precision copy, master) pairs to refresh.
    fn adopt_all(&mut self, vars: &[Var]) -> Result<(Vec<Var>, Vec<Refresh>)> {
        let low = self.mixed.policy().compute_dtype();
        let (mut masters, mut copies) = (Vec::with_capacity(vars.len()), Vec::new());
        for v in vars {
            let id = v.as_tensor().id();
            let found = self
                .training
                .models_mut()
                .iter_mut()
                .find_map(|m| m.position_of(id).map(|i| (m, i)));
            let Some((m, i)) = found else {
                return Err(Error::Prepare(
                    "the optimizer updates a variable of no prepared model; prepare the VarMap \
                     before (or together with, earlier in the tuple) its optimizer"
                        .into(),
                ));
            };
            let (master, copy) = m.adopt(i, low)?;
            masters.push(master);
            copies.extend(copy);
        }
        Ok((masters, copies))
    }

    /// Under `overlap`, the model whose `backward` will step `opt` (in parts,
    /// train/sync/overlap.rs), checked before anything is registered: one optimizer over one
    /// model, of a kind that steps in parts.
    fn overlap_model<O: StatefulOptimizer>(&self, opt: &O) -> Result<usize> {
        if !crate::optim::parts::steps_in_parts::<O>() {
            return Err(Error::Prepare(format!(
                "overlap = true steps the optimizer in parts, which ivme's AdamW, Sgd and \
                 AnyOptimizer can do and {} cannot: use one of those, or turn overlap off",
                std::any::type_name::<O>()
            )));
        }
        let ids: Vec<_> = opt.vars().iter().map(|v| v.as_tensor().id()).collect();
        let models = self.training.models().iter().enumerate();
        let mut models = models.filter(|(_, m)| m.holds_any(&ids));
        let (Some((k, m)), None) = (models.next(), models.next()) else {
            return Err(Error::Prepare(
                "with overlap = true an optimizer updates the variables of one prepared model \
                 (one optimizer per model): build one per VarMap, or turn overlap off"
                    .into(),
            ));
        };
        if m.has_part_stepper() {
            return Err(Error::Prepare(
                "with overlap = true each prepared model has one optimizer, which `backward` \
                 steps; this model already has one: give it a single optimizer (ivme's \
                 AnyOptimizer or one AdamW), or turn overlap off"
                    .into(),
            ));
        }
        Ok(k)
    }

    fn name_of(&self, var: &Var) -> Option<String> {
        let id = var.as_tensor().id();
        self.training
            .models()
            .iter()
            .find_map(|m| m.name_of_master(id))
    }

    /// Wraps the optimizer of a sharded model: it updates this process's pieces only, and
    /// `backward` steps it (the returned optimizer's `step` only records the outcome).
    pub(crate) fn wrap_sharded_optimizer<O: StatefulOptimizer>(
        &mut self,
        mut opt: O,
    ) -> Result<AcceleratedOptimizer<O>> {
        let ids: Vec<_> = opt.vars().iter().map(|v| v.as_tensor().id()).collect();
        let Some(k) = self
            .training
            .models()
            .iter()
            .position(|m| ids.iter().any(|&id| m.position_of(id).is_some()))
        else {
            return Err(Error::Prepare(
                "the optimizer updates a variable of no prepared model; prepare the VarMap \
                 before (or together with, earlier in the tuple) its optimizer"
                    .into(),
            ));
        };
        let m = &mut self.training.models_mut()[k];
        let names = m.adopt_slice(&mut opt, &ids)?;
        let shared = Shared::new(opt);
        let stepped = shared.clone();
        m.set_slice_stepper(Box::new(move |g: &GradStore| {
            candle_nn::Optimizer::step(&mut *stepped.lock(), g)?;
            Ok(())
        }));
        self.training.add_optimizer(Box::new(OptimizerSlot {
            opt: shared.clone(),
            names,
            flat: true,
        }));
        Ok(AcceleratedOptimizer::sharded(shared))
    }
}

impl Accelerator {
    /// The exact f32 initial value kept for `var`, if [`var_builder`](Self::var_builder) made
    /// it and it still rounds to the variable's value; taken, since the master then owns it.
    /// A variable set after it was made (weights loaded from a file, a custom initialisation)
    /// no longer matches, and its master is widened from its current value instead.
    pub(crate) fn take_exact_master(&self, var: &Var) -> crate::error::Result<Option<Tensor>> {
        let Some(exact) = self
            .mixed
            .exact_masters()
            .lock()
            .remove(&var.as_tensor().id())
        else {
            return Ok(None);
        };
        let now = var.as_tensor().to_dtype(DType::F32)?;
        let rounded = exact.to_dtype(var.dtype())?.to_dtype(DType::F32)?;
        let differ = rounded.ne(&now)?.to_dtype(DType::F32)?.sum_all()?;
        Ok((differ.to_scalar::<f32>()? == 0.0).then_some(exact))
    }
}

impl Accelerator {
    /// A `VarBuilder` over `varmap` for building the model: variables on this process's device,
    /// in the compute dtype for a request of f32 under mixed precision (see
    /// [`param_dtype`](Self::param_dtype)), the request otherwise.
    ///
    /// Each new variable is drawn from ivme's generator, keyed by the builder's
    /// [`seed`](crate::AcceleratorBuilder::seed) (0 unless set; [`set_seed`](Self::set_seed)
    /// changes it) and the variable's name, as
    /// candle's initialisation hint for it says (the Kaiming normal of `linear`, the zeros of a
    /// bias...): with the same seed the model starts from the same weights in every run, on
    /// every rank and on the CPU or a GPU alike. candle's own CPU initialisers cannot be
    /// seeded, so `VarBuilder::from_varmap` gives different weights in every run.
    ///
    /// Under bf16/fp16 each variable is initialised in f32 and its f32 value becomes the master
    /// weight when the model is prepared, so the masters start from the exact initialisation
    /// and only the model's copy is rounded. `VarBuilder::from_varmap(&varmap,
    /// accelerator.param_dtype(DType::F32), ..)` also works, with masters widened from the
    /// rounded values (and unseeded weights). `#[accelerate]` writes this call for
    /// `VarBuilder::from_varmap(..)`.
    ///
    /// ```no_run
    /// # fn main() -> ivme::Result<()> {
    /// let accelerator = ivme::Accelerator::builder().precision(ivme::Precision::Bf16).build()?;
    /// let varmap = candle_nn::VarMap::new();
    /// let layer = candle_nn::linear(8, 1, accelerator.var_builder(&varmap, candle_core::DType::F32))?;
    /// # let _ = layer; Ok(()) }
    /// ```
    pub fn var_builder(&self, varmap: &VarMap, requested: DType) -> VarBuilder<'static> {
        self.finetune.remember(varmap);
        let dtype = self.param_dtype(requested);
        let low = self.mixed.policy().compute_dtype();
        let backend = SeededInit::new(
            varmap.clone(),
            self.data.init_seed(),
            self.mixed.exact_masters().clone(),
            (low != DType::F32).then_some(low),
        );
        VarBuilder::from_backend(Box::new(backend), dtype, self.device().clone())
    }
}

#[cfg(test)]
#[path = "models_tests.rs"]
mod tests;

/// A low-precision variable and the f32 master it is refreshed from.
type Refresh = (Var, Var);

/// The variables of `varmap` by name, sorted; refuses an empty one.
fn named_vars(varmap: &VarMap) -> Result<Vec<(String, Var)>> {
    let mut named: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .map_err(|_| Error::Prepare("the VarMap's lock is poisoned by an earlier panic".into()))?
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if named.is_empty() {
        return Err(Error::Prepare(
            "the VarMap has no variables yet: build the model from it before preparing".into(),
        ));
    }
    named.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(named)
}
