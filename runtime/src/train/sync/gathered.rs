//! ZeRO stage 3: the weights of each checkpointed segment's unit held as 1/N slices, gathered
//! for each run of the segment and freed after, their gradients reduce-scattered into the
//! slices as soon as the segment's backward ends.
//!
//! A unit is the set of a model's variables named `unit.…` (a block's `VarMap` prefix, given
//! by [`crate::activations::segment`]); sorted by name they are one contiguous run of the flat
//! parameter space (shard.rs), so gathering a unit is one all-gather of that run with each
//! process giving the part of its slice inside it, and scattering its gradient one
//! reduce-scatter. The f32 masters of a unit's slice (own copies, never the weights: those are
//! freed) are what the optimizer steps, as under stage 2; the weights are made from them at
//! each gather, each process rounding its own part to the compute dtype as stage 2's gather
//! does. Outside its segment a unit's variables keep their shape with no storage
//! (resident.rs). Variables in no unit (embeddings, the head, a final norm) are held whole and
//! end the window as stage 2 ends it. A unit's buffers (BatchNorm statistics) are whole too.
//!
//! Per micro-batch each unit's gradient is reduce-scattered at once: the window sums of a
//! unit's variables are this process's slice only (f32), never the whole gradient. At the
//! window's end [`Units::take_means`] hands the slices' means to the sharded step beside stage
//! 2's, and the step's gather skips the units: their next segment gathers the new values.
//!
//! The segments find this through [`crate::activations::UnitWeights`], which [`Gathering`]
//! implements on the thread that built the Accelerator.

use super::resident;
use crate::activations::UnitWeights;
use crate::comm::{Communicator, Counted};
use crate::error::{Error, Result};
use crate::train::shard::{Partial, Plan};
use crate::train::window::GradientState;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use std::cell::RefCell;
use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;

/// One prepared model's units, shared by its parameter set and the thread's [`Gathering`].
#[derive(Debug)]
pub(crate) struct Units {
    names: Vec<String>,
    /// The model's variables (handles on the storages that are freed and filled).
    compute: Vec<Var>,
    /// Whether each variable is a buffer (held whole, never freed).
    buffer: Vec<bool>,
    plan: Plan,
    /// This process's f32 masters, piece by piece (flat copies of their own).
    masters: Vec<Var>,
    /// The units seen so far: their names and variables (a range in name order).
    found: Vec<(String, Range<usize>)>,
    /// Whether each variable belongs to a unit (and is not a buffer): gathered on demand.
    member: Vec<bool>,
    /// Whether each variable's storage is freed now.
    released: Vec<bool>,
    /// Per piece: the window's sum of the reduce-scattered gradients of its slice.
    sums: Vec<Option<Vec<f32>>>,
    /// Whether a backward reached each variable.
    reached: Vec<bool>,
    /// Whether a unit's gradient arrived since [`Units::took_fresh`] last asked.
    fresh: bool,
}

impl Units {
    /// The units of a model of variables `compute` (named `names`, buffers flagged), cut by
    /// `plan`, whose slice's f32 masters are `masters` (one per piece).
    pub(crate) fn new(
        names: Vec<String>,
        compute: Vec<Var>,
        buffer: Vec<bool>,
        plan: Plan,
        masters: Vec<Var>,
    ) -> Units {
        let n = names.len();
        let pieces = plan.pieces.len();
        Units {
            names,
            compute,
            buffer,
            plan,
            masters,
            found: Vec::new(),
            member: vec![false; n],
            released: vec![false; n],
            sums: vec![None; pieces],
            reached: vec![false; n],
            fresh: false,
        }
    }

    /// The variables of `unit`, found once; `None` when the model has none under it.
    fn unit(&mut self, unit: &str) -> Result<Option<Range<usize>>> {
        if let Some((_, r)) = self.found.iter().find(|(u, _)| u == unit) {
            return Ok(Some(r.clone()));
        }
        let prefix = format!("{unit}.");
        let a = self.names.partition_point(|n| n.as_str() < prefix.as_str());
        let b = a + self.names[a..]
            .iter()
            .take_while(|n| n.starts_with(&prefix))
            .count();
        if a == b {
            return Ok(None);
        }
        if let Some((other, _)) = self.found.iter().find(|(_, r)| r.start < b && a < r.end) {
            return Err(Error::Usage(format!(
                "ZeRO-3: the segments `{unit}` and `{other}` share variables; each variable \
                 belongs to one unit (name segments by disjoint prefixes, such as one per block)"
            )));
        }
        for i in a..b {
            if self.buffer[i] {
                continue;
            }
            if !resident::fits(&self.compute[i]) {
                return Err(Error::Usage(format!(
                    "ZeRO-3 frees and refills `{}` outside its segment, which needs a CPU \
                     variable of its own (contiguous): make it with a VarMap",
                    self.names[i]
                )));
            }
            self.member[i] = true;
        }
        self.found.push((unit.to_string(), a..b));
        crate::activations::note_freed_unit(unit);
        Ok(Some(a..b))
    }

