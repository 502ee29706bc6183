//! Records as a Chrome trace (the JSON object format Perfetto and chrome://tracing open): one
//! process per rank, a row of optimizer steps above a row of their phases, lined up by wall
//! clock across ranks.

use super::RankRecord;
use serde_json::{json, Value};

/// The Chrome trace of `records`: each rank a process (named with its machine), its steps on
/// thread 0 and its spans on thread 1 (collectives nested in the sync that ran them); times in
/// microseconds from the earliest record's start.
pub fn chrome_trace(records: &[RankRecord]) -> Value {
    let base = records.iter().map(|r| r.origin_unix_ns).min().unwrap_or(0);
    let mut events = Vec::new();
    for r in records {
        let offset = r.origin_unix_ns.saturating_sub(base);
        let us = |ns: u64| (offset + ns) as f64 / 1e3;
        let pid = r.rank;
        events.push(json!({"name": "process_name", "ph": "M", "pid": pid,
            "args": {"name": format!("rank {} ({})", r.rank, r.host)}}));
        events.push(json!({"name": "process_sort_index", "ph": "M", "pid": pid,
            "args": {"sort_index": r.rank}}));
        for (tid, name) in [(0, "optimizer steps"), (1, "phases")] {
            events.push(
                json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                "args": {"name": name}}),
            );
        }
        for (k, s) in r.steps().iter().enumerate() {
            let ms = |ns: u64| ns as f64 / 1e6;
            events.push(json!({
                "name": format!("step {}", k + 1), "ph": "X", "pid": pid, "tid": 0,
                "ts": us(s.start_ns), "dur": s.wall_ns as f64 / 1e3,
                "args": {
                    "data ms": ms(s.data_ns), "forward and the rest ms": ms(s.rest_ns()),
                    "backward ms": ms(s.backward_ns), "sync ms": ms(s.sync_ns),
                    "collectives ms": ms(s.collective_ns), "optimizer ms": ms(s.optimizer_ns),
                    "checkpoint ms": ms(s.checkpoint_ns),
                },
            }));
        }
        for s in &r.spans {
            events.push(json!({
                "name": s.kind.name(), "ph": "X", "pid": pid, "tid": 1,
                "ts": us(s.start_ns), "dur": s.dur_ns as f64 / 1e3,
            }));
        }
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

#[cfg(test)]
mod tests {
    use super::super::{Span, SpanKind};
    use super::*;

    #[test]
    fn ranks_are_processes_lined_up_by_wall_clock() {
        let record = |rank, origin| RankRecord {
            rank,
            world_size: 2,
            host: "m".into(),
            origin_unix_ns: origin,
            samples: 0,
            flops_per_sample: None,
            peak_flops: None,
            dropped: 0,
            spans: vec![
                Span {
                    kind: SpanKind::Backward,
                    start_ns: 1_000,
                    dur_ns: 2_000,
                },
                Span {
                    kind: SpanKind::Sync,
                    start_ns: 3_000,
                    dur_ns: 1_000,
                },
            ],
        };
        let t = chrome_trace(&[record(0, 5_000_000), record(1, 5_002_000)]);
        let events = t["traceEvents"].as_array().unwrap();
        let backward: Vec<(u64, f64)> = events
            .iter()
            .filter(|e| e["name"] == "backward")
            .map(|e| (e["pid"].as_u64().unwrap(), e["ts"].as_f64().unwrap()))
            .collect();
        // Rank 1 started recording 2 µs later: its spans sit 2 µs to the right.
        assert_eq!(backward, vec![(0, 1.0), (1, 3.0)]);
        let steps = events.iter().filter(|e| e["name"] == "step 1").count();
        assert_eq!(steps, 2);
    }
}
