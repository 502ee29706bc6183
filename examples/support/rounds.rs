//! A benchmark's round in a process of its own: this program run again with `args` and
//! `envs`, reporting one number on its standard output.

use std::process::Command;

/// Runs this program with `args` (and `envs`) and reads the number it prints.
#[allow(dead_code)]
pub fn in_own_process(args: &[&str], envs: &[(&str, &str)]) -> ivme::Result<f64> {
    let exe = std::env::current_exe().map_err(|e| ivme::Error::io("finding this program", e))?;
    let out = Command::new(exe)
        .args(args)
        .envs(envs.iter().copied())
        .output()
        .map_err(|e| ivme::Error::io("starting a round", e))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim().parse().map_err(|_| {
        ivme::Error::Usage(format!(
            "a round printed `{text}`: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    })
}

/// Runs this program with `args` (and `envs`) and reads the two numbers it prints: a time and
/// its peak resident memory.
#[allow(dead_code)]
pub fn in_own_process_with_peak(args: &[&str], envs: &[(&str, &str)]) -> ivme::Result<(f64, f64)> {
    let exe = std::env::current_exe().map_err(|e| ivme::Error::io("finding this program", e))?;
    let out = Command::new(exe)
        .args(args)
        .envs(envs.iter().copied())
        .output()
        .map_err(|e| ivme::Error::io("starting a round", e))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let numbers: Vec<f64> = text
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    match numbers.as_slice() {
        [ms, peak] => Ok((*ms, *peak)),
        _ => Err(ivme::Error::Usage(format!(
            "a round printed `{text}`, not a time and a peak: {}",
            String::from_utf8_lossy(&out.stderr)
        ))),
    }
}
