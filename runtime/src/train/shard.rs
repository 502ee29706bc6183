//! ZeRO-style sharding of the training state, stages 1 and 2.
//!
//! The parameters of a prepared model, in name order (the order of the gradient buckets), are
//! one flat space of `N` elements, cut into one contiguous slice per process: process `r` owns
//! elements `N·r/W .. N·(r+1)/W`. It keeps f32 master weights and optimizer state for its slice
//! only, as *pieces* (the runs of each parameter inside the slice, a flat f32 variable each).
//! Under f32 no piece is a copy: its master is the model's variable itself, which the optimizer
//! updates whole (a piece that is a whole variable, in the variable's shape) or on the piece's
//! run of its flat elements (`optim/runs.rs`; a piece the slice's first or last boundary cuts),
//! so f32 training holds the weights once. Only an optimizer other than ivme's AdamW and Sgd
//! gets flat copies of the cut pieces. Code that reads a master flat goes through
//! [`Sharded::flat`], and code that writes one through [`Sharded::set_piece`].
//! At the end of an accumulation window the Accelerator's `backward`:
//!
//! 1. averages the gradients: whole, as in plain data parallelism (stage 1), or
//!    reduce-scattered so each process receives only its slice's mean (stage 2);
//! 2. agrees on the fp16 overflow flag and the global gradient norm with one small all-reduce
//!    of this process's partial sums (only when clipping or fp16 needs them);
//! 3. unless the step overflowed: clips, steps the prepared optimizer over the pieces, and
//!    all-gathers the updated slices into every process's model weights.
//!
//! The step happens inside `backward` (as DeepSpeed's engine does under Accelerate), so the
//! prepared optimizer's `step` is a no-op for a sharded model; the loop is unchanged.

use crate::comm::Communicator;
use crate::error::Result;
use crate::optim::runs::Run;
use crate::setup::config::Sharding;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor, Var};

/// A run of one parameter's elements inside this process's slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    /// The parameter's index in name order.
    pub param: usize,
    /// The run's first element within the parameter (flattened).
    pub from: usize,
    /// How many elements it has.
    pub len: usize,
}

/// The flat parameter space cut into one slice per process, and this process's pieces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Elements of each parameter, in name order.
    pub sizes: Vec<usize>,
    /// Each parameter's first element in the flat space.
    pub offsets: Vec<usize>,
    /// Elements of each process's slice (they differ by at most one).
    pub counts: Vec<usize>,
    /// This process's first element.
    pub start: usize,
    /// This process's pieces, in flat order.
    pub pieces: Vec<Piece>,
}

impl Plan {
    /// Cuts parameters of `sizes` elements across `world` processes, seen from `rank`.
    pub fn new(sizes: &[usize], world: usize, rank: usize) -> Plan {
        let total: usize = sizes.iter().sum();
        let bound = |r: usize| total * r / world;
        let counts = (0..world).map(|r| bound(r + 1) - bound(r)).collect();
        let (start, end) = (bound(rank), bound(rank + 1));
        let mut offsets = Vec::with_capacity(sizes.len());
        let mut pieces = Vec::new();
        let mut at = 0;
        for (param, &n) in sizes.iter().enumerate() {
            offsets.push(at);
            let (lo, hi) = (start.max(at), end.min(at + n));
            if lo < hi {
                pieces.push(Piece {
                    param,
                    from: lo - at,
                    len: hi - lo,
                });
            }
            at += n;
        }
        Plan {
            sizes: sizes.to_vec(),
            offsets,
            counts,
            start,
            pieces,
        }
    }
}

/// Steps the prepared optimizer over a sharded model's pieces.
pub(crate) type Stepper = Box<dyn FnMut(&GradStore) -> Result<()>>;

/// The sharded part of a prepared model: its plan, this process's masters and the optimizer.
pub(crate) struct Sharded {
    pub stage: Sharding,
    pub plan: Plan,
    /// The f32 master of each piece: the model's own variable when it is f32 (`aliased`),
    /// a flat variable of the piece's length otherwise.
    pub masters: Vec<Var>,
    /// Which masters are the model's variables themselves.
    pub aliased: Vec<bool>,
    /// For a master that is a variable the piece covers only in part: the piece's run.
    pub runs: Vec<Option<Run>>,
    /// The prepared optimizer over `masters`, once there is one.
    pub stepper: Option<Stepper>,
}

