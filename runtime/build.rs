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
    // The lock file holds the candle version actually resolved (the manifest pins it exactly).
    let lock = std::path::Path::new(&std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default())
        .join("../Cargo.lock");
    let text = std::fs::read_to_string(&lock).unwrap_or_default();
    let candle = text
        .split("[[package]]")
        .find(|p| p.contains("name = \"candle-core\""))
        .and_then(|p| p.lines().find_map(|l| l.trim().strip_prefix("version = ")))
        .map_or("unknown", |v| v.trim_matches('"'));
    println!("cargo:rustc-env=IVME_BUILD_CANDLE={candle}");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../Cargo.lock");
}
