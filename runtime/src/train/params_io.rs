//! A prepared model's parameters as checkpoints and model files see them: its saved state
//! (`state_dict`: whole f32 masters, or this process's slice as flat runs), the window's
//! partial sums, and the way saved tensors in any layout are checked against it and applied
//! back. The facade assembles a rank's state from these and never reads the fields.

use crate::checkpoint::direct::{self, DirectFile};
use crate::checkpoint::format::unfit;
use crate::checkpoint::layout::{run_name, Layout, Runs, Whole};
use crate::checkpoint::plan::ModelLoad;
use crate::checkpoint::store::Listing;
use crate::checkpoint::swap;
use crate::comm::Communicator;
use crate::error::Result;
use crate::stateful::StateDict;
use crate::train::params::ParamSet;
use candle_core::{DType, Tensor, Var};
use serde_json::{json, Value};
use std::path::Path;

/// Under sharding, the f32 variables a model file is read into before it is resliced.
pub(crate) type Standins = Option<Vec<Var>>;

impl ParamSet {
    /// The model's saved state: its f32 masters by name, or (sharded) this process's pieces as
    /// flat runs `name[from..to]` with every variable's shape in the JSON, so that a load on
    /// any layout can put each variable back.
    pub(crate) fn state_dict(&self) -> Result<StateDict> {
        let Some(s) = &self.shard else {
            let tensors = self
                .names
                .iter()
                .cloned()
                .zip(self.master.iter().map(|v| v.as_tensor().clone()))
                .collect();
            let json = Value::Null;
            return Ok(StateDict { tensors, json });
        };
        let tensors = s
            .plan
            .pieces
            .iter()
            .enumerate()
            .map(|(k, p)| Ok((run_name(&self.names[p.param], p.from, p.len), s.flat(k)?)))
            .collect::<Result<_>>()?;
        let shapes: serde_json::Map<String, Value> = self
            .names
            .iter()
            .zip(&self.compute)
            .map(|(n, v)| (n.clone(), json!(v.dims())))
            .collect();
        let json = json!({ "shapes": shapes });
        Ok(StateDict { tensors, json })
    }

    /// The window's partial sums so far, by variable name (this rank's own); under stage 3
    /// also each unit piece's slice of its reduce-scattered sum, as `name[from..to]`.
    pub(crate) fn window_sums(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out: Vec<(String, Tensor)> = self
            .names
            .iter()
            .zip(&self.sums)
            .filter_map(|(n, s)| Some((n.clone(), s.as_ref()?.clone())))
            .collect();
        if let (Some(shard), Some(units)) = (&self.shard, self.units()) {
            for (k, t) in units.slice_sums()? {
                let p = shard.plan.pieces[k];
                out.push((run_name(&self.names[p.param], p.from, p.len), t));
            }
        }
        Ok(out)
    }

    /// Where a saved window sum called `name` goes: variable `i` (`i`), or under stage 3 the
    /// slice of unit piece `k` (`names.len() + k`).
    pub(crate) fn sum_slot(&self, name: &str) -> Option<usize> {
        if let Some(i) = self.names.iter().position(|n| n == name) {
            return Some(i);
        }
        let shard = self.shard.as_ref().filter(|_| self.units.is_some())?;
        // (Before the first forward no unit is known yet: any piece may hold one's sum.)
        let k = shard
            .plan
            .pieces
            .iter()
            .position(|p| run_name(&self.names[p.param], p.from, p.len) == name)?;
        Some(self.names.len() + k)
    }

    /// Places saved partial sums (`(name, sum)`) in this model's order, checking each names a
    /// variable and has its master's shape, in f32; `file` names the checkpoint in errors.
    /// Under stage 3 the unit pieces' slices follow the variables (see
    /// [`sum_slot`](Self::sum_slot)).
    pub(crate) fn check_sums(
        &self,
        file: &Path,
        saved: Vec<(String, &Tensor)>,
    ) -> Result<Vec<Option<Tensor>>> {
        let pieces = match &self.shard {
            Some(s) if self.units.is_some() => s.plan.pieces.len(),
            _ => 0,
        };
        let mut out = vec![None; self.names.len() + pieces];
        for (name, t) in saved {
            let Some(j) = self.sum_slot(&name) else {
                return Err(unfit(
                    file,
                    format!(
                        "holds a partial gradient sum `{name}` for no variable of this run's \
                         models"
                    ),
                ));
            };
            let (dims, device) = match j.checked_sub(self.names.len()) {
                None => (self.master[j].dims().to_vec(), self.master[j].device()),
                Some(k) => {
                    let shard = self.shard.as_ref().expect("a stage-3 model");
                    (vec![shard.plan.pieces[k].len], shard.masters[k].device())
                }
            };
            if t.dims() != dims || t.dtype() != DType::F32 {
                return Err(unfit(
                    file,
                    format!(
                        "holds the partial gradient sum `{name}` as {:?} {:?} but the variable \
                         is F32 {dims:?}",
                        t.dtype(),
                        t.dims(),
                    ),
                ));
            }
            out[j] = Some(t.to_device(device)?);
        }
        Ok(out)
    }