impl std::fmt::Debug for Sharded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sharded")
            .field("stage", &self.stage)
            .field("plan", &self.plan)
            .field("stepper", &self.stepper.is_some())
            .finish()
    }
}

/// A flat f32 variable holding exactly `t`'s elements (no view into a larger storage).
fn own_copy(t: &Tensor, device: &Device) -> Result<Var> {
    let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let n = v.len();
    Ok(Var::from_tensor(&Tensor::from_vec(v, n, device)?)?)
}

impl Sharded {
    /// This process's slice of `full` (each parameter's whole f32 value, which the model's
    /// variables `compute` already hold), as masters: the variable itself when it is f32
    /// (with the piece's run when the piece does not cover it), a new flat copy otherwise.
    /// Under stage 3 every master is a copy: a unit's weights are freed between its segments.
    pub fn new(stage: Sharding, plan: Plan, full: &[Tensor], compute: &[Var]) -> Result<Sharded> {
        let n = plan.pieces.len();
        let (mut masters, mut aliased, mut runs) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for p in &plan.pieces {
            let var = &compute[p.param];
            let whole = p.from == 0 && p.len == plan.sizes[p.param];
            if var.dtype() == DType::F32 && var.is_contiguous() && stage != Sharding::Parameters {
                masters.push(var.clone());
                aliased.push(true);
                runs.push((!whole).then_some(Run {
                    from: p.from,
                    len: p.len,
                }));
            } else {
                let t = &full[p.param];
                masters.push(own_copy(
                    &t.flatten_all()?.narrow(0, p.from, p.len)?,
                    t.device(),
                )?);
                aliased.push(false);
                runs.push(None);
            }
        }
        Ok(Sharded {
            stage,
            plan,
            masters,
            aliased,
            runs,
            stepper: None,
        })
    }

    /// Piece `k`'s master as a flat f32 tensor (a view: no copy).
    pub fn flat(&self, k: usize) -> Result<Tensor> {
        let flat = self.masters[k].as_tensor().flatten_all()?;
        Ok(match self.runs[k] {
            Some(r) => flat.narrow(0, r.from, r.len)?,
            None => flat,
        })
    }

    /// The shape piece `k`'s gradient (and optimizer state) has: its master's, or its run's.
    pub fn piece_shape(&self, k: usize) -> Shape {
        match self.runs[k] {
            Some(r) => Shape::from(r.len),
            None => self.masters[k].shape().clone(),
        }
    }

    /// Sets piece `k`'s master to `flat` (its elements in flat order, not read from the
    /// master itself).
    pub fn set_piece(&self, k: usize, flat: &Tensor) -> Result<()> {
        let (m, flat) = (&self.masters[k], flat.to_dtype(DType::F32)?);
        match self.runs[k] {
            Some(r) => m
                .as_tensor()
                .flatten_all()?
                .slice_set(&flat.contiguous()?, 0, r.from)?,
            None => m.set(&flat.reshape(m.shape())?)?,
        }
        Ok(())
    }

    /// Gives every piece that is a run of a variable a flat copy of its own as its master,
    /// for an optimizer that cannot update runs (see `optim::runs::rebind`).
    pub fn copy_runs(&mut self) -> Result<()> {
        for k in 0..self.masters.len() {
            if self.runs[k].is_some() {
                let flat = self.flat(k)?;
                self.masters[k] = own_copy(&flat, flat.device())?;
                self.aliased[k] = false;
                self.runs[k] = None;
            }
        }
        Ok(())
    }

    /// Drops from `store` the gradients of pieces that are runs, once stepped: they are keyed
    /// by the model's variable but hold only the run, which a caller reading the store
    /// would take for the variable's whole gradient.
    pub fn forget_runs(&self, store: &mut GradStore) {
        for (m, r) in self.masters.iter().zip(&self.runs) {
            if r.is_some() {
                store.remove(m.as_tensor());
            }
        }
    }

    /// Takes the masters from the model's weights `compute` (after `load_model`); a master
    /// that is the weight itself already holds it.
    pub fn reslice(&self, compute: &[Var]) -> Result<()> {
        for (k, p) in self.plan.pieces.iter().enumerate() {
            if self.aliased[k] && compute[p.param].as_tensor().id() == self.masters[k].id() {
                continue;
            }
            let t = compute[p.param].as_tensor().flatten_all()?;
            self.set_piece(k, &t.narrow(0, p.from, p.len)?)?;
        }
        Ok(())
    }

