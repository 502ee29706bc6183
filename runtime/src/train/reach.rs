//! Which trained variables the loss reaches: over the first backward passes, every variable a
//! prepared optimizer steps should get a gradient at least once. One that never does is
//! silently never trained — most often because an op without a backward pass (candle-nn's
//! fused `rms_norm`, `softmax_last_dim`, `layer_norm`) cut the graph below the loss.

use crate::train::params::ParamSet;
use candle_core::backprop::GradStore;

/// Backward passes watched before the verdict: enough for a GAN's or a multi-loss loop's
/// losses to each have had their turn.
pub(crate) const WATCHED: usize = 8;

/// What the first backward passes reached, per model and variable.
#[derive(Debug, Default)]
pub(crate) struct Reach {
    calls: usize,
    seen: Vec<Vec<bool>>,
    done: bool,
}

/// Trained variables no watched backward pass reached: (name, elements), and how many trained
/// variables and elements there are in all.
#[derive(Debug, PartialEq)]
pub(crate) struct Unreached {
    pub(crate) names: Vec<(String, usize)>,
    pub(crate) trained: usize,
    pub(crate) trained_elems: usize,
}

impl Reach {
    /// Notes the variables `store` holds gradients for; after [`WATCHED`] calls returns, once,
    /// the trained variables none of them reached (`None` when every one was reached).
    pub(crate) fn note(&mut self, models: &[ParamSet], store: &GradStore) -> Option<Unreached> {
        if self.done {
            return None;
        }
        self.seen.resize_with(models.len(), Vec::new);
        for (m, seen) in models.iter().zip(self.seen.iter_mut()) {
            seen.resize(m.compute.len(), false);
            let units = m.units();
            for (i, var) in m.compute.iter().enumerate() {
                // A stage-3 unit's gradient left the store during backward (sync/gathered.rs).
                let by_unit = units.as_ref().is_some_and(|u| u.reached(i));
                if !seen[i] && (by_unit || store.get(var.as_tensor()).is_some()) {
                    seen[i] = true;
                }
            }
        }
        self.calls += 1;
        if self.calls < WATCHED {
            return None;
        }
        self.done = true;
        let mut out = Unreached {
            names: Vec::new(),
            trained: 0,
            trained_elems: 0,
        };
        for (m, seen) in models.iter().zip(&self.seen) {
            for (i, var) in m.compute.iter().enumerate() {
                if !m.trained[i] || m.buffer[i] {
                    continue;
                }
                out.trained += 1;
                out.trained_elems += var.elem_count();
                if !seen[i] {
                    out.names.push((m.names[i].clone(), var.elem_count()));
                }
            }
        }
        (!out.names.is_empty()).then_some(out)
    }
}
