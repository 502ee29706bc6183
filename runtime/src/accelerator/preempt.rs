//! Stopping for a preemption: the ranks agree at a gradient sync (setup/preempt.rs), finish
//! that optimizer step, and the loop's preemption point saves a checkpoint and ends the run
//! with [`Error::Preempted`].

use crate::accelerator::Accelerator;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::setup::preempt::{self, Stopped};
use std::path::PathBuf;

impl Accelerator {
    /// Whether the run should stop for a preemption: a preemption signal (SIGTERM or SIGUSR1
    /// by default, `IVME_PREEMPT_SIGNALS`) reached a rank or `ivme launch`, and every rank
    /// agreed at the last gradient sync to stop after that optimizer step. The same answer on
    /// every rank. [`preemption_point`](Self::preemption_point) acts on it.
    pub fn should_stop(&self) -> bool {
        self.preempt.agreed
    }

    /// The place in the loop where a preempted run stops: call it after the optimizer step
    /// (and the scheduler's), once per micro-batch. It does nothing until the ranks agreed to
    /// stop ([`should_stop`](Self::should_stop)); then every rank finishes a save still
    /// running in the background, saves a checkpoint in the project's automatic naming (when
    /// a project folder with automatic naming is set) and waits for the others, and it returns
    /// [`Error::Preempted`], which ends the loop through `?`. `ivme launch` then exits with
    /// its requeue code (75 unless `IVME_REQUEUE_EXIT_CODE`), and a restarted run that calls
    /// [`load_state_if_any`](Self::load_state_if_any) continues from that step exactly.
    /// `#[accelerate]` calls it at the end of the batch loop's body. It is also where the
    /// in-memory snapshots of [`snapshot_every`](crate::AcceleratorBuilder::snapshot_every)
    /// are taken.
    ///
    /// ```no_run
    /// # fn main() -> ivme::Result<()> {
    /// # let mut accelerator = ivme::Accelerator::builder().project_dir("runs/demo").build()?;
    /// # let batches: Vec<candle_core::Tensor> = Vec::new();
    /// for batch in &batches {
    ///     // forward, backward, optimizer and scheduler steps ...
    ///     accelerator.preemption_point()?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn preemption_point(&mut self) -> Result<()> {
        if let Some(stopped) = &self.preempt.stopped {
            return Err(stopped.error());
        }
        if !self.preempt.agreed {
            self.snapshot_if_due()?;
            return self.step_times_if_due();
        }
        let step = self.optimizer_steps();
        let automatic = self
            .checkpoints
            .project()
            .is_some_and(|p| p.automatic_checkpoint_naming);
        // A save announced in the background is committed first, then this step's.
        self.wait_for_checkpoint()?;
        let checkpoint = if automatic {
            let dir = self.save_state(None)?;
            self.wait_for_checkpoint()?;
            Some(dir)
        } else {
            None
        };
        // No rank ends before every rank's part of the checkpoint is committed.
        self.comm.barrier()?;
        Err(self.stop(step, checkpoint))
    }

    /// Ends the run for an agreed preemption: notes it for the launcher, gives the signals
    /// their default effect again and returns the error every later call repeats.
    fn stop(&mut self, step: u64, checkpoint: Option<PathBuf>) -> Error {
        preempt::note_stopped(self.process_index(), step, checkpoint.as_deref());
        preempt::disarm();
        let stopped = Stopped { step, checkpoint };
        let e = stopped.error();
        self.preempt.stopped = Some(stopped);
        e
    }

    /// Run first by every `backward`: once the ranks agreed to stop and the loop went on past
    /// its optimizer step without a preemption point, the run stops here, saving nothing (the
    /// micro-batch already computed would make a checkpoint taken now replay differently).
    pub(crate) fn stop_if_agreed(&mut self) -> Result<()> {
        if let Some(stopped) = &self.preempt.stopped {
            return Err(stopped.error());
        }
        if self.preempt.agreed {
            let step = self.optimizer_steps();
            if self.is_main_process() {
                warn_user!(
                    "preempted, but the loop has no preemption point after its optimizer \
                     step, so nothing was saved; call `accelerator.preemption_point()?` there \
                     (docs/faults.md)"
                );
            }
            return Err(self.stop(step, None));
        }
        preempt::arm();
        Ok(())
    }

    /// Run at the end of every window: whether any rank asked to stop, as all agree.
    pub(crate) fn agree_on_stop(&mut self) -> Result<()> {
        if !self.preempt.agreed && self.comm.agree_to_stop()? {
            self.preempt.agreed = true;
        }
        Ok(())
    }
}
