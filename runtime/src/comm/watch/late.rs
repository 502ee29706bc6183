//! Seeing a hang long before the deadline: how long recent arrivals waited, and when a wait is
//! late enough to say so.
//!
//! Once the run is warm (32 collectives), a wait longer than max(10 × the recent 99th
//! percentile, 5 s) prints one warning naming the ranks that have not arrived and what they
//! answer; the collective deadline still decides when the job ends.

use std::collections::VecDeque;
use std::time::Duration;

/// How many recent waits the percentile is taken over.
const KEPT: usize = 256;

/// Collectives recorded before a late wait is reported.
const WARM: usize = 32;

/// The shortest wait ever reported as late.
pub(super) const FLOOR: Duration = Duration::from_secs(5);

/// Recent arrival waits, newest last.
#[derive(Debug, Default)]
pub(super) struct Waits {
    recent: VecDeque<Duration>,
}

impl Waits {
    /// Records one collective's wait.
    pub(super) fn record(&mut self, waited: Duration) {
        if self.recent.len() == KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(waited);
    }

    /// The recent 99th percentile, once warm.
    fn p99(&self) -> Option<Duration> {
        if self.recent.len() < WARM {
            return None;
        }
        let mut sorted: Vec<Duration> = self.recent.iter().copied().collect();
        sorted.sort();
        Some(sorted[(sorted.len() * 99).div_ceil(100) - 1])
    }

    /// How long a wait may last before it is reported: `None` until warm.
    pub(super) fn late(&self) -> Option<Duration> {
        self.p99().map(|p| (p * 10).max(FLOOR))
    }

    /// The recent waits in words, for the warning.
    pub(super) fn describe(&self) -> String {
        match self.p99() {
            Some(p) => format!(
                "99 % of the last {} waited at most {:.3} ms",
                self.recent.len(),
                p.as_secs_f64() * 1e3
            ),
            None => "the run is not warm yet".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_is_late_past_ten_times_the_recent_p99_and_never_before_five_seconds() {
        let mut w = Waits::default();
        for _ in 0..WARM - 1 {
            w.record(Duration::from_millis(1));
        }
        assert_eq!(w.late(), None, "not warm yet");
        w.record(Duration::from_millis(1));
        assert_eq!(w.late(), Some(FLOOR));
        // A run whose collectives wait for a slow peer every time: late means 10× that.
        for _ in 0..KEPT {
            w.record(Duration::from_secs(2));
        }
        assert_eq!(w.late(), Some(Duration::from_secs(20)));
        assert_eq!(w.recent.len(), KEPT, "only the recent waits are kept");
    }
}
