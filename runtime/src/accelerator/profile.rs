//! The run's profile (observe/profile): the recorder the Accelerator's clock and communicator
//! write spans into, each rank's files, the summary at `end_training`, and the values logged,
//! kept for `ivme profile`'s loss curve.

use crate::accelerator::Accelerator;
use crate::error::{Error, Result};
use crate::observe::profile::trace::Trace;
use crate::observe::profile::{write_atomic, RankRecord, RankSteps, Summary};
use crate::setup::env;
use crate::setup::state::ProcessState;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// What the builder resolved for a profile.
#[derive(Debug, Clone)]
pub(crate) struct ProfileSettings {
    pub(crate) dir: PathBuf,
    pub(crate) flops_per_sample: Option<f64>,
    pub(crate) peak_flops: Option<f64>,
}

impl ProfileSettings {
    /// The builder's folder and FLOP figures, else the environment's; `None` without a folder.
    pub(crate) fn resolve(
        dir: Option<PathBuf>,
        flops_per_sample: Option<f64>,
        peak_flops: Option<f64>,
    ) -> Result<Option<Self>> {
        let Some(dir) = dir.or_else(|| env::PROFILE.get().map(PathBuf::from)) else {
            return Ok(None);
        };
        Ok(Some(ProfileSettings {
            dir,
            flops_per_sample: positive(
                flops_per_sample,
                &env::FLOPS_PER_SAMPLE,
                ivme_settings::FLOPS_PER_SAMPLE.name,
            )?,
            peak_flops: positive(peak_flops, &env::PEAK_FLOPS, ivme_settings::PEAK_FLOPS.name)?,
        }))
    }
}

/// A FLOP figure from the builder (`key`) or else `var`: positive and finite, or refused.
fn positive(builder: Option<f64>, var: &env::Var, key: &str) -> Result<Option<f64>> {
    let (value, name, shown) = match (builder, var.get()) {
        (Some(v), _) => (v, key, v.to_string()),
        (None, Some(raw)) => (raw.parse::<f64>().unwrap_or(f64::NAN), var.name, raw),
        (None, None) => return Ok(None),
    };
    if value > 0.0 && value.is_finite() {
        Ok(Some(value))
    } else {
        Err(Error::config(
            name,
            shown,
            "use a positive, finite number such as 6e9",
        ))
    }
}

/// A profile being recorded.
#[derive(Debug)]
pub(crate) struct Profiling {
    settings: ProfileSettings,
    trace: Arc<Trace>,
    rank: usize,
    world_size: usize,
    host: String,
    /// Whether this rank's files were written (by `end_training`; otherwise at drop).
    written: AtomicBool,
    /// `metrics.jsonl` of the main process: every value `log` got, for the loss curve.
    metrics: Mutex<Option<std::fs::File>>,
}

impl Profiling {
    /// Starts recording now.
    pub(crate) fn start(settings: ProfileSettings, state: &ProcessState) -> Self {
        Profiling {
            settings,
            trace: Arc::new(Trace::new()),
            rank: state.rank,
            world_size: state.world_size,
            host: crate::setup::state::host_name(),
            written: AtomicBool::new(false),
            metrics: Mutex::new(None),
        }
    }

    /// The recorder.
    pub(crate) fn trace(&self) -> &Arc<Trace> {
        &self.trace
    }

    fn record(&self, samples: u64) -> RankRecord {
        let (spans, dropped) = self.trace.spans();
        RankRecord {
            rank: self.rank,
            world_size: self.world_size,
            host: self.host.clone(),
            origin_unix_ns: self.trace.origin_unix_ns(),
            samples,
            flops_per_sample: self.settings.flops_per_sample,
            peak_flops: self.settings.peak_flops,
            dropped,
            spans,
        }
    }
}

impl Accelerator {
    /// The folder this run's profile goes to, when profiling
    /// ([`AcceleratorBuilder::profile`](crate::AcceleratorBuilder::profile)).
    pub fn profile_dir(&self) -> Option<&std::path::Path> {
        self.profiling.as_ref().map(|p| p.settings.dir.as_path())
    }

