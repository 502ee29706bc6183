//! Which of a prepared model's variables train: buffers (declared, listed, agreed across
//! processes at the end of every window; the work is `train/buffers.rs`'s) and the frozen
//! variables no prepared optimizer holds (listed, reported once).

use crate::accelerator::Accelerator;
use crate::error::Result;
use candle_core::Var;

impl Accelerator {
    /// Marks `var` as a buffer of its model: state the forward writes and no optimizer steps
    /// (a counter, a moving average), kept equal across processes as the
    /// [`buffers`](crate::AcceleratorBuilder::buffers) setting says, saved and resumed with
    /// the model, and never overwritten from a master weight. BatchNorm's running statistics
    /// are buffers without this call. Call it before or after preparing the model, before
    /// the first backward.
    ///
    /// ```no_run
    /// # fn main() -> ivme::Result<()> {
    /// let mut accelerator = ivme::Accelerator::new()?;
    /// let varmap = candle_nn::VarMap::new();
    /// let vb = accelerator.var_builder(&varmap, candle_core::DType::F32);
    /// let seen = vb.get_with_hints(1, "seen", candle_nn::Init::Const(0.0))?;
    /// accelerator.register_buffer(&candle_core::Var::from_tensor(&seen)?)?;
    /// # Ok(()) }
    /// ```
    pub fn register_buffer(&mut self, var: &Var) -> Result<()> {
        let id = var.as_tensor().id();
        for m in self.training.models_mut() {
            if m.mark_buffer(id) {
                return Ok(());
            }
        }
        self.training.add_pending_buffer(id);
        Ok(())
    }

    /// The variables prepared optimizers step (buffers left out), by name, model by model in
    /// name order.
    pub fn trained_names(&self) -> Vec<String> {
        self.training
            .models()
            .iter()
            .flat_map(|m| m.trained_names().map(str::to_string))
            .collect()
    }

    /// The frozen variables of every prepared model, by name: those no prepared optimizer
    /// holds and that are not buffers. Clipping does not count their gradients. (A buffer
    /// nobody declared is found at the end of the first window; until then it is listed here
    /// if no optimizer holds it.)
    pub fn frozen_names(&self) -> Vec<String> {
        self.training
            .models()
            .iter()
            .flat_map(|m| m.frozen_names().map(str::to_string))
            .collect()
    }

