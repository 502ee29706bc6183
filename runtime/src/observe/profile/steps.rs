//! A record's spans cut into optimizer steps: a step ends with its window's sync (and the
//! optimizer and checkpoint spans after it) and the next one starts with the next batch's wait
//! or backward, so the forward pass and the loop's own code fall into the step they belong to.

use super::{Span, SpanKind};
use serde::{Deserialize, Serialize};

/// One optimizer step of one process, phase by phase, in nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepRow {
    /// When the step started (from the start of recording).
    pub start_ns: u64,
    /// From its start to the end of its last span.
    pub wall_ns: u64,
    /// Waiting for batches.
    pub data_ns: u64,
    /// candle's backward.
    pub backward_ns: u64,
    /// Ending the window, collectives included.
    pub sync_ns: u64,
    /// The collectives inside the window's end.
    pub collective_ns: u64,
    /// The prepared optimizers.
    pub optimizer_ns: u64,
    /// Checkpoint stalls.
    pub checkpoint_ns: u64,
    /// Checkpointed segments run again, inside `backward_ns`.
    #[serde(default)]
    pub recompute_ns: u64,
}

impl StepRow {
    /// The time no span covers: the forward pass, the loss and the loop's own code.
    pub fn rest_ns(&self) -> u64 {
        self.wall_ns.saturating_sub(
            self.data_ns + self.backward_ns + self.sync_ns + self.optimizer_ns + self.checkpoint_ns,
        )
    }

    fn add(&mut self, kind: SpanKind, ns: u64) {
        match kind {
            SpanKind::Data => self.data_ns += ns,
            SpanKind::Backward => self.backward_ns += ns,
            SpanKind::Sync => self.sync_ns += ns,
            SpanKind::Collective => self.collective_ns += ns,
            SpanKind::Optimizer => self.optimizer_ns += ns,
            SpanKind::Checkpoint => self.checkpoint_ns += ns,
            SpanKind::Recompute => self.recompute_ns += ns,
        }
    }
}

/// The complete optimizer steps in `spans` (any order), in time order. Spans before the first
/// batch (a checkpoint load, say) belong to no step, nor does an unfinished last window; the
/// first step starts at its first batch's wait or backward, so a loop without a prepared
/// loader has its first forward pass outside it.
pub fn steps_of(spans: &[Span]) -> Vec<StepRow> {
    let mut sorted = spans.to_vec();
    // Starts in order; at equal starts the longer span (the enclosing one) first.
    sorted.sort_by_key(|s| (s.start_ns, std::cmp::Reverse(s.dur_ns)));
    let mut rows = Vec::new();
    let mut current: Option<StepRow> = None;
    let mut after_sync = false;
    let mut last_end = 0u64;
    let mut sync_until = 0u64;
    for span in sorted {
        let starts_step = matches!(span.kind, SpanKind::Data | SpanKind::Backward);
        if span.kind == SpanKind::Collective {
            // Only the window's own collectives count towards the sync's waiting.
            if let Some(row) = current.as_mut() {
                if span.start_ns < sync_until {
                    row.add(SpanKind::Collective, span.dur_ns);
                }
            }
            continue;
        }
        match current.as_mut() {
            None if !starts_step => continue,
            None => {
                current = Some(StepRow {
                    start_ns: span.start_ns,
                    ..StepRow::default()
                })
            }
            Some(row) if after_sync && starts_step => {
                row.wall_ns = last_end.saturating_sub(row.start_ns);
                rows.push(*row);
                current = Some(StepRow {
                    start_ns: last_end,
                    ..StepRow::default()
                });
                after_sync = false;
            }
            Some(_) => {}
        }
        let row = current.as_mut().expect("a step is open here");
        row.add(span.kind, span.dur_ns);
        if span.kind == SpanKind::Sync {
            after_sync = true;
            sync_until = span.end_ns();
        }
        last_end = last_end.max(span.end_ns());
    }
    if let (Some(mut row), true) = (current, after_sync) {
        row.wall_ns = last_end.saturating_sub(row.start_ns);
        rows.push(row);
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(kind: SpanKind, start: u64, dur: u64) -> Span {
        Span {
            kind,
            start_ns: start,
            dur_ns: dur,
        }
    }

    #[test]
    fn steps_end_after_the_sync_and_hold_the_forward_that_follows() {
        use SpanKind::*;
        let spans = vec![
            s(Checkpoint, 0, 5), // a load before training: no step's
            // step 1: two micro-batches, forward 10..20 not a span
            s(Data, 10, 2),
            s(Backward, 20, 10),
            s(Data, 30, 2),
            s(Backward, 40, 10),
            s(Sync, 50, 8),
            s(Collective, 51, 5),
            s(Optimizer, 58, 4),
            // step 2 starts at 62: its forward 62..70 is its own
            s(Data, 70, 2),
            s(Backward, 80, 10),
            s(Data, 90, 2),
            s(Backward, 100, 10),
            s(Sync, 110, 10),
            s(Collective, 112, 7),
            s(Optimizer, 120, 3),
            s(Checkpoint, 123, 7),
            s(Collective, 124, 2), // the save's collective: not the sync's
            // an unfinished window
            s(Data, 140, 2),
            s(Backward, 150, 10),
        ];
        let rows = steps_of(&spans);
        assert_eq!(rows.len(), 2);
        assert_eq!(
            rows[0],
            StepRow {
                start_ns: 10,
                wall_ns: 52,
                data_ns: 4,
                backward_ns: 20,
                sync_ns: 8,
                collective_ns: 5,
                optimizer_ns: 4,
                checkpoint_ns: 0,
                recompute_ns: 0,
            }
        );
        assert_eq!(rows[0].rest_ns(), 52 - 36);
        assert_eq!(
            rows[1],
            StepRow {
                start_ns: 62,
                wall_ns: 68,
                data_ns: 4,
                backward_ns: 20,
                sync_ns: 10,
                collective_ns: 7,
                optimizer_ns: 3,
                checkpoint_ns: 7,
                recompute_ns: 0,
            }
        );
    }

    #[test]
    fn spans_in_the_order_they_ended_give_the_same_steps() {
        use SpanKind::*;
        // The recorder pushes a span when it ends: the collective before its sync.
        let ended = vec![
            s(Backward, 0, 10),
            s(Collective, 11, 3),
            s(Sync, 10, 5),
            s(Optimizer, 15, 1),
        ];
        let rows = steps_of(&ended);
        assert_eq!(rows.len(), 1);
        assert_eq!((rows[0].wall_ns, rows[0].collective_ns), (16, 3));
    }
}