    /// This process's profile so far, when profiling.
    pub fn profile_record(&self) -> Option<RankRecord> {
        let samples = self.training.window().samples().load(Ordering::Relaxed);
        self.profiling.as_ref().map(|p| p.record(samples))
    }

    /// Every process's profile so far, summarised (`None` when not profiling); every rank
    /// must call it. The summary's [`table`](Summary::table) is what `end_training` prints.
    pub fn profile_summary(&self) -> Result<Option<Summary>> {
        let Some(record) = self.profile_record() else {
            return Ok(None);
        };
        let all: Vec<RankSteps> = self.gather_object(&record.rank_steps())?;
        Ok(Some(Summary::of(&all)))
    }

    /// Writes this rank's record and trace into the profile folder.
    fn write_profile_files(&self) -> Result<()> {
        let (Some(p), Some(record)) = (&self.profiling, self.profile_record()) else {
            return Ok(());
        };
        record.write(&p.settings.dir)?;
        p.written.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// At `end_training`: every rank writes its files, the main process prints the summary,
    /// writes it beside them and hands it to the trackers (still open).
    pub(crate) fn finish_profile(&self) -> Result<()> {
        let Some(p) = &self.profiling else {
            return Ok(());
        };
        let written = self.write_profile_files();
        // Every rank takes part in the gather, even after a failed write.
        let summary = self.profile_summary()?;
        written?;
        let Some(summary) = summary else {
            return Ok(());
        };
        if !self.is_main_process() {
            return Ok(());
        }
        let table = summary.table();
        self.print(format!(
            "{}(ivme profile {} draws it; the Chrome traces are rank-R.trace.json there)",
            table,
            p.settings.dir.display()
        ));
        write_atomic(&p.settings.dir.join("summary.txt"), table.as_bytes())?;
        write_atomic(
            &p.settings.dir.join("summary.json"),
            &serde_json::to_vec_pretty(&summary)?,
        )?;
        let steps = summary.ranks.first().map_or(0, |r| r.steps as u64);
        let values = summary.values();
        let mut slot = self.trackers.lock();
        match slot.as_mut() {
            Some(trackers) if !trackers.finished => trackers.log(&values, steps),
            _ => Ok(()),
        }
    }

    /// Keeps what `log` got in the profile folder's `metrics.jsonl` (main process), for the
    /// loss curve of `ivme profile`.
    pub(crate) fn profile_log(&self, values: &BTreeMap<String, f64>, step: u64) -> Result<()> {
        let Some(p) = self.profiling.as_ref().filter(|_| self.is_main_process()) else {
            return Ok(());
        };
        let mut file = p.metrics.lock().unwrap_or_else(|e| e.into_inner());
        if file.is_none() {
            std::fs::create_dir_all(&p.settings.dir)
                .map_err(|e| Error::io(format!("creating {}", p.settings.dir.display()), e))?;
            let path = p.settings.dir.join("metrics.jsonl");
            *file = Some(
                std::fs::File::create(&path)
                    .map_err(|e| Error::io(format!("creating {}", path.display()), e))?,
            );
        }
        let mut line = serde_json::to_vec(&serde_json::json!({ "step": step, "values": values }))?;
        line.push(b'\n');
        if let Some(f) = file.as_mut() {
            f.write_all(&line)
                .map_err(|e| Error::io("writing the profile's metrics.jsonl", e))?;
        }
        Ok(())
    }

    /// At drop: the files `end_training` did not write (no collective here).
    pub(crate) fn write_profile_at_drop(&self) {
        if self
            .profiling
            .as_ref()
            .is_some_and(|p| !p.written.load(Ordering::Relaxed))
        {
            if let Err(e) = self.write_profile_files() {
                warn_user!(
                    "rank {}: the profile was not written: {e}",
                    self.process_index()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::accelerator::slow_data::Slow;
    use crate::data::DataLoader;
    use crate::observe::profile::{read_dir, SpanKind};
    use crate::optim::{ParamsSgd, Sgd};
    use crate::tracking::{JsonlTracker, Tracker};
    use crate::Accelerator;
    use candle_core::{DType, Device};
    use candle_nn::{Optimizer, VarMap};

    fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            if e.path().is_dir() {
                out.extend(files_under(&e.path()));
            } else {
                out.push(e.path());
            }
        }
        out
    }

    #[test]
    fn a_flop_figure_that_is_not_positive_is_refused_by_name() {
        let err = Accelerator::builder()
            .cpu(true)
            .profile(std::env::temp_dir().join("ivme-profile-refused"))
            .flops_per_sample(-2.0)
            .build()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("flops_per_sample") && err.contains("-2"),
            "{err}"
        );
        // Without a profile there is nothing to refuse: the figure is unused.
        assert!(Accelerator::builder()
            .cpu(true)
            .flops_per_sample(-2.0)
            .build()
            .is_ok());
    }

    #[test]
    fn end_training_writes_the_profile_and_hands_its_summary_to_the_trackers() -> crate::Result<()>
    {
        let dir = std::env::temp_dir().join(format!("ivme-profile-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let profile = dir.join("profile");
        let mut acc = Accelerator::builder()
            .cpu(true)
            .grad_accum(2)
            .profile(&profile)
            .flops_per_sample(1000.0)
            .build()?;
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
            acc.prepare((varmap, opt, DataLoader::new(Slow { len: 12, ms: 5 }, 2)))?;
        let trackers: Vec<Box<dyn Tracker>> = vec![Box::new(JsonlTracker::new(dir.join("runs")))];
        acc.init_trackers("p", &serde_json::json!({}), trackers)?;
        let mut step = 0;
        for batch in loader.iter() {
            let loss = batch?.broadcast_mul(&w)?.sum_all()?;
            let value = loss.to_scalar::<f32>()? as f64;
            let grads = acc.backward(&loss)?;
            opt.step(&grads)?;
            if grads.is_sync_step() {
                acc.log([("loss", value)], step)?;
                step += 1;
            }
        }
        acc.end_training()?;
        // 6 batches of 2 in windows of 2: 3 optimizer steps, each with two 5 ms waits.
        let records = read_dir(&profile)?;
        assert_eq!(records.len(), 1);
        let steps = records[0].steps();
        assert_eq!(steps.len(), 3, "{steps:?}");
        for s in &steps {
            assert!(s.data_ns >= 10_000_000, "{s:?}");
            assert!(
                s.backward_ns > 0 && s.sync_ns > 0 && s.optimizer_ns > 0,
                "{s:?}"
            );
        }
        assert_eq!(records[0].samples, 12);
        let kinds: std::collections::BTreeSet<_> =
            records[0].spans.iter().map(|s| s.kind).collect();
        assert!(kinds.contains(&SpanKind::Data) && kinds.contains(&SpanKind::Optimizer));
        let trace: serde_json::Value =
            serde_json::from_slice(&std::fs::read(profile.join("rank-0.trace.json")).unwrap())?;
        assert!(trace["traceEvents"].as_array().unwrap().len() > 3 * 5);
        let summary = std::fs::read_to_string(profile.join("summary.txt")).unwrap();
        assert!(summary.contains("3 optimizer steps"), "{summary}");
        assert!(summary.contains("TFLOP/s"), "{summary}");
        let metrics = std::fs::read_to_string(profile.join("metrics.jsonl")).unwrap();
        assert_eq!(metrics.lines().count(), 3, "{metrics}");
        // The summary reached the tracker as values of the last step.
        let logged: String = files_under(&dir.join("runs"))
            .iter()
            .map(|p| std::fs::read_to_string(p).unwrap_or_default())
            .collect();
        assert!(logged.contains("profile/steps_per_s"), "{logged}");
        assert!(logged.contains("profile/ms/data"), "{logged}");
        drop(acc);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
}