    /// The flat range of variables `r`.
    fn flat(&self, r: &Range<usize>) -> (usize, usize) {
        let p = &self.plan;
        (
            p.offsets[r.start],
            p.offsets[r.end - 1] + p.sizes[r.end - 1],
        )
    }

    /// How many elements of the flat range `lo..hi` each process's slice holds.
    fn shares(&self, lo: usize, hi: usize) -> Vec<usize> {
        let mut at = 0;
        self.plan
            .counts
            .iter()
            .map(|c| {
                let (a, b) = (at, at + c);
                at = b;
                hi.min(b).saturating_sub(lo.max(a))
            })
            .collect()
    }

    /// This process's pieces of variables `r`, as (piece, variable) pairs.
    fn pieces_in(&self, r: &Range<usize>) -> impl Iterator<Item = (usize, usize)> + '_ {
        let r = r.clone();
        self.plan
            .pieces
            .iter()
            .enumerate()
            .filter(move |(_, p)| r.contains(&p.param))
            .map(|(k, p)| (k, p.param))
    }

    /// Makes variables `r` whole from every process's slice (a collective), unless none of
    /// them is freed (the first run, before any step, holds them whole already).
    fn gather(&mut self, r: &Range<usize>, comm: &dyn Communicator) -> Result<()> {
        let members: Vec<usize> = r.clone().filter(|&i| self.member[i]).collect();
        if !members.iter().any(|&i| self.released[i]) {
            return Ok(());
        }
        let dtype = self.compute[members[0]].dtype();
        let half = matches!(dtype, DType::BF16 | DType::F16)
            && members.iter().all(|&i| self.compute[i].dtype() == dtype);
        let (wire, eb) = if half { (dtype, 2) } else { (DType::F32, 4) };
        let (lo, hi) = self.flat(r);
        let counts = self.shares(lo, hi);
        let mut mine = vec![0u8; counts[comm.rank()] * eb];
        let mut at = 0;
        for (k, _) in self.pieces_in(r) {
            let flat = self.masters[k].as_tensor().flatten_all()?;
            let dst = &mut mine[at..at + flat.elem_count() * eb];
            super::scatter::write_bytes(&flat, wire, dst)?;
            at += dst.len();
        }
        let mut whole = vec![0u8; (hi - lo) * eb];
        comm.all_gather_into(&mine, &mut whole, &counts, eb)?;
        drop(mine);
        for &i in &members {
            let at = (self.plan.offsets[i] - lo) * eb;
            resident::fill(
                &self.compute[i],
                &whole[at..at + self.plan.sizes[i] * eb],
                wire,
            )?;
            self.released[i] = false;
        }
        Ok(())
    }

    /// Frees the storage of variables `r` that belong to a unit.
    fn release(&mut self, r: &Range<usize>) -> Result<()> {
        for i in r.clone() {
            if self.member[i] && !self.released[i] {
                resident::release(&self.compute[i])?;
                self.released[i] = true;
            }
        }
        Ok(())
    }

    /// Takes the gradients of variables `r` out of `store`, sums them across processes into
    /// this process's slice (a reduce-scatter checked at `position`) and adds that to the
    /// window's sums.
    fn scatter(
        &mut self,
        r: &Range<usize>,
        store: &mut GradStore,
        comm: &dyn Communicator,
        position: u64,
    ) -> Result<()> {
        let (lo, hi) = self.flat(r);
        let mut send = vec![0f32; hi - lo];
        for i in r.clone().filter(|&i| self.member[i]) {
            let Some(g) = store.remove(self.compute[i].as_tensor()) else {
                continue;
            };
            self.reached[i] = true;
            // Packed straight from the gradient's own storage (f32 on the CPU): no copy of it.
            let at = self.plan.offsets[i] - lo;
            let dst = &mut send[at..at + self.plan.sizes[i]];
            super::scatter::copy_out(&g, 0, dst)?;
        }
        let counts = self.shares(lo, hi);
        let mut got = vec![0f32; counts[comm.rank()]];
        comm.reduce_scatter_sum_into(&send, &mut got, &counts, position)?;
        drop(send);
        // `got` holds the flat elements from max(lo, this slice's start) on.
        let first = lo.max(self.plan.start);
        let pieces: Vec<(usize, usize)> = self.pieces_in(r).collect();
        for (k, i) in pieces {
            if !self.member[i] {
                continue;
            }
            let p = self.plan.pieces[k];
            let at = self.plan.offsets[i] + p.from - first;
            let part = &got[at..at + p.len];
            match &mut self.sums[k] {
                Some(sum) => sum.iter_mut().zip(part).for_each(|(s, g)| *s += g),
                None => self.sums[k] = Some(part.to_vec()),
            }
        }
        self.fresh = true;
        Ok(())
    }

    /// Marks variable `i` a buffer (registered after the model was prepared): a unit found
    /// from now on leaves it whole. (One found already keeps it: register buffers before the
    /// first forward.)
    pub(crate) fn mark_buffer(&mut self, i: usize) {
        self.buffer[i] = true;
    }

    /// Whether a unit's gradient arrived since the last call.
    pub(crate) fn took_fresh(&mut self) -> bool {
        std::mem::replace(&mut self.fresh, false)
    }

    /// Whether variable `i` belongs to a unit (its weights are gathered on demand).
    pub(crate) fn member(&self, i: usize) -> bool {
        self.member[i]
    }

    /// Whether variable `i`'s storage is freed now.
    pub(crate) fn released(&self, i: usize) -> bool {
        self.released[i]
    }

    /// Whether a backward reached variable `i` through its unit.
    pub(crate) fn reached(&self, i: usize) -> bool {
        self.reached[i]
    }

    /// Ends the window for the units: each piece's mean gradient (its sum times `factor`)
    /// into `store`, keyed by its master, with this process's share of the overflow check and
    /// of the squared norm.
    pub(crate) fn take_means(
        &mut self,
        factor: f32,
        check_overflow: bool,
        want_norm: bool,
        store: &mut GradStore,
    ) -> Result<Partial> {
        let mut partial = Partial::default();
        for (k, sum) in self.sums.iter_mut().enumerate() {
            let Some(mut sum) = sum.take() else {
                continue;
            };
            for x in sum.iter_mut() {
                *x *= factor;
                partial.overflow |= check_overflow && !x.is_finite();
                if want_norm {
                    partial.squares += (*x as f64) * (*x as f64);
                }
            }
            let m = &self.masters[k];
            let n = sum.len();
            store.insert(m.as_tensor(), Tensor::from_vec(sum, n, m.device())?);
        }
        Ok(partial)
    }

    /// The window's sums so far, piece by piece (to save mid-window).
    pub(crate) fn slice_sums(&self) -> Result<Vec<(usize, Tensor)>> {
        let mut out = Vec::new();
        for (k, s) in self.sums.iter().enumerate() {
            if let Some(s) = s {
                let device = self.masters[k].device();
                out.push((k, Tensor::from_slice(s, s.len(), device)?));
            }
        }
        Ok(out)
    }

    /// Puts back saved window sums, piece by piece (none: a window's start).
    pub(crate) fn set_sums(&mut self, saved: Vec<Option<Tensor>>) -> Result<()> {
        self.sums.iter_mut().for_each(|s| *s = None);
        for (sum, t) in self.sums.iter_mut().zip(saved) {
            if let Some(t) = t {
                *sum = Some(t.to_dtype(DType::F32)?.to_vec1::<f32>()?);
            }
        }
        Ok(())
    }

    /// Which variables the step's gather leaves alone: the units' (and `skip`'s).
    pub(crate) fn skip_mask(&self, skip: &[bool]) -> Vec<bool> {
        skip.iter()
            .zip(&self.member)
            .map(|(s, m)| *s || *m)
            .collect()
    }
}

