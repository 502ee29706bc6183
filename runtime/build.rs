//! Records the compiler and candle versions this build used, for `ivme env` bug reports.

use std::process::Command;

fn main() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map_or_else(|| "unknown".into(), |s| s.trim().to_string());
    println!("cargo:rustc-env=IVME_BUILD_RUSTC={version}");
    // The lock file holds the candle version actually resolved; a published crate has no
    // lock file beside it, but its manifest pins candle exactly (`=x.y.z`), so that is next.
    let dir = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let read = |p: &str| std::fs::read_to_string(dir.join(p)).unwrap_or_default();
    let candle = locked_candle(&read("../Cargo.lock"))
        .or_else(|| pinned_candle(&read("../Cargo.toml")))
        .or_else(|| pinned_candle(&read("Cargo.toml")))
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=IVME_BUILD_CANDLE={candle}");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../Cargo.lock");
    println!("cargo:rerun-if-changed=../Cargo.toml");
}

/// candle-core's version in a Cargo.lock.
fn locked_candle(lock: &str) -> Option<String> {
    lock.split("[[package]]")
        .find(|p| p.contains("name = \"candle-core\""))
        .and_then(|p| p.lines().find_map(|l| l.trim().strip_prefix("version = ")))
        .map(|v| v.trim_matches('"').to_string())
}

/// The exact version a manifest pins candle-core to: `candle-core = "=x"` in a workspace, or
/// `version = "=x"` under `[dependencies.candle-core]` in a published manifest.
fn pinned_candle(manifest: &str) -> Option<String> {
    let mut in_table = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_table = line == "[dependencies.candle-core]";
            continue;
        }
        let value = match line.split_once('=') {
            Some((k, v)) if k.trim() == "candle-core" || (in_table && k.trim() == "version") => v,
            _ => continue,
        };
        if let Some(version) = value.trim().trim_matches('"').strip_prefix('=') {
            return Some(version.trim().to_string());
        }
    }
    None
}
