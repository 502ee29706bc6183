//! Asynchronous checkpoints: the state is copied into host memory on the caller's thread, a
//! background thread writes and fsyncs this rank's files, and the commit happens on the
//! caller's thread at the next *wait point*.
//!
//! Why split it this way: the communicator is not thread-safe and numbers its collectives, so
//! every collective of a save stays on the caller's thread, in the same order on every rank:
//!
//! 1. [`Accelerator::save_state_async`](crate::Accelerator::save_state_async) (caller): finishes the previous background save, then
//!    the ranks agree on the folder exactly as a blocking save does (the main process takes
//!    the lock, recovers crashed saves, names the checkpoint and claims its temporary
//!    folder), every rank copies its state into host buffers ([`HostBuffers`], kept from
//!    save to save) and the ranks agree that the copies succeeded. It returns the folder the
//!    checkpoint will be committed to.
//! 2. Background thread (one per save, no collectives): `write_rank` into the temporary
//!    folder: every file written, checksummed and fsynced, then the rank's index.
//! 3. Wait point (caller, every rank): the next save, [`Accelerator::wait_for_checkpoint`](crate::Accelerator::wait_for_checkpoint),
//!    `load_state` / `load_state_if_any`, or dropping the Accelerator. The thread is joined;
//!    the ranks agree that every rank's write succeeded; the main process commits (manifest
//!    written last, rename, parent fsync, rotation) and the ranks agree on that. A failure on
//!    any rank is an error on every rank, and the temporary folder is removed.
//!
//! Until step 3 the checkpoint is not a checkpoint: a crash (SIGKILL included) before it
//! leaves the previous checkpoints as they were, and the next run removes the unclaimed
//! temporary folder as it removes any crashed save's.

use std::collections::HashMap;
use std::path::PathBuf;
use std::thread::JoinHandle;

use candle_core::{Device, Tensor, Var};

use super::store::{self, ManifestMeta, RankState};
use crate::error::{CheckpointErrorKind, Error, Result};

/// A save whose files a background thread is writing; committed at the next wait point.
#[derive(Debug)]
pub(crate) struct PendingSave {
    pub(crate) target: PathBuf,
    tmp: PathBuf,
    meta: ManifestMeta,
    writer: JoinHandle<Result<()>>,
}

impl PendingSave {
    /// Starts the thread that writes `state` as `rank`'s files into `tmp`.
    pub(crate) fn spawn(
        target: PathBuf,
        tmp: PathBuf,
        meta: ManifestMeta,
        rank: usize,
        state: RankState,
    ) -> Result<Self> {
        let dir = tmp.clone();
        let writer = std::thread::Builder::new()
            .name("ivme-checkpoint".into())
            .spawn(move || {
                test_delay();
                store::write_rank(&dir, rank, &state)
            })
            .map_err(|e| Error::io("starting the checkpoint writer thread", e))?;
        Ok(PendingSave {
            target,
            tmp,
            meta,
            writer,
        })
    }

    /// Waits for the thread; a panic in it is an error like any failed write.
    pub(crate) fn join(self) -> (PathBuf, PathBuf, ManifestMeta, Result<()>) {
        let wrote = self.writer.join().unwrap_or_else(|panic| {
            let msg = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            Err(Error::checkpoint(
                &self.tmp,
                CheckpointErrorKind::Failed,
                format!("the background writer panicked: {msg}"),
            ))
        });
        (self.target, self.tmp, self.meta, wrote)
    }
}