    /// Whether a variable is called `name`.
    pub(crate) fn has_variable(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    /// Puts a checked load back: the window's sums, then the weights (a direct file read into
    /// the masters, or staged tensors: this process's pieces under sharding, which
    /// [`gather_slice`](Self::gather_slice) spreads into the weights afterwards).
    pub(crate) fn apply_load(
        &mut self,
        mut sums: Vec<Option<Tensor>>,
        saved: ModelLoad,
    ) -> Result<()> {
        let slices = sums.split_off(self.names.len().min(sums.len()));
        self.sums = sums;
        if let Some(units) = &self.units {
            units.borrow_mut().set_sums(slices)?;
        }
        match (&self.shard, saved) {
            (_, ModelLoad::Direct(file)) => {
                direct::load_into(&file, &self.master)?;
                self.refresh_copies()?;
            }
            // Copied: a piece may be a view into a larger saved run.
            (Some(shard), ModelLoad::Staged(saved)) => {
                for (k, t) in saved.into_iter().enumerate() {
                    shard.set_piece(k, &t)?;
                }
            }
            (None, ModelLoad::Staged(saved)) => {
                for (master, t) in self.master.iter().zip(saved) {
                    swap::move_into(master, t)?;
                }
                self.refresh_copies()?;
            }
        }
        Ok(())
    }

    /// Refreshes the low-precision copies the model computes with from the f32 masters.
    fn refresh_copies(&self) -> Result<()> {
        for (master, compute) in self.master.iter().zip(&self.compute) {
            crate::precision::refresh_copy(compute, master)?;
        }
        Ok(())
    }

    /// Under sharding, writes every process's slice into the model's weights (a collective:
    /// every process calls it); nothing otherwise.
    pub(crate) fn gather_slice(&self, comm: &dyn Communicator, bucket_bytes: usize) -> Result<()> {
        let Some(shard) = &self.shard else {
            return Ok(());
        };
        match &self.units {
            // Stage 3's units are gathered by their segments, from the slices just loaded.
            Some(units) => {
                let skip = units.borrow().skip_mask(&vec![false; self.compute.len()]);
                shard.gather_into(comm, bucket_bytes, &self.compute, Some(&skip))
            }
            None => shard.gather_into(comm, bucket_bytes, &self.compute, None),
        }
    }

    /// Elements `from..to` of the flat parameter space that process `rank` loads: its slice
    /// under sharding, everything otherwise.
    pub(crate) fn wanted_range(&self, rank: usize) -> (usize, usize) {
        match &self.shard {
            Some(s) => (s.plan.start, s.plan.start + s.plan.counts[rank]),
            None => (0, self.compute.iter().map(|v| v.elem_count()).sum()),
        }
    }

    /// Whether the model is sharded (this process holds a slice of its masters).
    pub(crate) fn is_sharded(&self) -> bool {
        self.shard.is_some()
    }

    /// Under sharding, how many elements each process's slice holds.
    pub(crate) fn slice_counts(&self) -> Option<&[usize]> {
        self.shard.as_ref().map(|s| s.plan.counts.as_slice())
    }

    /// A saved file whose `listed` tensors are exactly this model's variables, to read
    /// straight into them (`path`, with its expected size and checksum).
    pub(crate) fn direct_file(
        &self,
        listed: &Listing,
        path: std::path::PathBuf,
        expect: (u64, u32),
    ) -> Option<DirectFile> {
        // Stage 3 frees the units' weights, which are the masters a direct read would fill.
        let units = self.units().is_some();
        (!units && direct::fits(listed, &self.names, &self.master)).then(|| DirectFile {
            path,
            expect,
            names: self.names.clone(),
        })
    }

    /// Refuses a sharded checkpoint whose recorded variable shapes differ from this model's.
    pub(crate) fn check_shapes(&self, file: &Path, shapes: &Value) -> Result<()> {
        for (name, v) in self.names.iter().zip(&self.compute) {
            let Some(saved) = shapes.get(name) else {
                continue;
            };
            let saved: Vec<usize> = serde_json::from_value(saved.clone()).map_err(|e| {
                unfit(
                    file,
                    format!("records a shape for `{name}` that cannot be read ({e})"),
                )
            })?;
            if saved != v.dims() {
                return Err(unfit(
                    file,
                    format!(
                        "has `{name}` with shape {saved:?} but the model's is {:?}; was it saved \
                         by this model?",
                        v.dims()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Model `i`'s saved weights in this run's layout, taken out of `runs` (saved in `layout`):
    /// whole masters, or this process's pieces; refuses a variable the model lacks or a total
    /// that differs.
    pub(crate) fn assemble(
        &self,
        file: &Path,
        i: usize,
        mut runs: Runs,
        layout: &Layout,
    ) -> Result<Vec<Tensor>> {
        if let Some(extra) = runs.keys().into_iter().find(|k| !self.has_variable(k)) {
            return Err(unfit(
                file,
                format!(
                    "has `{extra}`, which model {i} does not have: was it saved by this model?"
                ),
            ));
        }
        let total: usize = self.compute.iter().map(|v| v.elem_count()).sum();
        if let Some(counts) = layout.counts.get(i).filter(|_| layout.is_sharded()) {
            let saved: usize = counts.iter().sum();
            if saved != total {
                return Err(unfit(
                    file,
                    format!(
                        "holds a model of {saved} parameters but model {i} has {total}: was it \
                         saved by this model?"
                    ),
                ));
            }
        }
        match &self.shard {
            None => self
                .names
                .iter()
                .zip(&self.master)
                .map(|(name, v)| {
                    let whole = Whole {
                        dims: v.dims(),
                        dtype: v.dtype(),
                    };
                    let t = runs.take(file, name, 0, v.elem_count(), &whole)?;
                    Ok(t.reshape(v.dims())?)
                })
                .collect(),
            Some(s) => s
                .plan
                .pieces
                .iter()
                .map(|p| {
                    let whole = Whole {
                        dims: self.compute[p.param].dims(),
                        dtype: DType::F32,
                    };
                    runs.take(file, &self.names[p.param], p.from, p.len, &whole)
                })
                .collect(),
        }
    }

    /// The optimizer state `key` (`name::state`) of this model's variable `name`, taken out of
    /// `runs` in this run's naming: `key` whole, or one `name[from..to]::state` per piece of
    /// this process's slice. `None` when the model has no such variable.
    pub(crate) fn assemble_optimizer_key(
        &self,
        file: &Path,
        runs: &mut Runs,
        key: &str,
        (name, state): (&str, &str),
    ) -> Result<Option<Vec<(String, Tensor)>>> {
        let Some(k) = self.names.iter().position(|n| n == name) else {
            return Ok(None);
        };
        let mut out = Vec::new();
        match &self.shard {
            None => {
                let v = &self.master[k];
                let whole = Whole {
                    dims: v.dims(),
                    dtype: v.dtype(),
                };
                let t = runs.take(file, key, 0, v.elem_count(), &whole)?;
                out.push((key.to_string(), t.reshape(v.dims())?));
            }
            Some(s) => {
                let whole = Whole {
                    dims: self.compute[k].dims(),
                    dtype: DType::F32,
                };
                for p in s.plan.pieces.iter().filter(|p| p.param == k) {
                    let t = runs.take(file, key, p.from, p.len, &whole)?;
                    out.push((format!("{}::{state}", run_name(name, p.from, p.len)), t));
                }
            }
        }
        Ok(Some(out))
    }

    /// The model's f32 master values, whole: put together from every process's slice under
    /// sharding (a collective: every process calls it).
    pub(crate) fn whole_masters(&self, comm: &dyn Communicator) -> Result<Vec<Tensor>> {
        Ok(match &self.shard {
            Some(s) => s.gathered(comm, &self.compute)?,
            None => self.master.iter().map(|v| v.as_tensor().clone()).collect(),
        })
    }

    /// The variables a model file's values go into, keyed as `key` names variable `i` (`None`
    /// leaves it out): the f32 masters, or under sharding (no process holds whole masters) f32
    /// stand-ins starting from the current weights, returned second for
    /// [`take_loaded`](Self::take_loaded).
    /// Under stage 3 the stand-ins start from the whole masters (a collective: every process
    /// loads), since the units' weights are freed.
    pub(crate) fn load_targets(
        &self,
        comm: &dyn Communicator,
        key: impl Fn(&ParamSet, usize) -> Option<String>,
    ) -> Result<(Vec<(String, Var)>, Standins)> {
        let standins = match &self.shard {
            Some(s) if self.units.is_some() => Some(
                s.gathered(comm, &self.compute)?
                    .iter()
                    .map(|t| Ok(Var::from_tensor(t)?))
                    .collect::<Result<Vec<Var>>>()?,
            ),
            Some(_) => Some(
                self.compute
                    .iter()
                    .map(|c| Ok(Var::from_tensor(&c.as_tensor().to_dtype(DType::F32)?)?))
                    .collect::<Result<Vec<Var>>>()?,
            ),
            None => None,
        };
        let values = standins.as_deref().unwrap_or(&self.master);
        let keyed = (0..values.len())
            .filter_map(|i| key(self, i).map(|k| (k, values[i].clone())))
            .collect();
        Ok((keyed, standins))
    }

    /// After a model file was read into [`load_targets`](Self::load_targets)' variables: the
    /// stand-ins resliced into this process's pieces, and the weights refreshed.
    pub(crate) fn take_loaded(&self, standins: Standins) -> Result<()> {
        match (&self.shard, standins) {
            (Some(shard), Some(whole)) => {
                shard.reslice(&whole)?;
                for (i, (c, w)) in self.compute.iter().zip(&whole).enumerate() {
                    if !self.units().is_some_and(|u| u.released(i)) {
                        crate::precision::refresh_copy(c, w)?;
                    }
                }
                Ok(())
            }
            _ => self.refresh_copies(),
        }
    }
}
