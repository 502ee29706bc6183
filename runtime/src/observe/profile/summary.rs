//! A profile's summary: every rank's milliseconds per step, phase by phase, how long each
//! waited for a slower rank, which rank the others wait for, and the run's rates.

use super::{RankRecord, StepRow};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One rank's steps without their spans: what a summary is made from (and what
/// `end_training` gathers).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankSteps {
    /// The process's global rank.
    pub rank: usize,
    /// The machine it ran on.
    pub host: String,
    /// Samples its prepared loaders handed out.
    pub samples: u64,
    /// The model's FLOPs per sample, when given.
    pub flops_per_sample: Option<f64>,
    /// The device's peak FLOP/s, when given.
    pub peak_flops: Option<f64>,
    /// Spans the record had no room for.
    pub dropped: u64,
    /// Its complete optimizer steps.
    pub steps: Vec<StepRow>,
}

impl RankRecord {
    /// This record's steps, for a [`Summary`].
    pub fn rank_steps(&self) -> RankSteps {
        RankSteps {
            rank: self.rank,
            host: self.host.clone(),
            samples: self.samples,
            flops_per_sample: self.flops_per_sample,
            peak_flops: self.peak_flops,
            dropped: self.dropped,
            steps: self.steps(),
        }
    }
}

/// One rank's seconds over its profiled steps.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RankSummary {
    /// The rank.
    pub rank: usize,
    /// Its machine.
    pub host: String,
    /// Complete optimizer steps.
    pub steps: usize,
    /// Their wall time.
    pub wall: f64,
    /// Waiting for batches.
    pub data: f64,
    /// The forward pass and the loop's own code (what no span covers).
    pub forward_and_rest: f64,
    /// candle's backward (the recomputes left out).
    pub backward: f64,
    /// Checkpointed segments run again during backward (activation checkpointing).
    #[serde(default)]
    pub recompute: f64,
    /// Ending windows outside the collectives: copies into buckets, unscaling, clipping.
    pub sync_local: f64,
    /// The windows' collectives.
    pub collective: f64,
    /// The part of the collectives spent waiting for a slower rank: each step's collective
    /// time less the shortest any rank took for it.
    pub waiting: f64,
    /// The prepared optimizers.
    pub optimizer: f64,
    /// Checkpoint stalls.
    pub checkpoint: f64,
    /// Samples handed out.
    pub samples: u64,
}

impl RankSummary {
    /// The phases as (name, seconds), in the order the table lists them.
    pub fn phases(&self) -> [(&'static str, f64); 8] {
        [
            ("data", self.data),
            ("forward and the rest", self.forward_and_rest),
            ("backward", self.backward),
            ("recompute", self.recompute),
            ("sync: copies, clipping", self.sync_local),
            ("sync: collectives", self.collective),
            ("optimizer", self.optimizer),
            ("checkpoint stall", self.checkpoint),
        ]
    }
}

/// The summary of a profile.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Every rank's seconds, in rank order.
    pub ranks: Vec<RankSummary>,
    /// The rank the others wait for: the one that waits least at the collectives, when more
    /// than one rank ran and the ranks' waits differ by at least 2 % of a step (below that the
    /// ranks are balanced and naming one would be noise).
    pub straggler: Option<usize>,
    /// Optimizer steps per second (the slowest rank's).
    pub steps_per_s: f64,
    /// Samples per second, every rank's together (`None` when no prepared data loader
    /// counted any: batches from a `Vec` or a loader of the program's own are not counted).
    pub samples_per_s: Option<f64>,
    /// Model FLOP/s, every rank's together, when FLOPs per sample were given.
    pub flops_per_s: Option<f64>,
    /// Model FLOP utilisation (achieved over the peak of every rank's device), when the peak
    /// was given too.
    pub mfu: Option<f64>,
    /// Spans not recorded because a record was full, over every rank.
    pub dropped: u64,
}

