//! Tests of the data loader.

use std::sync::Mutex;

use candle_core::Tensor;

use super::*;
use crate::data::TensorDataset;

#[derive(Default)]
struct Recorder(Mutex<Vec<(usize, usize)>>);

impl StepObserver for Recorder {
    fn on_batch(&self, index: usize, batches_in_epoch: usize, _padding: usize) {
        if let Ok(mut seen) = self.0.lock() {
            seen.push((index, batches_in_epoch));
        }
    }
}

fn loader(n: u32, batch: usize) -> Result<DataLoader<TensorDataset<Tensor>>> {
    let data = TensorDataset::new(Tensor::arange(0u32, n, &Device::Cpu)?)?;
    Ok(DataLoader::new(data, batch))
}

#[test]
fn attach_shards_once_and_reports_every_batch() -> Result<()> {
    let mut l = loader(10, 2)?;
    assert!(!l.is_prepared());
    let recorder = Arc::new(Recorder::default());
    l.attach(1, 2, Device::Cpu, Some(recorder.clone()))?;
    assert!(l.is_prepared());
    // 10 samples, global batch 4: rank 1 takes [2, 3] and [6, 7]; the tail [8, 9]
    // splits one per rank, so rank 1 ends with [9].
    let got: Vec<Vec<u32>> = l
        .iter()
        .map(|b| Ok(b?.to_vec1::<u32>()?))
        .collect::<Result<_>>()?;
    assert_eq!(got, vec![vec![2, 3], vec![6, 7], vec![9]]);
    let seen = recorder.0.lock().map(|s| s.clone()).unwrap_or_default();
    assert_eq!(seen, vec![(0, 3), (1, 3), (2, 3)]);

    let again = l.attach(0, 1, Device::Cpu, None).unwrap_err().to_string();
    assert!(again.contains("already prepared"), "{again}");
    assert!(l.shard(0, 2).is_err());
    Ok(())
}

#[test]
fn attach_rejects_a_rank_outside_the_world() -> Result<()> {
    let mut l = loader(4, 2)?;
    assert!(l.attach(3, 2, Device::Cpu, None).is_err());
    assert!(!l.is_prepared());
    Ok(())
}

#[test]
fn the_plan_is_built_once_per_epoch() -> Result<()> {
    let mut l = loader(9, 2)?.shuffle(true);
    let mut it = l.iter();
    it.next();
    drop(it);
    let cached = l.plan.clone();
    assert!(cached.is_some());
    l.iter().next();
    assert_eq!(l.plan, cached, "same epoch, same cached plan");
    l.set_epoch(1);
    assert!(l.plan.is_none());
    Ok(())
}

/// Samples 0..n as u32 scalars; sample `fail` fails, sample `panic` panics; every build notes
/// its thread and how many batches were built but not yet handed out.
struct Probe {
    n: usize,
    fail: Option<usize>,
    panic: Option<usize>,
    threads: Mutex<Vec<std::thread::ThreadId>>,
    built: Arc<std::sync::atomic::AtomicUsize>,
    /// How long a worker thread takes over each batch.
    worker_delay: std::time::Duration,
}

impl Probe {
    fn new(n: usize) -> Probe {
        Probe {
            n,
            fail: None,
            panic: None,
            threads: Mutex::new(Vec::new()),
            built: Default::default(),
            worker_delay: std::time::Duration::ZERO,
        }
    }
}

impl crate::data::Dataset for Probe {
    type Item = u32;
    type Batch = Vec<u32>;
    fn len(&self) -> usize {
        self.n
    }
    fn get(&self, index: usize) -> Result<u32> {
        if self.fail == Some(index) {
            return Err(Error::Usage(format!("sample {index} is unreadable")));
        }
        assert!(self.panic != Some(index), "sample {index} panics");
        Ok(index as u32)
    }
    fn collate(&self, items: Vec<u32>, _device: &Device) -> Result<Vec<u32>> {
        let on_worker = std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("ivme-data"));
        if on_worker {
            std::thread::sleep(self.worker_delay);
        }
        if let Ok(mut t) = self.threads.lock() {
            t.push(std::thread::current().id());
        }
        self.built.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(items)
    }
}

