//! This process's peak resident memory, for the benchmarks' reports.
//!
//! Include it with `#[path = "../support/peak_rss.rs"] mod peak_rss;`.

/// This process's peak resident memory in MiB, from /proc (0 where there is none).
pub fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}