impl Summary {
    /// Summarises the ranks' steps. Steps are matched across ranks by their number: the k-th
    /// step of every rank ran the same collectives.
    pub fn of(ranks: &[RankSteps]) -> Summary {
        let common = ranks.iter().map(|r| r.steps.len()).min().unwrap_or(0);
        // The shortest collective time of each step, over the ranks.
        let fastest: Vec<u64> = (0..common)
            .map(|k| {
                ranks
                    .iter()
                    .map(|r| r.steps[k].collective_ns)
                    .min()
                    .unwrap_or(0)
            })
            .collect();
        let secs = |ns: u64| ns as f64 * 1e-9;
        let summaries: Vec<RankSummary> = ranks
            .iter()
            .map(|r| {
                let sum = |f: fn(&StepRow) -> u64| secs(r.steps.iter().map(f).sum::<u64>());
                let waiting = (0..common)
                    .map(|k| r.steps[k].collective_ns - fastest[k])
                    .sum::<u64>();
                RankSummary {
                    rank: r.rank,
                    host: r.host.clone(),
                    steps: r.steps.len(),
                    wall: sum(|s| s.wall_ns),
                    data: sum(|s| s.data_ns),
                    forward_and_rest: sum(StepRow::rest_ns),
                    backward: sum(|s| s.backward_ns.saturating_sub(s.recompute_ns)),
                    recompute: sum(|s| s.recompute_ns),
                    sync_local: sum(|s| s.sync_ns.saturating_sub(s.collective_ns)),
                    collective: sum(|s| s.collective_ns),
                    waiting: secs(waiting),
                    optimizer: sum(|s| s.optimizer_ns),
                    checkpoint: sum(|s| s.checkpoint_ns),
                    samples: r.samples,
                }
            })
            .collect();
        let straggler = straggler_of(&summaries);
        let slowest = summaries
            .iter()
            .map(|s| s.wall / s.steps.max(1) as f64)
            .fold(0.0, f64::max);
        let steps_per_s = if slowest > 0.0 { 1.0 / slowest } else { 0.0 };
        let samples_per_s = summaries.iter().any(|s| s.samples > 0).then(|| {
            summaries
                .iter()
                .filter(|s| s.wall > 0.0)
                .map(|s| s.samples as f64 / s.wall)
                .sum::<f64>()
        });
        let flops_per_sample = ranks.iter().find_map(|r| r.flops_per_sample);
        let flops_per_s = flops_per_sample.zip(samples_per_s).map(|(f, s)| f * s);
        let peak: Option<f64> = ranks.iter().map(|r| r.peak_flops).sum();
        let mfu = flops_per_s.zip(peak).map(|(f, p)| f / p);
        Summary {
            ranks: summaries,
            straggler,
            steps_per_s,
            samples_per_s,
            flops_per_s,
            mfu,
            dropped: ranks.iter().map(|r| r.dropped).sum(),
        }
    }

