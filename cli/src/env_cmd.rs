//! `ivme env`: everything a bug report needs about this installation, ready to paste.

use crate::cli::{self, Checked};
use crate::mpirun::MPIRUN_VAR;
use crate::process;
use crate::settings::Location;
use crate::values;
use clap::Parser;
use ivme::Result;
use std::path::Path;
use std::process::Command;

/// The subcommand's name.
pub const COMMAND: &str = "env";

/// Print versions, hardware and the config in use, for a bug report.
#[derive(Parser, Debug)]
#[command(rename_all = "snake_case")]
struct Flags {
    /// the config file to report (default: $IVME_CONFIG, else ~/.config/ivme/default_config.toml)
    #[arg(long, value_name = "file", value_parser = Checked::new(values::text))]
    config_file: Option<String>,
}

/// The first line a command prints (stdout, else stderr), if it runs at all.
fn first_line(program: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_string)
}

fn mpi(get: &impl Fn(&str) -> Option<String>) -> String {
    let name = get(MPIRUN_VAR)
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "mpirun".into());
    match process::find_executable(&name, get("PATH").as_deref()) {
        Ok(path) => match first_line(&path, &["--version"]) {
            Some(line) => format!("{line} ({})", path.display()),
            None => format!("{} does not answer `--version`", path.display()),
        },
        Err(_) => "not found (install Open MPI to run more than one process)".into(),
    }
}

fn os() -> String {
    let pretty = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("PRETTY_NAME="))
                .map(|v| v.trim_matches('"').to_string())
        });
    let kernel = first_line(Path::new("uname"), &["-srm"])
        .unwrap_or_else(|| format!("{} {}", std::env::consts::OS, std::env::consts::ARCH));
    match pretty {
        Some(p) => format!("{p}; {kernel}"),
        None => kernel,
    }
}

fn gpus(get: &impl Fn(&str) -> Option<String>) -> Vec<String> {
    let Ok(smi) = process::find_executable("nvidia-smi", get("PATH").as_deref()) else {
        return Vec::new();
    };
    Command::new(smi)
        .arg("-L")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

fn features() -> String {
    let all = ivme::build::FEATURES;
    let on: Vec<&str> = all.iter().filter(|(_, b)| *b).map(|(n, _)| *n).collect();
    let off: Vec<&str> = all.iter().filter(|(_, b)| !*b).map(|(n, _)| *n).collect();
    format!(
        "{} (not built: {})",
        if on.is_empty() {
            "none".into()
        } else {
            on.join(", ")
        },
        if off.is_empty() {
            "none".into()
        } else {
            off.join(", ")
        }
    )
}

fn config(location: &Location) -> String {
    let head = format!("{} (from {})", location.path.display(), location.chosen_by);
    match std::fs::read_to_string(&location.path) {
        Err(_) => format!("none (nothing at {head})"),
        Ok(text) => {
            let verdict = match location.load() {
                Ok(_) => "valid".to_string(),
                Err(e) => format!("INVALID: {e}"),
            };
            let body: String = text.lines().map(|l| format!("    {l}\n")).collect();
            format!("{head}, {verdict}:\n{body}")
        }
    }
}

/// The whole report.
pub fn report(location: &Location, get: impl Fn(&str) -> Option<String>) -> String {
    let gpus = gpus(&get);
    let gpu_text = if gpus.is_empty() {
        "none".to_string()
    } else {
        format!(
            "{}\n{}",
            gpus.len(),
            gpus.iter()
                .map(|g| format!("    {g}\n"))
                .collect::<String>()
                .trim_end()
        )
    };
    format!(
        "Copy and paste this into your bug report:\n\n\
         - ivme version: {}\n\
         - candle version: {}\n\
         - rustc version: {}\n\
         - MPI: {}\n\
         - OS: {}\n\
         - CPUs: {}\n\
         - GPUs: {gpu_text}\n\
         - features: {}\n\
         - config: {}\n",
        ivme::build::VERSION,
        ivme::build::CANDLE,
        ivme::build::RUSTC,
        mpi(&get),
        os(),
        process::cores(),
        features(),
        config(location).trim_end(),
    )
}

/// Runs `ivme env` and returns the exit code.
pub fn main(words: &[String]) -> Result<i32> {
    let Some(flags) = cli::read::<Flags>(COMMAND, words)? else {
        return Ok(0);
    };
    let get = |k: &str| std::env::var(k).ok();
    let location = Location::find(flags.config_file.as_deref().map(Path::new), get)?;
    println!("{}", report(&location, get));
    Ok(0)
}
