//! `#[accelerate(async_checkpoints = true)]` with a created Accelerator: the last background
//! save is committed before the function returns, and its failure is the function's error.

mod common;

use std::process::Command;

fn run(fail: bool) -> (Option<i32>, String, String) {
    let dir = common::scratch(if fail {
        "async-macro-fail"
    } else {
        "async-macro-ok"
    });
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(common::example_bin("async_macro"))
        .current_dir(&dir)
        .env("ASYNC_MACRO_FAIL", if fail { "1" } else { "0" })
        .output()
        .unwrap();
    let (stdout, stderr) = common::text(&out);
    let _ = std::fs::remove_dir_all(&dir);
    (out.status.code(), stdout, stderr)
}

#[test]
fn the_last_background_save_commits_before_the_function_returns() {
    let (code, stdout, stderr) = run(false);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("train ok 1"), "{stdout}\n{stderr}");
}

#[test]
fn a_failed_last_background_save_is_the_functions_error() {
    let (code, stdout, stderr) = run(true);
    assert_eq!(code, Some(3), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("train failed") && stdout.contains("model_0.safetensors"),
        "{stdout}\n{stderr}"
    );
}
