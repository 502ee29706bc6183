//! The lines the launcher prints when it restarts a failed job (`--max_restarts`).
//!
//! The fault-tolerance flags are read in flags.rs (their values by cli.rs) and reach the ranks
//! through the variables of `ivme::env`, the launcher contract.

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