/// The thread's hands on the units of every model prepared under ZeRO-3.
pub(crate) struct Gathering {
    comm: Rc<Counted>,
    window: Arc<GradientState>,
    models: RefCell<Vec<Rc<RefCell<Units>>>>,
    /// The units gathered since the last release: (model, variables).
    held: RefCell<Vec<(usize, Range<usize>)>>,
}

impl Gathering {
    /// No model yet; collectives on `comm`, checked at `window`'s position.
    pub(crate) fn new(comm: Rc<Counted>, window: Arc<GradientState>) -> Gathering {
        Gathering {
            comm,
            window,
            models: RefCell::new(Vec::new()),
            held: RefCell::new(Vec::new()),
        }
    }

    /// Adds a prepared model's units.
    pub(crate) fn add(&self, units: Rc<RefCell<Units>>) {
        self.models.borrow_mut().push(units);
    }

    /// Whether any segment gathered a unit of any model so far.
    pub(crate) fn any_unit(&self) -> bool {
        self.models
            .borrow()
            .iter()
            .any(|m| !m.borrow().found.is_empty())
    }
}

impl UnitWeights for Gathering {
    fn gather(&self, unit: &str) -> Result<()> {
        let models = self.models.borrow();
        for (k, m) in models.iter().enumerate() {
            let mut m = m.borrow_mut();
            let Some(r) = m.unit(unit)? else {
                continue;
            };
            if self.held.borrow().iter().any(|(j, h)| *j == k && *h == r) {
                return Ok(());
            }
            m.gather(&r, &*self.comm)?;
            self.held.borrow_mut().push((k, r));
            return Ok(());
        }
        Err(Error::Usage(format!(
            "ZeRO-3: a segment names the unit `{unit}`, but no prepared model has variables \
             named `{unit}.…`; give ivme::activations::segment the VarMap prefix of the \
             block's weights (such as `model.layers.3`)"
        )))
    }

    fn release(&self) -> Result<()> {
        let models = self.models.borrow();
        for (k, r) in self.held.borrow_mut().drain(..) {
            models[k].borrow_mut().release(&r)?;
        }
        Ok(())
    }

    fn scatter(&self, store: &mut GradStore) -> Result<()> {
        let position = self.window.position();
        {
            let models = self.models.borrow();
            for (k, r) in self.held.borrow().iter() {
                models[*k]
                    .borrow_mut()
                    .scatter(r, store, &*self.comm, position)?;
            }
        }
        self.release()
    }
}
