//! Batches built ahead on background threads ([`DataLoader::prefetch`](super::DataLoader::prefetch)):
//! the loader asks for the next few planned batches, worker threads build them with the
//! dataset's `get_batch`, and the loader takes each in plan order when the loop reaches it.
//!
//! The loop does not sit idle while it waits: it builds itself the batches no worker has
//! started yet (the one it needs first), so prefetching a dataset whose batches cost less than
//! a hand-off to a thread (a token file read in order) is not slower than no prefetching.
//!
//! Nothing about the order or the position changes: a batch counts as handed out only when it
//! is taken, an error reaches the loop at the batch it belongs to, batches built for a plan
//! that changed since (a new epoch, a restored position) are dropped, and at most `depth`
//! batches are built or waiting at any time. Dropping the loader stops and joins the workers.

use super::Dataset;
use crate::{Error, Result};
use candle_core::Device;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// Builds the batch of some sample indices on a device (the dataset's `get_batch`).
type Build<B> = Arc<dyn Fn(&[usize], &Device) -> Result<B> + Send + Sync>;

/// One batch asked for: which samples, where, and whether someone (a worker or the loop) has
/// started building it.
#[derive(Clone)]
struct Job {
    key: Key,
    indices: Vec<usize>,
    device: Device,
    claimed: Arc<AtomicBool>,
}

impl Job {
    /// Claims the job: true for the one caller that gets to build it.
    fn claim(&self) -> bool {
        !self.claimed.swap(true, Ordering::AcqRel)
    }
}

/// Worker threads building batches of one dataset.
pub(crate) struct Workers<B> {
    depth: usize,
    build: Build<B>,
    jobs: Option<Sender<Job>>,
    done: Receiver<(Key, Result<B>)>,
    asked: BTreeMap<Key, Job>,
    ready: BTreeMap<Key, Result<B>>,
    threads: Vec<JoinHandle<()>>,
}

impl<B: Send + 'static> Workers<B> {
    /// `threads` workers over `dataset`, building at most `depth` batches ahead.
    pub(crate) fn start<D>(dataset: Arc<D>, depth: usize, threads: usize) -> Workers<B>
    where
        D: Dataset<Batch = B> + Send + Sync + 'static,
    {
        let build: Build<B> = Arc::new(move |indices, device| dataset.get_batch(indices, device));
        let (jobs, inbox) = channel::<Job>();
        let inbox = Arc::new(Mutex::new(inbox));
        let (results, done) = channel();
        let threads = (0..threads.max(1))
            .map(|i| {
                let (build, inbox, results) = (build.clone(), inbox.clone(), results.clone());
                std::thread::Builder::new()
                    .name(format!("ivme-data-{i}"))
                    .spawn(move || work(&build, &inbox, &results))
                    .expect("spawning a data worker thread")
            })
            .collect();
        Workers {
            depth: depth.max(1),
            build,
            jobs: Some(jobs),
            done,
            asked: BTreeMap::new(),
            ready: BTreeMap::new(),
            threads,
        }
    }
}

/// Builds `job`'s batch; a panic in the dataset becomes the batch's error instead of a batch
/// that never comes.
fn build_caught<B>(build: &Build<B>, job: &Job) -> Result<B> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        build(&job.indices, &job.device)
    }))
    .unwrap_or_else(|_| {
        Err(Error::Usage(format!(
            "the dataset panicked building the batch of samples {:?} ahead of the loop \
             (prefetch)",
            job.indices
        )))
    })
}

/// A worker's loop: build each batch asked for that nobody has started, until the loader goes
/// away.
fn work<B>(build: &Build<B>, inbox: &Mutex<Receiver<Job>>, results: &Sender<(Key, Result<B>)>) {
    loop {
        let job = match inbox.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(job) = job else { return };
        if !job.claim() {
            continue; // the loop built it itself
        }
        if results.send((job.key, build_caught(build, &job))).is_err() {
            return;
        }
    }
}

impl<B: Send + 'static> FetchAhead<B> for Workers<B> {
    fn depth(&self) -> usize {
        self.depth
    }

    fn ask(&mut self, key: Key, indices: &[usize], device: &Device) {
        if self.asked.contains_key(&key) || self.ready.contains_key(&key) {
            return;
        }
        let Some(jobs) = &self.jobs else { return };
        let job = Job {
            key,
            indices: indices.to_vec(),
            device: device.clone(),
            claimed: Arc::new(AtomicBool::new(false)),
        };
        if jobs.send(job.clone()).is_ok() {
            self.asked.insert(key, job);
        }
    }

    fn take(&mut self, key: Key) -> Option<Result<B>> {
        // Batches of an older plan, or before this one, will never be taken.
        self.ready.retain(|k, _| *k >= key && k.0 == key.0);
        self.asked.retain(|k, _| *k >= key && k.0 == key.0);
        if !self.asked.contains_key(&key) && !self.ready.contains_key(&key) {
            return None;
        }
        loop {
            while let Ok((k, batch)) = self.done.try_recv() {
                self.keep(k, batch);
            }
            if let Some(batch) = self.ready.remove(&key) {
                self.asked.remove(&key);
                return Some(batch);
            }
            // Rather than wait, the loop builds what no worker has started: this batch
            // first, then (while a worker builds this one) the next ones. Prefetching then
            // never leaves the loop idle while there is work it could do itself.
            if let Some(job) = self.unstarted(key) {
                let built = build_caught(&self.build, &job);
                if job.key == key {
                    self.asked.remove(&key);
                    return Some(built);
                }
                self.ready.insert(job.key, built);
                continue;
            }
            match self.done.recv() {
                Ok((k, batch)) => self.keep(k, batch),
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

impl<B> Workers<B> {
    /// Keeps a built batch until it is taken, unless it was built for a plan that has changed
    /// since.
    fn keep(&mut self, key: Key, batch: Result<B>) {
        if self.asked.contains_key(&key) {
            self.ready.insert(key, batch);
        }
    }

    /// The first batch from `key` on that was asked for, is not built and that no worker has
    /// started, claimed for the loop to build.
    fn unstarted(&self, key: Key) -> Option<Job> {
        self.asked
            .range(key..)
            .filter(|(k, _)| k.0 == key.0 && !self.ready.contains_key(k))
            .map(|(_, job)| job)
            .find(|job| job.claim())
            .cloned()
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
