//! Everyday tools on the Accelerator: output on one process, progress bars, held memory, experiment trackers.

use crate::accelerator::Accelerator;
use crate::error::{Error, Result};
use crate::observe::logging::init;
use crate::observe::logging::LogConfig;
use crate::observe::memory::bytes;
use crate::observe::memory::HeldBytes;
use crate::observe::progress::progress;
use crate::observe::progress::Progress;
use crate::observe::tracking::Tracker;
use crate::observe::tracking::Trackers;
use serde::Serialize;
use std::collections::BTreeMap;

impl Accelerator {
    /// Sets up logging with this process's rank; see [`init`].
    pub fn init_logging(&self, config: LogConfig) -> Result<bool> {
        init(config.rank(self.process_index()))
    }

    /// Runs `f` on the main process first and on the others once it has finished; returns
    /// what `f` returned on this rank.
    ///
    /// For work whose result the others reuse (a downloaded file, a built cache). Every rank
    /// must call it; if `f` panics on the main process the others wait forever.
    pub fn main_process_first<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        self.first_then_others(self.is_main_process(), f)
    }

    /// Runs `f` on each machine's main process first and on the other processes of the
    /// machine once those have finished; returns what `f` returned on this rank.
    pub fn local_main_process_first<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        self.first_then_others(self.is_local_main_process(), f)
    }

    // One barrier splits the ranks into "before" and "after": the first group reaches it
    // after running `f`, the rest before.
    fn first_then_others<T>(&self, first: bool, f: impl FnOnce() -> T) -> Result<T> {
        if first {
            let out = f();
            self.wait_for_everyone()?;
            Ok(out)
        } else {
            self.wait_for_everyone()?;
            Ok(f())
        }
    }

    /// Runs `f` on the main process only; `None` elsewhere.
    pub fn on_main_process<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        self.is_main_process().then(f)
    }

    /// Runs `f` on each machine's main process only; `None` elsewhere.
    pub fn on_local_main_process<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        self.is_local_main_process().then(f)
    }

    /// Runs `f` on global rank `rank` only; `None` elsewhere.
    pub fn on_process<T>(&self, rank: usize, f: impl FnOnce() -> T) -> Option<T> {
        (self.process_index() == rank).then(f)
    }

    /// Runs `f` on the last process only; `None` elsewhere.
    pub fn on_last_process<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        (self.process_index() + 1 == self.num_processes()).then(f)
    }
}

impl Accelerator {
    /// Wraps `iter` in a progress bar drawn on the main process only; the length comes from
    /// the iterator when it knows it exactly (a loader's batches do), giving an ETA.
    ///
    /// See the [module docs](crate::observe::progress) for setting the loss while looping.
    pub fn progress<I: IntoIterator>(&self, iter: I) -> Progress<I::IntoIter> {
        let iter = iter.into_iter();
        let len = match iter.size_hint() {
            (lo, Some(hi)) if lo == hi => Some(lo as u64),
            _ => None,
        };
        progress(iter, len, self.is_main_process()).with_samples(
            self.training.window().samples().clone(),
            self.num_processes(),
        )
    }
}

impl Accelerator {
    /// What the training state this process holds weighs, by kind; with sharding the masters
    /// and optimizer state are this process's slice only (docs/sharding.md). Counting the
    /// optimizer's state copies it once, so call this between steps, not in a hot loop.
    pub fn held_bytes(&self) -> Result<HeldBytes> {
        let mut held = HeldBytes::default();
        for m in self.training.models() {
            let (weights, masters, gradients) = m.held_bytes();
            held.weights += weights;
            held.masters += masters;
            held.gradients += gradients;
        }
        for o in self.training.optimizers() {
            held.optimizer += o
                .state_dict()?
                .tensors
                .iter()
                .map(|(_, t)| bytes(t))
                .sum::<usize>();
        }
        Ok(held)
    }
}

impl Accelerator {
    fn with_active<T>(&self, f: impl FnOnce(&mut Option<Trackers>) -> Result<T>) -> Result<T> {
        f(&mut self.trackers.lock())
    }

    /// Opens `trackers` for a run of `project` with its `config` (any serde value), on the main
    /// process only: the other processes create no files and their `log` calls do nothing.
    ///
    /// Every process must call it (the project name is checked everywhere, so a bad one fails
    /// on every rank). Call [`end_training`](Self::end_training) before opening another run.
    pub fn init_trackers(
        &self,
        project: &str,
        config: &impl Serialize,
        trackers: Vec<Box<dyn Tracker>>,
    ) -> Result<()> {
        let config = serde_json::to_value(config)?;
        self.with_active(|slot| {
            if slot.as_ref().is_some_and(|t| !t.finished) {
                return Err(Error::Usage(
                    "init_trackers was called twice; call end_training before starting a new run"
                        .into(),
                ));
            }
            *slot = Some(Trackers::open(
                project,
                &config,
                trackers,
                self.is_main_process(),
            )?);
            Ok(())
        })
    }

    /// Records `values` (name → number) for training step `step` with every tracker, on the
    /// main process only.
    pub fn log<K: Into<String>>(
        &self,
        values: impl IntoIterator<Item = (K, f64)>,
        step: u64,
    ) -> Result<()> {
        let values: BTreeMap<String, f64> =
            values.into_iter().map(|(k, v)| (k.into(), v)).collect();
        self.with_active(|slot| match slot {
            Some(trackers) => trackers.log(&values, step),
            None => Err(Error::Usage(
                "log needs trackers: call init_trackers(project, config, trackers) first".into(),
            )),
        })?;
        // Kept for `ivme profile`'s curve when profiling.
        self.profile_log(&values, step)
    }

    /// Finishes every tracker (flushing and closing files), then waits for every process so
    /// none exits while the main one is still writing. When profiling, every process first
    /// writes its profile and the main one prints the summary and logs it to the trackers
    /// ([`profile`](crate::profile)).
    pub fn end_training(&self) -> Result<()> {
        let profiled = self.finish_profile();
        let finished = self.with_active(|slot| match slot.take() {
            Some(mut trackers) => trackers.finish(),
            None => Ok(()),
        });
        // Wait even after a failure, so the other ranks are not left at the barrier.
        let waited = self.wait_for_everyone();
        profiled.and(finished).and(waited)
    }
}