    /// Every parameter's whole f32 master, put together from every process's slice (a
    /// collective: every process calls it).
    pub(crate) fn gathered(&self, comm: &dyn Communicator, compute: &[Var]) -> Result<Vec<Tensor>> {
        let mut mine = Vec::with_capacity(self.plan.counts[comm.rank()] * 4);
        for k in 0..self.masters.len() {
            for x in self.flat(k)?.to_vec1::<f32>()? {
                mine.extend_from_slice(&x.to_le_bytes());
            }
        }
        let total: usize = self.plan.counts.iter().sum();
        let mut whole = vec![0u8; total * 4];
        comm.all_gather_into(&mine, &mut whole, &self.plan.counts, 4)?;
        compute
            .iter()
            .enumerate()
            .map(|(i, var)| {
                let at = self.plan.offsets[i] * 4;
                let values: Vec<f32> = whole[at..at + self.plan.sizes[i] * 4]
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                Ok(Tensor::from_vec(values, var.shape(), var.device())?)
            })
            .collect()
    }
}

/// What a sharded sync leaves for the step: the pieces' gradients and the partial sums the
/// processes still have to agree on.
#[derive(Debug, Default)]
pub(crate) struct Partial {
    pub(crate) overflow: bool,
    pub(crate) squares: f64,
}

impl Sharded {
    /// Stage 1: this process's pieces of the whole mean gradients in `full` (keyed by the
    /// model's `master` variables) into `store` (keyed by the piece masters), with this
    /// process's share of the squared norm when `want_norm` (for clipping).
    pub(crate) fn slice_whole(
        &self,
        full: &GradStore,
        master: &[Var],
        want_norm: bool,
        store: &mut GradStore,
    ) -> Result<Partial> {
        let mut partial = Partial::default();
        for (k, (p, m)) in self.plan.pieces.iter().zip(&self.masters).enumerate() {
            if let Some(g) = full.get(master[p.param].as_tensor()) {
                let g = g.flatten_all()?.narrow(0, p.from, p.len)?;
                if want_norm {
                    partial.squares += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
                }
                store.insert(m.as_tensor(), g.reshape(self.piece_shape(k))?);
            }
        }
        Ok(partial)
    }
}