    /// The summary as a table of milliseconds per step, with the rates below it.
    pub fn table(&self) -> String {
        let per_step = |s: &RankSummary, secs: f64| 1e3 * secs / s.steps.max(1) as f64;
        let steps = self.ranks.first().map_or(0, |r| r.steps);
        let mut out = format!(
            "profile: {} rank(s), {steps} optimizer steps; ms per step\n{:<30}",
            self.ranks.len(),
            "phase"
        );
        for r in &self.ranks {
            out.push_str(&format!("{:>10}", format!("rank {}", r.rank)));
        }
        out.push('\n');
        let names = RankSummary::default().phases().map(|(n, _)| n);
        for (i, name) in names.iter().enumerate() {
            out.push_str(&format!("{name:<30}"));
            for r in &self.ranks {
                out.push_str(&format!("{:>10.2}", per_step(r, r.phases()[i].1)));
            }
            out.push('\n');
            if *name == "sync: collectives" {
                out.push_str(&format!("{:<30}", "  waiting for a slower rank"));
                for r in &self.ranks {
                    out.push_str(&format!("{:>10.2}", per_step(r, r.waiting)));
                }
                out.push('\n');
            }
        }
        out.push_str(&format!("{:<30}", "total"));
        for r in &self.ranks {
            out.push_str(&format!("{:>10.2}", per_step(r, r.wall)));
        }
        out.push('\n');
        if let Some(first) = self.ranks.first().filter(|r| r.wall > 0.0) {
            let shares: Vec<String> = first
                .phases()
                .iter()
                .filter(|(_, s)| *s > 0.0)
                .map(|(n, s)| format!("{n} {:.0}%", 100.0 * s / first.wall))
                .collect();
            out.push_str(&format!(
                "rank {}'s step: {}\n",
                first.rank,
                shares.join(", ")
            ));
        }
        if self.straggler.is_none() && self.ranks.len() > 1 {
            let most = self
                .ranks
                .iter()
                .map(|r| per_step(r, r.waiting))
                .fold(0.0, f64::max);
            out.push_str(&format!(
                "no straggler: no rank waits more than {most:.2} ms per step for the others at \
                 the gradient sync\n"
            ));
        }
        if let Some(late) = self.straggler {
            let most = self
                .ranks
                .iter()
                .max_by(|a, b| a.waiting.total_cmp(&b.waiting));
            if let Some(most) = most {
                out.push_str(&format!(
                    "straggler: rank {late} (the others wait for it at the gradient sync; \
                     rank {} waits {:.2} ms per step)\n",
                    most.rank,
                    per_step(most, most.waiting)
                ));
            }
        }
        out.push_str(&format!("{:.2} steps/s", self.steps_per_s));
        match self.samples_per_s {
            Some(rate) => out.push_str(&format!(", {rate:.1} samples/s")),
            None => out.push_str(", samples/s not counted (no prepared DataLoader)"),
        }
        if let Some(f) = self.flops_per_s {
            out.push_str(&format!(", {:.3} TFLOP/s of model FLOPs", f * 1e-12));
        }
        if let Some(m) = self.mfu {
            out.push_str(&format!(", MFU {:.1}%", 100.0 * m));
        }
        out.push('\n');
        if self.dropped > 0 {
            out.push_str(&format!(
                "{} spans were not recorded (a record holds 2 million): the figures cover the \
                 start of the run\n",
                self.dropped
            ));
        }
        out
    }

    /// The summary as named values for trackers (`profile/...`).
    pub fn values(&self) -> BTreeMap<String, f64> {
        let mut v = BTreeMap::new();
        v.insert("profile/steps_per_s".into(), self.steps_per_s);
        if let Some(rate) = self.samples_per_s {
            v.insert("profile/samples_per_s".into(), rate);
        }
        if let Some(first) = self.ranks.first().filter(|r| r.steps > 0) {
            let n = first.steps as f64;
            v.insert("profile/step_ms".into(), 1e3 * first.wall / n);
            for (name, secs) in first.phases() {
                let key = name.replace([':', ','], "").replace(' ', "_");
                v.insert(format!("profile/ms/{key}"), 1e3 * secs / n);
            }
            v.insert("profile/ms/waiting".into(), 1e3 * first.waiting / n);
        }
        if let Some(s) = self.straggler {
            v.insert("profile/straggler_rank".into(), s as f64);
        }
        if let Some(f) = self.flops_per_s {
            v.insert("profile/tflops".into(), f * 1e-12);
        }
        if let Some(m) = self.mfu {
            v.insert("profile/mfu".into(), m);
        }
        v
    }
}

