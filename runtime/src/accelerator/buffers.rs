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
            if let Some(i) = m.compute.iter().position(|c| c.as_tensor().id() == id) {
                m.buffer[i] = true;
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

    /// Says once, when some prepared variables are frozen, how much of the model trains:
    /// "training 0.05 M of 4.3 M parameters (1.2 %)". Called at the first backward.
    pub(crate) fn report_frozen_once(&mut self) {
        if !self.training.first_report() || !self.is_main_process() {
            return;
        }
        let (mut trained, mut frozen, mut vars) = (0usize, 0usize, 0usize);
        for m in self.training.models() {
            for (i, v) in m.master.iter().enumerate() {
                if m.buffer[i] {
                    continue;
                }
                if m.trained[i] {
                    trained += v.elem_count();
                } else {
                    frozen += v.elem_count();
                    vars += 1;
                }
            }
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

    /// Brings the buffers of the models this window trained to agreement (see the module
    /// docs); every process calls it at the end of each window.
    pub(crate) fn end_window_buffers(&mut self, touched: &[bool]) -> Result<()> {
        let mode = self.sync.buffers();
        let main = self.is_main_process();
        for m in self.training.touched_mut(touched) {
            let adopted = m.adopt_undeclared_buffers(&self.comm)?;
            if main && !adopted.is_empty() {
                // Printed, as the builder's warnings are: it changes what trains.
                warn_user!(
                    "{} received no gradient but changed in the forward, so they are kept \
                     as buffers (agreed across processes as `buffers = {mode}` says, never \
                     stepped); call `accelerator.register_buffer(&var)` to say so and silence \
                     this",
                    adopted.join(", ")
                );
            }
            m.sync_buffers(&self.comm, mode)?;
        }
        Ok(())
    }
}
