//! Settings that make CPU ranks fast, which the launcher gives every rank unless told not to.

/// glibc's allocator settings the ranks get on Linux. By default glibc returns large freed
/// blocks to the system and maps fresh ones, so every training step page-faults its tensor
/// buffers in again (docs/performance.md: the wide model's CPU step fell from ~40 ms to ~16 ms
/// on 2 ranks with these). Large blocks stay in the heap (mmap only above 32 MiB) and are not
/// trimmed back (below 16 GiB of free top).
pub const MALLOC_VARS: &[(&str, &str)] = &[
    ("MALLOC_MMAP_THRESHOLD_", "33554432"),
    ("MALLOC_TRIM_THRESHOLD_", "17179869184"),
];

/// The variable that turns the allocator settings off (`IVME_MALLOC_TUNING=0`).
pub const MALLOC_TUNING_VAR: &str = ivme::env::MALLOC_TUNING.name;

/// The allocator settings to add: none off Linux, none when turned off, and never one the
/// user already set (theirs is passed on as it is).
pub fn malloc_tuning(inherited: &[(String, String)]) -> Vec<(String, String)> {
    let off = inherited
        .iter()
        .any(|(k, v)| k == MALLOC_TUNING_VAR && v.trim() == "0");
    if !cfg!(target_os = "linux") || off {
        return Vec::new();
    }
    MALLOC_VARS
        .iter()
        .filter(|(k, _)| !inherited.iter().any(|(i, _)| i == k))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Whether `name` is one of the allocator settings (a user's value is passed on to every rank).
pub fn is_malloc_var(name: &str) -> bool {
    MALLOC_VARS.iter().any(|(m, _)| *m == name)
}

/// candle's pool spin limit for the ranks, unless the user set one (theirs is passed on): its
/// idle worker would otherwise spin a core away from the next matrix product after every small
/// op (runtime/src/setup/threads.rs). Set here too because candle reads it once, at its first
/// parallel op, which a program may run before it builds the Accelerator.
pub fn candle_tuning(inherited: &[(String, String)]) -> Vec<(String, String)> {
    if inherited.iter().any(|(k, _)| k == CANDLE_SPIN_VAR) {
        return Vec::new();
    }
    vec![(CANDLE_SPIN_VAR.to_string(), CANDLE_SPIN_LIMIT.to_string())]
}

/// candle's spin-limit variable, whose value a user sets is passed on to every rank.
pub use ivme::env::{CANDLE_SPIN_LIMIT, CANDLE_SPIN_VAR};

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn ranks_get_the_allocator_settings_unless_the_user_chose() {
        assert_eq!(malloc_tuning(&[]), vars(MALLOC_VARS));
        // The user's own value wins; the other one is still added.
        let got = malloc_tuning(&vars(&[("MALLOC_MMAP_THRESHOLD_", "1048576")]));
        assert_eq!(got, vars(&[("MALLOC_TRIM_THRESHOLD_", "17179869184")]));
        assert!(malloc_tuning(&vars(&[(MALLOC_TUNING_VAR, "0")])).is_empty());
        assert!(is_malloc_var("MALLOC_TRIM_THRESHOLD_") && !is_malloc_var("MALLOC_ARENA_MAX"));
    }

    #[test]
    fn ranks_get_candles_spin_limit_unless_the_user_chose() {
        assert_eq!(
            candle_tuning(&[]),
            vars(&[("CANDLE_BARRIER_POOL_SPIN_LIMIT", "1000")])
        );
        let theirs = vars(&[("CANDLE_BARRIER_POOL_SPIN_LIMIT", "25000")]);
        assert!(candle_tuning(&theirs).is_empty());
    }
}
