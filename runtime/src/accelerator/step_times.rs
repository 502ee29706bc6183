//! The step-time report (observe/step_times.rs): this rank's totals, every rank's, and the
//! table the main process prints, by hand or every few steps at the preemption point.

use crate::accelerator::Accelerator;
use crate::error::Result;
use crate::observe::step_times::StepTimes;

impl Accelerator {
    /// Where this process's time went since it started (or since the last report reset it):
    /// waiting for prepared loaders' batches, candle's backward, the end of accumulation
    /// windows (gradient collectives with the wait for other ranks, clipping), the prepared
    /// optimizers, checkpoint stalls, and the rest (the forward pass and the loop's code).
    pub fn step_times(&self) -> StepTimes {
        self.training.window().clock().read()
    }

    /// Every process's [`step_times`](Self::step_times), in rank order. Every rank must call
    /// it.
    pub fn step_times_all(&self) -> Result<Vec<StepTimes>> {
        self.gather_object(&self.step_times())
    }

    /// Prints every process's time per optimizer step, phase by phase, on the main process
    /// (the rank the others wait for is named: it waits least at the gradient sync), then
    /// starts the totals again. Every rank must call it. `IVME_STEP_TIMES=N` prints it every
    /// N optimizer steps at the loop's preemption point.
    ///
    /// ```no_run
    /// # fn main() -> ivme::Result<()> {
    /// # let accelerator = ivme::Accelerator::new()?;
    /// // ... train a while ...
    /// accelerator.print_step_times()?;
    /// # Ok(()) }
    /// ```
    pub fn print_step_times(&self) -> Result<()> {
        let all = self.step_times_all()?;
        self.print(StepTimes::report(&all).trim_end());
        self.training.window().clock().reset();
        Ok(())
    }

    /// Prints the report when `IVME_STEP_TIMES=N` asks for one after this optimizer step.
    pub(crate) fn step_times_if_due(&mut self) -> Result<()> {
        let Some(every) = self.step_times_every else {
            return Ok(());
        };
        let steps = self.step_times().steps;
        if steps >= every {
            self.print_step_times()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::accelerator::slow_data::Slow;
    use crate::data::DataLoader;
    use crate::optim::{ParamsSgd, Sgd};
    use crate::Accelerator;
    use candle_core::{DType, Device};
    use candle_nn::{Optimizer, VarMap};

    #[test]
    fn every_phase_of_a_step_is_counted_where_it_happened() -> crate::Result<()> {
        let mut acc = Accelerator::builder().cpu(true).grad_accum(2).build()?;
        let varmap = VarMap::new();
        let w = varmap.get(
            3,
            "w",
            candle_nn::Init::Const(0.5),
            DType::F32,
            &Device::Cpu,
        )?;
        let opt = Sgd::new(varmap.all_vars(), ParamsSgd::default())?;
        let (_varmap, mut opt, mut loader) =
            acc.prepare((varmap, opt, DataLoader::new(Slow { len: 16, ms: 10 }, 2)))?;
        acc.step_times_all()?; // a fresh start: nothing counted yet
        for batch in loader.iter() {
            let x = batch?;
            let loss = x.broadcast_mul(&w)?.sum_all()?;
            let grads = acc.backward(&loss)?;
            opt.step(&grads)?;
        }
        let t = acc.step_times();
        // 8 batches, windows of 2.
        assert_eq!((t.steps, t.micro_batches), (4, 8));
        assert!(t.data >= 0.08, "8 batches of 10 ms: {t:?}");
        assert!(
            t.backward > 0.0 && t.sync > 0.0 && t.optimizer > 0.0,
            "{t:?}"
        );
        assert!(
            t.wall >= t.data + t.backward + t.sync + t.optimizer,
            "{t:?}"
        );
        acc.print_step_times()?;
        assert_eq!(
            acc.step_times().steps,
            0,
            "a report starts the totals again"
        );
        Ok(())
    }
}