    /// Warns once (main process) about trained variables the first backward passes never
    /// reached: their optimizer never changes them, which no error would show.
    pub(crate) fn warn_unreached(&mut self, store: &candle_core::backprop::GradStore) {
        let main = self.is_main_process();
        let Some(u) = self.training.note_reach(store) else {
            return;
        };
        if !main {
            return;
        }
        let elems: usize = u.names.iter().map(|(_, n)| n).sum();
        let shown: Vec<&str> = u.names.iter().take(4).map(|(n, _)| n.as_str()).collect();
        let more = match u.names.len().saturating_sub(shown.len()) {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        warn_user!(
            "{} of {} trained variables ({:.2} M of {:.2} M parameters) got no gradient in the \
             first {} backward passes: {}{more}. The loss does not reach them, so their optimizer \
             never changes them. An op without a backward pass cuts the graph: candle-nn's fused \
             ops::rms_norm, ops::softmax_last_dim and ops::layer_norm (the fast paths \
             candle-transformers' models take) compute no gradient; use ivme::nn's differentiable \
             fused ops (rms_norm, softmax_last_dim, rope, attention) or a trainable model of \
             ivme::models (docs/models.md), or leave these variables out of the optimizer to \
             freeze them on purpose",
            u.names.len(),
            u.trained,
            elems as f64 / 1e6,
            u.trained_elems as f64 / 1e6,
            crate::train::reach::WATCHED,
            shown.join(", "),
        );
    }

    /// Says once, when some prepared variables are frozen, how much of the model trains:
    /// "training 0.05 M of 4.3 M parameters (1.2 %)". Called at the first backward.
    pub(crate) fn report_frozen_once(&mut self) {
        if !self.training.first_report() || !self.is_main_process() {
            return;
        }
        let (mut trained, mut frozen, mut vars) = (0usize, 0usize, 0usize);
        for m in self.training.models() {
            let (t, f, v) = m.parameter_counts();
            (trained, frozen, vars) = (trained + t, frozen + f, vars + v);
        }
        let constants = *self.finetune.constants.lock();
        if frozen + constants > 0 && !self.training.optimizers().is_empty() {
            let total = trained + frozen + constants;
            let mut why = Vec::new();
            if vars > 0 {
                why.push(format!(
                    "{vars} variable(s) no prepared optimizer holds are frozen \
                     (accelerator.frozen_names() lists them)"
                ));
            }
            if constants > 0 {
                why.push(format!(
                    "{:.2} M parameters of the base are constants",
                    constants as f64 / 1e6
                ));
            }
            warn_user!(
                "training {:.2} M of {:.2} M parameters ({:.1} %); {}",
                trained as f64 / 1e6,
                total as f64 / 1e6,
                100.0 * trained as f64 / total as f64,
                why.join("; ")
            );
        }
    }

    /// The buffers of every prepared model, by name, model by model in name order.
    pub fn buffer_names(&self) -> Vec<String> {
        self.training
            .models()
            .iter()
            .flat_map(|m| m.buffer_names().map(str::to_string))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use crate::optim::{AdamW, ParamsAdamW};
    use crate::train::reach::WATCHED;
    use crate::Accelerator;
    use candle_core::{DType, Device, Tensor};
    use candle_nn::{Init, Optimizer, VarMap};

    /// The unreached variables (name, elements), trained variables and their elements.
    type Verdict = Option<(Vec<(String, usize)>, usize, usize)>;

    /// Trains `w * f(x, a)` for WATCHED backward passes; returns what went unreached.
    fn unreached_after_training(fused: bool) -> crate::Result<Verdict> {
        let mut acc = Accelerator::builder().cpu(true).build()?;
        let varmap = VarMap::new();
        let a = varmap.get(3, "norm.alpha", Init::Const(1.0), DType::F32, &Device::Cpu)?;
        let w = varmap.get(3, "w", Init::Const(0.5), DType::F32, &Device::Cpu)?;
        let x = Tensor::new(&[[1f32, 2., 3.]], &Device::Cpu)?;
        let loss_of = |a: &Tensor, w: &Tensor| -> candle_core::Result<Tensor> {
            let h = if fused {
                candle_nn::ops::rms_norm(&x, a, 1e-5)?
            } else {
                x.broadcast_mul(a)?
            };
            h.broadcast_mul(w)?.sum_all()
        };
        // The premise, in plain candle: the fused norm passes its weight no gradient.
        let plain = loss_of(&a, &w)?.backward()?;
        assert_eq!(plain.get(&a).is_none(), fused);
        assert!(plain.get(&w).is_some());
        let opt = AdamW::new(varmap.all_vars(), ParamsAdamW::default())?;
        let (_varmap, mut opt) = acc.prepare((varmap, opt))?;
        for i in 0..WATCHED {
            assert!(
                acc.training.unreached().is_none(),
                "no verdict before pass {i}"
            );
            let grads = acc.backward(&loss_of(&a, &w)?)?;
            opt.step(&grads)?;
        }
        Ok(acc
            .training
            .unreached()
            .map(|u| (u.names.clone(), u.trained, u.trained_elems)))
    }

    #[test]
    fn a_trained_variable_behind_an_op_without_backward_is_found_unreached() -> crate::Result<()> {
        assert_eq!(
            unreached_after_training(true)?,
            Some((vec![("norm.alpha".to_string(), 3)], 2, 6))
        );
        assert_eq!(unreached_after_training(false)?, None);
        Ok(())
    }
}