/// The rank that waits least, when the waits differ by at least 2 % of the mean step.
fn straggler_of(ranks: &[RankSummary]) -> Option<usize> {
    if ranks.len() < 2 {
        return None;
    }
    let per_step = |r: &RankSummary, secs: f64| secs / r.steps.max(1) as f64;
    let least = ranks
        .iter()
        .min_by(|a, b| per_step(a, a.waiting).total_cmp(&per_step(b, b.waiting)))?;
    let most = ranks
        .iter()
        .map(|r| per_step(r, r.waiting))
        .fold(0.0, f64::max);
    let step = ranks.iter().map(|r| per_step(r, r.wall)).sum::<f64>() / ranks.len() as f64;
    (most - per_step(least, least.waiting) >= 0.02 * step && step > 0.0).then_some(least.rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(wall: u64, collective: u64) -> StepRow {
        StepRow {
            start_ns: 0,
            wall_ns: wall,
            data_ns: 1_000_000,
            backward_ns: 2_000_000,
            sync_ns: collective + 500_000,
            collective_ns: collective,
            optimizer_ns: 1_000_000,
            checkpoint_ns: 0,
            recompute_ns: 0,
        }
    }

    fn rank(rank: usize, collectives: &[u64]) -> RankSteps {
        RankSteps {
            rank,
            host: "h".into(),
            samples: 40,
            flops_per_sample: Some(1e9),
            peak_flops: Some(1e13),
            dropped: 0,
            steps: collectives.iter().map(|&c| step(20_000_000, c)).collect(),
        }
    }

    #[test]
    fn waiting_is_each_steps_collective_less_the_fastest_and_names_the_straggler() {
        // Rank 1 arrives late at step 0 (ranks 0 and 2 wait 6 ms), rank 2 at step 1.
        let s = Summary::of(&[
            rank(0, &[7_000_000, 4_000_000]),
            rank(1, &[1_000_000, 4_000_000]),
            rank(2, &[7_000_000, 1_000_000]),
        ]);
        let ms = |x: f64| (x * 1e3 * 1000.0).round() / 1000.0;
        assert_eq!(ms(s.ranks[0].waiting), 9.0);
        assert_eq!(ms(s.ranks[1].waiting), 3.0);
        assert_eq!(ms(s.ranks[2].waiting), 6.0);
        assert_eq!(s.straggler, Some(1));
        // 20 ms per step: 50 steps/s; 40 samples in 40 ms on each of 3 ranks.
        assert!((s.steps_per_s - 50.0).abs() < 1e-9);
        assert!((s.samples_per_s.unwrap() - 3000.0).abs() < 1e-6);
        assert!((s.flops_per_s.unwrap() - 3e12).abs() < 1.0);
        assert!((s.mfu.unwrap() - 0.1).abs() < 1e-9, "{:?}", s.mfu);
        let r0 = &s.ranks[0];
        // 20 ms less 1 + 2 + (c + 0.5) + 1: 8.5 ms at step 0, 11.5 ms at step 1.
        assert_eq!(ms(r0.forward_and_rest), 20.0);
        assert_eq!(ms(r0.sync_local), 1.0);
        let table = s.table();
        assert!(table.contains("straggler: rank 1"), "{table}");
        assert!(table.contains("rank 0 waits 4.50 ms per step"), "{table}");
        assert!(s.values().contains_key("profile/ms/sync_collectives"));
    }

    #[test]
    fn ranks_that_wait_about_as_long_have_no_straggler() {
        // 0.3 ms apart in 20 ms steps: 1.5 %, noise.
        let s = Summary::of(&[
            rank(0, &[1_300_000, 1_300_000]),
            rank(1, &[1_000_000, 1_000_000]),
        ]);
        assert_eq!(s.straggler, None);
        assert!(s.table().contains("no straggler"), "{}", s.table());
    }

    #[test]
    fn one_rank_has_no_straggler_and_uncounted_samples_give_no_rate() {
        let mut r = rank(0, &[1, 2]);
        r.samples = 0;
        let s = Summary::of(&[r]);
        assert_eq!(s.straggler, None);
        assert!(!s.table().contains("straggler"));
        assert_eq!((s.samples_per_s, s.flops_per_s), (None, None));
        assert!(s.table().contains("samples/s not counted"), "{}", s.table());
    }
}
