//! Batches built ahead on background threads ([`DataLoader::prefetch`](super::DataLoader::prefetch)):
//! the loader asks for the next few planned batches, worker threads build them with the
//! dataset's `get_batch`, and the loader takes each in plan order when the loop reaches it.
//!
//! Nothing about the order or the position changes: a batch counts as handed out only when it
//! is taken, an error reaches the loop at the batch it belongs to, batches built for a plan
//! that changed since (a new epoch, a restored position) are dropped, and at most `depth`
//! batches are built or waiting at any time. Dropping the loader stops and joins the workers.

use super::Dataset;
use crate::{Error, Result};
use candle_core::Device;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// A batch's place: the plan it belongs to (a counter the loader bumps per plan) and its index.
pub(crate) type Key = (u64, usize);

/// What a loader needs of its prefetcher, whatever the dataset type.
pub(crate) trait FetchAhead<B>: Send {
    /// How many batches may be built ahead.
    fn depth(&self) -> usize;
    /// Starts building the batch of `indices` at `key`, unless it is already asked for.
    fn ask(&mut self, key: Key, indices: &[usize], device: &Device);
    /// Waits for the batch at `key`; `None` when it was never asked for. Anything older is
    /// dropped.
    fn take(&mut self, key: Key) -> Option<Result<B>>;
}

/// One request to a worker.
struct Job {
    key: Key,
    indices: Vec<usize>,
    device: Device,
}

/// Worker threads building batches of one dataset.
pub(crate) struct Workers<B> {
    depth: usize,
    jobs: Option<Sender<Job>>,
    done: Receiver<(Key, Result<B>)>,
    asked: BTreeSet<Key>,
    ready: BTreeMap<Key, Result<B>>,
    threads: Vec<JoinHandle<()>>,
}

impl<B: Send + 'static> Workers<B> {
    /// `threads` workers over `dataset`, building at most `depth` batches ahead.
    pub(crate) fn start<D>(dataset: Arc<D>, depth: usize, threads: usize) -> Workers<B>
    where
        D: Dataset<Batch = B> + Send + Sync + 'static,
    {
        let (jobs, inbox) = channel::<Job>();
        let inbox = Arc::new(Mutex::new(inbox));
        let (results, done) = channel();
        let threads = (0..threads.max(1))
            .map(|i| {
                let (dataset, inbox, results) = (dataset.clone(), inbox.clone(), results.clone());
                std::thread::Builder::new()
                    .name(format!("ivme-data-{i}"))
                    .spawn(move || work(&*dataset, &inbox, &results))
                    .expect("spawning a data worker thread")
            })
            .collect();
        Workers {
            depth: depth.max(1),
            jobs: Some(jobs),
            done,
            asked: BTreeSet::new(),
            ready: BTreeMap::new(),
            threads,
        }
    }
}

/// A worker's loop: build each batch asked for until the loader goes away. A panic in the
/// dataset becomes that batch's error instead of a batch that never comes.
fn work<D: Dataset>(
    dataset: &D,
    inbox: &Mutex<Receiver<Job>>,
    results: &Sender<(Key, Result<D::Batch>)>,
) {
    loop {
        let job = match inbox.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(job) = job else { return };
        let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            dataset.get_batch(&job.indices, &job.device)
        }))
        .unwrap_or_else(|_| {
            Err(Error::Usage(format!(
                "the dataset panicked building the batch of samples {:?} on a data worker \
                 thread",
                job.indices
            )))
        });
        if results.send((job.key, built)).is_err() {
            return;
        }
    }
}

impl<B: Send + 'static> FetchAhead<B> for Workers<B> {
    fn depth(&self) -> usize {
        self.depth
    }

    fn ask(&mut self, key: Key, indices: &[usize], device: &Device) {
        if self.asked.contains(&key) || self.ready.contains_key(&key) {
            return;
        }
        let Some(jobs) = &self.jobs else { return };
        let job = Job {
            key,
            indices: indices.to_vec(),
            device: device.clone(),
        };
        if jobs.send(job).is_ok() {
            self.asked.insert(key);
        }
    }

    fn take(&mut self, key: Key) -> Option<Result<B>> {
        // Batches of an older plan, or before this one, will never be taken.
        self.ready.retain(|k, _| *k >= key && k.0 == key.0);
        self.asked.retain(|k| *k >= key && k.0 == key.0);
        if !self.asked.contains(&key) && !self.ready.contains_key(&key) {
            return None;
        }
        loop {
            if let Some(batch) = self.ready.remove(&key) {
                self.asked.remove(&key);
                return Some(batch);
            }
            match self.done.recv() {
                Ok((k, batch)) if self.asked.contains(&k) => {
                    self.ready.insert(k, batch);
                }
                // Built for a plan that has changed since: dropped.
                Ok(_) => {}
                Err(_) => {
                    self.asked.remove(&key);
                    return Some(Err(Error::Usage(
                        "every data worker thread has stopped; the batch cannot be built".into(),
                    )));
                }
            }
        }
    }
}

impl<B> Drop for Workers<B> {
    fn drop(&mut self) {
        // Closing the queue ends each worker after the batch it is building.
        self.jobs = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