fn batches<D: crate::data::Dataset<Batch = Vec<u32>>>(
    l: &mut DataLoader<D>,
) -> Vec<std::result::Result<Vec<u32>, String>> {
    l.iter().map(|b| b.map_err(|e| e.to_string())).collect()
}

#[test]
fn prefetched_batches_are_the_same_in_the_same_order_and_resume_alike() -> Result<()> {
    let plain = || DataLoader::new(Probe::new(23), 3).shuffle(true).seed(5);
    let (mut a, mut b) = (plain(), plain().prefetch(3).workers(2));
    for _epoch in 0..2 {
        assert_eq!(batches(&mut b), batches(&mut a));
    }
    // A position restored mid-epoch (a resume) drops what was built ahead.
    let mut it = a.iter();
    it.next();
    it.next();
    drop(it);
    let at = a.position();
    let mut b_it = b.iter();
    b_it.next();
    drop(b_it);
    b.set_position(at)?;
    assert_eq!(batches(&mut b), batches(&mut a));
    Ok(())
}

#[test]
fn the_loop_builds_the_batches_no_worker_has_started_instead_of_waiting() -> Result<()> {
    let plain = batches(&mut DataLoader::new(Probe::new(16), 2));
    let mut probe = Probe::new(16);
    probe.worker_delay = std::time::Duration::from_millis(200);
    let mut l = DataLoader::new(probe, 2).prefetch(3).workers(1);
    let started = std::time::Instant::now();
    assert_eq!(batches(&mut l), plain);
    let main = std::thread::current().id();
    let threads = l.dataset().threads.lock().map(|t| t.clone()).unwrap();
    let by_loop = threads.iter().filter(|t| **t == main).count();
    // The one worker takes 200 ms a batch: waiting for it would take 1.6 s for the 8 batches.
    assert!(
        by_loop >= 4,
        "the loop built {by_loop} of 8 batches in {:?}",
        started.elapsed()
    );
    Ok(())
}

#[test]
fn prefetch_keeps_at_most_its_depth_waiting() -> Result<()> {
    let probe = Probe::new(40);
    let built = probe.built.clone();
    let mut l = DataLoader::new(probe, 2).prefetch(2);
    let mut taken = 0;
    for b in l.iter() {
        b?;
        taken += 1;
        // Time for the worker to run as far ahead as it may.
        std::thread::sleep(std::time::Duration::from_millis(5));
        let now = built.load(std::sync::atomic::Ordering::SeqCst);
        assert!(
            now <= taken + 2,
            "{now} built with {taken} taken and depth 2"
        );
    }
    assert_eq!(taken, 20);
    assert_eq!(
        built.load(std::sync::atomic::Ordering::SeqCst),
        20,
        "every batch built once"
    );
    // While the loop slept the worker built ahead (the loop builds only what no worker has
    // started when it needs it).
    let main = std::thread::current().id();
    let threads = l.dataset().threads.lock().map(|t| t.clone()).unwrap();
    assert!(
        threads.iter().filter(|t| **t != main).count() >= 10,
        "{threads:?}"
    );
    Ok(())
}

#[test]
fn an_error_or_a_panic_arrives_at_its_own_batch_and_the_rest_follow() -> Result<()> {
    let mut probe = Probe::new(12);
    probe.fail = Some(4);
    probe.panic = Some(9);
    let mut l = DataLoader::new(probe, 2).prefetch(3).workers(2);
    let got = batches(&mut l);
    assert_eq!(got.len(), 6);
    assert_eq!(got[0], Ok(vec![0, 1]));
    assert!(
        got[2]
            .as_ref()
            .unwrap_err()
            .contains("sample 4 is unreadable"),
        "{got:?}"
    );
    assert_eq!(got[3], Ok(vec![6, 7]));
    assert!(got[4].as_ref().unwrap_err().contains("panicked"), "{got:?}");
    assert_eq!(got[5], Ok(vec![10, 11]));
    Ok(())
}
