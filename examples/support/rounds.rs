//! A benchmark's round in a process of its own: this program run again with `args` and
//! `envs`, reporting one number on its standard output.

use std::process::Command;

/// Runs this program with `args` (and `envs`) and reads the number it prints.
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
