//! Prints `rank R of W` for each process: the smallest check that `ivme launch` works.
//!
//! ```text
//! cargo build --workspace --bins --examples
//! target/debug/ivme launch --num_processes 2 --cpu target/debug/examples/whoami
//! ```
//!
//! `WHOAMI_FAIL_RANK=R` makes rank R exit with code 3, to see how the launcher reports a failed
//! rank. `WHOAMI_SHOW_ENV=1` also prints the ivme settings (and the allocator's and candle's) each rank received.

use std::process::ExitCode;

/// The exit code of the rank asked to fail.
const FAIL_CODE: u8 = 3;

fn main() -> ivme::Result<ExitCode> {
    let accelerator = ivme::Accelerator::new()?;
    let rank = accelerator.process_index();
    println!("rank {rank} of {}", accelerator.num_processes());
    if std::env::var("WHOAMI_SHOW_ENV").is_ok_and(|v| v == "1") {
        let mut vars: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| {
                k.starts_with("IVME_")
                    || k == "RAYON_NUM_THREADS"
                    || k.starts_with("MALLOC_")
                    || k.starts_with("CANDLE_")
            })
            .collect();
        vars.sort();
        for (k, v) in vars {
            println!("rank {rank}: {k}={v}");
        }
    }
    let fail_rank = std::env::var("WHOAMI_FAIL_RANK").ok();
    if fail_rank.is_some_and(|r| r.trim() == rank.to_string()) {
        eprintln!("whoami: rank {rank} fails on purpose (WHOAMI_FAIL_RANK={rank})");
        return Ok(ExitCode::from(FAIL_CODE));
    }
    Ok(ExitCode::SUCCESS)
}
