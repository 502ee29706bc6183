//! The lines the launcher prints when it restarts a failed job (`--max_restarts`) or ends one
//! that stopped for a preemption.
//!
//! The fault-tolerance flags are read in flags.rs (their values by cli.rs) and reach the ranks
//! through the variables of `ivme::env`, the launcher contract. Also the launcher's verdict
//! after a preemption.

use std::path::Path;

/// The line printed before relaunching: `ivme: restart 1 of 3 after rank 1 failed with ...`.
pub fn restart_line(restart: usize, max: usize, cause: &str) -> String {
    format!("ivme: restart {restart} of {max} after {cause}")
}

/// The line printed when the last allowed attempt failed too.
pub fn exhausted_line(max: usize, cause: &str) -> String {
    let attempts = max + 1;
    format!(
        "ivme: restarts exhausted: the job failed {attempts} times (the first run and \
         {max} restart{}); the last failure: {cause}",
        if max == 1 { "" } else { "s" }
    )
}

/// After a job ended: when it stopped for a preemption (a rank noted one in `notes`, or this
/// launcher received a preemption signal and the job did not succeed), prints what was saved
/// and returns the exit code for the scheduler (`requeue`); otherwise `None`.
pub fn preempted(notes: &Path, code: i32, requeue: i32) -> Option<i32> {
    let stops = read_stops(notes);
    let signal = crate::process::preempted_by();
    if stops.is_empty() && (signal.is_none() || code == 0) {
        return None;
    }
    let by = match signal {
        Some(sig) => format!("signal {sig} to the launcher"),
        None => format!(
            "a signal to rank {}",
            stops.first().map_or(0, |(rank, _, _)| *rank)
        ),
    };
    let what = match stops.first() {
        Some((_, step, Some(dir))) => {
            format!("the ranks stopped after optimizer step {step} and saved {dir}")
        }
        Some((_, step, None)) => format!(
            "the ranks stopped after optimizer step {step} without saving (no project folder \
             with automatic naming, or no preemption point in the loop); the newest earlier \
             checkpoint stands"
        ),
        None => "the job ended before training began or before it could stop at a step; \
                 the newest earlier checkpoint stands"
            .to_string(),
    };
    eprintln!(
        "ivme: preempted ({by}): {what}; exiting with {requeue} so a scheduler can requeue the \
         job (IVME_REQUEUE_EXIT_CODE)"
    );
    Some(requeue)
}

/// The stops ranks noted in `dir`: (rank, step, checkpoint), in rank order.
fn read_stops(dir: &Path) -> Vec<(usize, u64, Option<String>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut stops: Vec<(usize, u64, Option<String>)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let rank = name
                .strip_prefix(ivme::preempt::MARKER_PREFIX)?
                .parse()
                .ok()?;
            let text = std::fs::read_to_string(e.path()).ok()?;
            let mut lines = text.lines();
            let step = lines.next()?.trim().parse().ok()?;
            let dir = lines.next().map(str::trim).filter(|d| !d.is_empty());
            Some((rank, step, dir.map(str::to_string)))
        })
        .collect();
    stops.sort();
    stops
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restart_messages_count_from_one() {
        assert_eq!(
            restart_line(
                1,
                3,
                "rank 1 failed with exit code 137 (killed by signal 9)"
            ),
            "ivme: restart 1 of 3 after rank 1 failed with exit code 137 (killed by signal 9)"
        );
        let line = exhausted_line(2, "rank 0 failed with exit code 3");
        assert!(
            line.contains("restarts exhausted") && line.contains("failed 3 times"),
            "{line}"
        );
        assert!(exhausted_line(1, "x").contains("1 restart)"));
    }
}