/// Test hook (debug builds only): `IVME_ASYNC_WRITE_DELAY_MS=n` holds every background write
/// back `n` ms, so a test can be sure training changed the live state before it is written.
pub(crate) fn test_delay() {
    #[cfg(debug_assertions)]
    if let Some(ms) = std::env::var("IVME_ASYNC_WRITE_DELAY_MS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// The Accelerator's asynchronous-save state: whether `save_state` is asynchronous, the save
/// being written, and the host buffers snapshots are copied into.
#[derive(Debug, Default)]
pub(crate) struct BackgroundSaves {
    /// `save_state` saves in the background (the builder's `async_checkpoints`).
    pub(crate) by_default: bool,
    /// The save being written, if any.
    pub(crate) pending: Option<PendingSave>,
    /// Where the next snapshot is copied.
    pub(crate) buffers: HostBuffers,
}

impl BackgroundSaves {
    /// No save pending; `save_state` asynchronous when `by_default`.
    pub(crate) fn new(by_default: bool) -> Self {
        BackgroundSaves {
            by_default,
            ..Default::default()
        }
    }
}

/// Host buffers a snapshot is copied into, kept from one snapshot to the next.
///
/// Copying into memory already mapped is about twice as fast as into fresh memory (no page
/// faults, no zeroing by the kernel), and the copies of separate tensors run on all cores.
/// The price is a second copy of the copied state held in host memory while saves happen.
#[derive(Debug, Default)]
pub struct HostBuffers {
    kept: HashMap<(String, String), Var>,
}

/// One tensor to copy: its place in the state, the source, and a buffer that fits, if kept.
pub(crate) struct Job {
    at: (usize, usize),
    key: (String, String),
    src: Tensor,
    buf: Option<Var>,
}

impl HostBuffers {
    /// No buffers yet: the first snapshot allocates them.
    pub fn new() -> Self {
        Self::default()
    }

    /// Copies the tensors of `state` that training could still change into host (CPU)
    /// memory, so training may go on while the copy is written; buffers of the same name,
    /// shape and dtype as last time are reused.
    ///
    /// Copied: every tensor not on the CPU (a GPU tensor comes to the host), every variable
    /// (the models' weights, updated in place by each optimizer step) and every tensor of the
    /// `training` component (partial gradient sums). Other tensors come from `state_dict`,
    /// which returns state later steps do not overwrite (ivme's optimizers return copies),
    /// and are shared, not copied again.
    ///
    /// Do not call it again while a copy it returned is still in use: the next call
    /// overwrites the buffers (the Accelerator calls it only after the previous save's
    /// writer finished).
    ///
    /// ```
    /// use candle_core::{DType, Device, Var};
    /// use ivme::checkpoint::{background::HostBuffers, Component, RankState};
    /// # fn main() -> ivme::Result<()> {
    /// let w = Var::zeros(4, DType::F32, &Device::Cpu)?;
    /// let state = || RankState {
    ///     components: vec![Component {
    ///         name: "model_0".into(),
    ///         tensors: vec![("w".into(), w.as_tensor().clone())],
    ///         json: serde_json::Value::Null,
    ///     }],
    /// };
    /// let mut buffers = HostBuffers::new();
    /// let copy = buffers.copy(state())?;
    /// w.set(&w.as_tensor().ones_like()?)?; // training goes on
    /// assert_eq!(copy.components[0].tensors[0].1.to_vec1::<f32>()?, vec![0.0; 4]);
    /// drop(copy);
    /// let again = buffers.copy(state())?; // into the same buffer
    /// assert_eq!(again.components[0].tensors[0].1.to_vec1::<f32>()?, vec![1.0; 4]);
    /// # Ok(()) }
    /// ```
    pub fn copy(&mut self, mut state: RankState) -> Result<RankState> {
        let mut jobs = Vec::new();
        for (ci, c) in state.components.iter_mut().enumerate() {
            let always = c.name == super::names::TRAINING;
            for (ti, (name, t)) in c.tensors.iter_mut().enumerate() {
                if !t.device().is_cpu() {
                    // `detach` drops the link to the variable, so the copy records no graph.
                    *t = t.detach().to_device(&Device::Cpu)?;
                } else if always || t.is_variable() {
                    let key = (c.name.clone(), name.clone());
                    let buf = self
                        .kept
                        .remove(&key)
                        .filter(|b| b.shape() == t.shape() && b.dtype() == t.dtype());
                    jobs.push(Job {
                        at: (ci, ti),
                        key,
                        src: t.detach(),
                        buf,
                    });
                }
            }
        }
        // Buffers of tensors that are gone are freed; the rest are refilled.
        self.kept.clear();
        for (job, buf) in copy_all(jobs)? {
            let (ci, ti) = job.at;
            state.components[ci].tensors[ti].1 = buf.as_tensor().detach();
            self.kept.insert(job.key, buf);
        }
        Ok(state)
    }
}

/// Runs the copies, spread over the cores by size; returns each job with its filled buffer.
pub(crate) fn copy_all(jobs: Vec<Job>) -> Result<Vec<(Job, Var)>> {
    let one = |job: Job| -> Result<(Job, Var)> {
        let buf = match &job.buf {
            Some(b) => {
                b.set(&job.src)?;
                b.clone()
            }
            None => Var::from_tensor(&job.src)?,
        };
        Ok((job, buf))
    };
    let bytes: usize = jobs
        .iter()
        .map(|j| j.src.elem_count() * j.src.dtype().size_in_bytes())
        .sum();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8)
        .min(jobs.len());
    // Below a few MB a thread costs more than it saves.
    if threads <= 1 || bytes < 8 << 20 {
        return jobs.into_iter().map(one).collect();
    }
    let mut groups: Vec<(usize, Vec<Job>)> = (0..threads).map(|_| (0, Vec::new())).collect();
    let mut jobs = jobs;
    jobs.sort_by_key(|j| std::cmp::Reverse(j.src.elem_count()));
    for job in jobs {
        let g = groups
            .iter_mut()
            .min_by_key(|(size, _)| *size)
            .expect("at least one group");
        g.0 += job.src.elem_count();
        g.1.push(job);
    }
    std::thread::scope(|scope| {
        let running: Vec<_> = groups
            .into_iter()
            .map(|(_, group)| scope.spawn(move || group.into_iter().map(one).collect::<Vec<_>>()))
            .collect();
        let mut done = Vec::new();
        for r in running {
            let group = r.join().map_err(|_| {
                Error::checkpoint(
                    PathBuf::new(),
                    CheckpointErrorKind::Failed,
                    "a thread copying the state panicked",
                )
            })?;
            for item in group {
                done.push(item?);
            }
        }
        Ok(done)
    })
}

/// Copies the tensors of `state` that training could still change into fresh host memory:
/// [`HostBuffers::copy`] with no buffers kept.
pub fn copy_to_host(state: RankState) -> Result<RankState> {
    HostBuffers::new().copy(state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Component;
    use crate::Accelerator;
    use candle_core::DType;

    fn state(tensors: &[(&str, &Var)]) -> RankState {
        RankState {
            components: vec![Component {
                name: "model_0".into(),
                tensors: tensors
                    .iter()
                    .map(|(n, v)| (n.to_string(), v.as_tensor().clone()))
                    .collect(),
                json: serde_json::Value::Null,
            }],
        }
    }

    fn values(s: &RankState, i: usize) -> Vec<f32> {
        s.components[0].tensors[i].1.to_vec1::<f32>().unwrap()
    }

    #[test]
    fn copies_survive_training_and_buffers_follow_shape_changes() {
        // Three 4 MB tensors: above the threshold, so the copies run on several threads.
        let n = 1 << 20;
        let vars: Vec<Var> = (0..3)
            .map(|i| Var::from_vec(vec![i as f32; n], n, &Device::Cpu).unwrap())
            .collect();
        let named: Vec<(&str, &Var)> = ["a", "b", "c"].into_iter().zip(&vars).collect();
        let mut buffers = HostBuffers::new();
        let copy = buffers.copy(state(&named)).unwrap();
        for v in &vars {
            v.set(&v.as_tensor().affine(1.0, 10.0).unwrap()).unwrap();
        }
        for i in 0..3 {
            assert!(values(&copy, i).iter().all(|&x| x == i as f32));
        }
        drop(copy);
        // `b` changes shape: its buffer is replaced, the others are refilled in place.
        let b = Var::zeros(7, DType::F32, &Device::Cpu).unwrap();
        let again = buffers
            .copy(state(&[("a", &vars[0]), ("b", &b), ("c", &vars[2])]))
            .unwrap();
        assert!(values(&again, 0).iter().all(|&x| x == 10.0));
        assert_eq!(values(&again, 1), vec![0.0; 7]);
        assert!(values(&again, 2).iter().all(|&x| x == 12.0));
        assert_eq!(buffers.kept.len(), 3);
    }

    #[test]
    fn tensors_that_are_not_live_state_are_shared_not_copied() {
        let t = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        let s = RankState {
            components: vec![Component {
                name: "optimizer_0".into(),
                tensors: vec![("m".into(), t.clone())],
                json: serde_json::Value::Null,
            }],
        };
        let copy = copy_to_host(s).unwrap();
        assert_eq!(copy.components[0].tensors[0].1.id(), t.id());
    }

    #[test]
    fn an_async_save_commits_at_the_wait_and_holds_the_state_it_was_taken_at() {
        let dir = std::env::temp_dir().join(format!("ivme-async-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut acc = Accelerator::builder().cpu(true).build().unwrap();
        let varmap = candle_nn::VarMap::new();
        varmap
            .get(
                3,
                "w",
                candle_nn::Init::Const(1.0),
                DType::F32,
                &Device::Cpu,
            )
            .unwrap();
        let varmap = acc.prepare(varmap).unwrap();
        let w = varmap.data().lock().unwrap()["w"].clone();
        let target = acc.save_state_async(Some(&dir.join("ck"))).unwrap();
        assert_eq!(acc.pending_checkpoint(), Some(target.as_path()));
        w.set(&w.ones_like().unwrap().affine(5.0, 0.0).unwrap())
            .unwrap();
        assert_eq!(acc.wait_for_checkpoint().unwrap(), Some(target.clone()));
        assert_eq!(acc.wait_for_checkpoint().unwrap(), None);
        crate::checkpoint::verify(&target).unwrap();
        acc.load_state(Some(&target)).unwrap();
        let got = varmap.data().lock().unwrap()["w"].to_vec1::<f32>().unwrap();
        assert_eq!(got, vec![1.0; 3]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