/// Replaces every piece gradient in `store` by `f(gradient)`, over the pieces of `shards`.
pub(crate) fn scale_all<'a>(
    store: &mut GradStore,
    shards: impl Iterator<Item = &'a Sharded>,
    f: impl Fn(Tensor) -> candle_core::Result<Tensor>,
) -> Result<()> {
    for v in shards.flat_map(|s| &s.masters) {
        if let Some(g) = store.remove(v.as_tensor()) {
            store.insert(v.as_tensor(), f(g)?);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flat_space_is_cut_into_contiguous_slices_that_cover_it_once() {
        let sizes = [6, 1, 4]; // 11 elements over 3 ranks: 3, 4, 4
        let plans: Vec<Plan> = (0..3).map(|r| Plan::new(&sizes, 3, r)).collect();
        assert_eq!(plans[0].counts, vec![3, 4, 4]);
        assert_eq!(
            plans[1].pieces,
            vec![
                Piece {
                    param: 0,
                    from: 3,
                    len: 3
                },
                Piece {
                    param: 1,
                    from: 0,
                    len: 1
                }
            ]
        );
        assert_eq!(
            plans[2].pieces,
            vec![Piece {
                param: 2,
                from: 0,
                len: 4
            }]
        );
        let mut seen = vec![0; 11];
        for plan in &plans {
            for p in &plan.pieces {
                for e in 0..p.len {
                    seen[plan.offsets[p.param] + p.from + e] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
        // More processes than elements: some slices are empty.
        assert!(Plan::new(&[1], 2, 0).pieces.is_empty());
        assert_eq!(Plan::new(&[1], 2, 1).pieces.len(), 1);
    }

    #[test]
    fn f32_pieces_are_the_variables_themselves_or_copies_when_asked() -> Result<()> {
        let dev = Device::Cpu;
        let w = Var::new(&[[1f32, 2., 3.], [4., 5., 6.]], &dev)?;
        let b = Var::new(&[7f32, 8.], &dev)?;
        let compute = vec![w.clone(), b.clone()];
        let full: Vec<Tensor> = compute.iter().map(|v| v.as_tensor().clone()).collect();
        let flat = |v: &Var| v.as_tensor().flatten_all()?.to_vec1::<f32>();
        // 8 elements over 2 ranks: rank 1 holds w's elements 4..6 and all of b.
        let plan = Plan::new(&[6, 2], 2, 1);
        let mut s = Sharded::new(Sharding::Gradients, plan, &full, &compute)?;
        assert_eq!(s.runs, vec![Some(Run { from: 4, len: 2 }), None]);
        assert_eq!(s.aliased, vec![true, true]);
        assert_eq!(s.masters[0].id(), w.id());
        assert_eq!(s.masters[1].id(), b.id());
        assert_eq!(s.flat(0)?.to_vec1::<f32>()?, [5., 6.]);
        assert_eq!(s.piece_shape(0).dims(), [2]);
        assert_eq!(s.piece_shape(1).dims(), [2]);
        // Writing the run writes the weight, and nothing else of it.
        s.set_piece(0, &Tensor::new(&[50f32, 60.], &dev)?)?;
        assert_eq!(flat(&w)?, [1., 2., 3., 4., 50., 60.]);
        // A stepped run's gradient leaves the store handed back; a whole piece's stays.
        let mut store = GradStore::default();
        store.insert(w.as_tensor(), Tensor::new(&[0.5f32, 0.5], &dev)?);
        store.insert(b.as_tensor(), Tensor::new(&[0.5f32, 0.5], &dev)?);
        s.forget_runs(&mut store);
        assert!(store.get(w.as_tensor()).is_none());
        assert!(store.get(b.as_tensor()).is_some());
        // For another optimizer the run becomes a copy, apart from the weight.
        s.copy_runs()?;
        assert_eq!(s.runs, vec![None, None]);
        assert_eq!(s.aliased, vec![false, true]);
        assert_ne!(s.masters[0].id(), w.id());
        assert_eq!(s.flat(0)?.to_vec1::<f32>()?, [50., 60.]);
        s.set_piece(0, &Tensor::new(&[0f32, 0.], &dev)?)?;
        assert_eq!(flat(&w)?, [1., 2., 3., 4., 50., 60.]);
        // Other dtypes always get copies.
        let h = Var::from_tensor(&w.as_tensor().to_dtype(DType::BF16)?)?;
        let s = Sharded::new(Sharding::Gradients, Plan::new(&[6], 1, 0), &full[..1], &[h])?;
        assert_eq!((s.aliased[0], s.runs[0]), (false, None));
        Ok(())
    }

    /// One process: sharding is the identity, and training matches the unsharded run bit for
    /// bit (f32, AdamW with clipping and accumulation).
    #[test]
    fn a_single_process_trains_sharded_exactly_as_unsharded() {
        use crate::optim::{AdamW, ParamsAdamW};
        use crate::Accelerator;
        use candle_nn::{Init, Optimizer, VarMap};
        let run = |sharding: Sharding| -> Vec<f32> {
            let mut acc = Accelerator::builder()
                .cpu(true)
                .grad_accum(2)
                .clip_grad_norm(0.5)
                .sharding(sharding)
                .build()
                .unwrap();
            let varmap = VarMap::new();
            let vb = acc.var_builder(&varmap, DType::F32);
            let w = vb.get_with_hints((4, 3), "w", Init::Const(0.3)).unwrap();
            let opt = AdamW::new(varmap.all_vars(), ParamsAdamW::default()).unwrap();
            let (_vm, mut opt) = acc.prepare((varmap.clone(), opt)).unwrap();
            for i in 0..6 {
                let x = Tensor::new(&[1.0f32, -2.0, 0.5 * i as f32], &Device::Cpu).unwrap();
                let loss = w.matmul(&x.unsqueeze(1).unwrap()).unwrap().sqr().unwrap();
                let grads = acc.backward(&loss.sum_all().unwrap()).unwrap();
                opt.step(&grads).unwrap();
            }
            let w = varmap.data().lock().unwrap()["w"].clone();
            w.as_tensor().flatten_all().unwrap().to_vec1().unwrap()
        };
        let plain = run(Sharding::No);
        assert_eq!(run(Sharding::Optimizer), plain);
        assert_eq!(run(Sharding::Gradients), plain);
    }
}
