//! The recorder behind a profile: every measured phase of this process as a span (what, when,
//! how long), kept in memory until the profile is written.

use super::{Span, SpanKind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Spans kept at most (24 bytes each): about 2 million, enough for 100,000 steps of a loop
/// with a prepared loader, accumulation and a checkpoint now and then; later spans are counted
/// as dropped.
const MAX_SPANS: usize = 2 << 20;

/// This process's spans since recording started.
#[derive(Debug)]
pub(crate) struct Trace {
    origin: Instant,
    origin_unix_ns: u64,
    spans: Mutex<Vec<Span>>,
    dropped: AtomicU64,
}

impl Trace {
    /// Starts recording now.
    pub(crate) fn new() -> Self {
        Trace {
            origin: Instant::now(),
            origin_unix_ns: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
            spans: Mutex::new(Vec::with_capacity(1 << 14)),
            dropped: AtomicU64::new(0),
        }
    }

    /// Records that `kind` ran from `start` to `end`.
    pub(crate) fn record(&self, kind: SpanKind, start: Instant, end: Instant) {
        let since = |t: Instant| {
            u64::try_from(t.saturating_duration_since(self.origin).as_nanos()).unwrap_or(u64::MAX)
        };
        let span = Span {
            kind,
            start_ns: since(start),
            dur_ns: since(end).saturating_sub(since(start)),
        };
        let Ok(mut spans) = self.spans.lock() else {
            return;
        };
        if spans.len() < MAX_SPANS {
            spans.push(span);
        } else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The wall-clock time recording started, in nanoseconds since the Unix epoch.
    pub(crate) fn origin_unix_ns(&self) -> u64 {
        self.origin_unix_ns
    }

    /// A copy of the spans so far, in the order they ended, and how many were dropped.
    pub(crate) fn spans(&self) -> (Vec<Span>, u64) {
        let spans = self.spans.lock().map(|s| s.clone()).unwrap_or_default();
        (spans, self.dropped.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn spans_are_measured_from_the_origin() {
        let t = Trace::new();
        let a = Instant::now() + Duration::from_millis(5);
        t.record(SpanKind::Backward, a, a + Duration::from_millis(2));
        let (spans, dropped) = t.spans();
        assert_eq!(dropped, 0);
        assert_eq!(spans.len(), 1);
        assert_eq!(spans[0].kind, SpanKind::Backward);
        assert!(spans[0].start_ns >= 5_000_000, "{:?}", spans[0]);
        assert_eq!(spans[0].dur_ns, 2_000_000);
    }
}
