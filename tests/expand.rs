//! `ivme expand`: the attribute's expansion of a file's functions, without compiling, and its
//! mistakes with their line and column.

mod common;

use common::{ivme_bin, ok, refused, Scratch};
use std::path::Path;
use std::process::{Command, Output};

fn expand(args: &[&str]) -> Output {
    Command::new(ivme_bin())
        .arg("expand")
        .args(args)
        .output()
        .expect("running ivme expand")
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The ```rust block of macros/macro.md's "The expansion of the main example" section, which the
/// snapshot tests keep equal to what the compiler's attribute writes.
fn documented_expansion() -> String {
    let docs = std::fs::read_to_string(root().join("macros/macro.md")).unwrap();
    let section = docs
        .split("# The expansion of the main example")
        .nth(1)
        .expect("macros/macro.md has the section");
    let block = section.split("```rust,ignore\n").nth(1).unwrap();
    block.split("\n```").next().unwrap().to_string()
}

#[test]
fn the_main_example_expands_to_what_the_docs_show() {
    let file = root().join("examples/tutorial_macro.rs");
    let stdout = ok(&expand(&[file.to_str().unwrap()]));
    let (header, code) = stdout.split_once('\n').unwrap();
    assert!(
        header.ends_with("tutorial_macro.rs:42: `fn train` as #[accelerate] writes it"),
        "{header}"
    );
    assert_eq!(code.trim_end(), documented_expansion().trim_end());
}

#[test]
fn functions_in_modules_and_impls_are_found_and_one_can_be_picked() {
    let dir = Scratch::new("expand-find");
    let file = dir.0.join("lib.rs");
    std::fs::write(
        &file,
        "mod inner {\n    #[ivme::accelerate(grad_accum = 4)]\n    fn nested() -> ivme::Result<()> { Ok(()) }\n}\n\
         struct T;\nimpl T {\n    #[accelerate]\n    fn method(acc: &mut Accelerator) -> ivme::Result<()> { Ok(()) }\n}\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let all = ok(&expand(&[f]));
    assert!(
        all.contains(":2: `fn nested`") && all.contains(".grad_accum(4)"),
        "{all}"
    );
    assert!(all.contains(":7: `fn method`"), "{all}");
    let one = ok(&expand(&[f, "method"]));
    assert!(!one.contains("nested"), "{one}");
    let missing = refused(&expand(&[f, "train"]));
    assert!(
        missing.contains("no function named `train` under #[accelerate] (it has: nested, method)"),
        "{missing}"
    );
}

#[test]
fn mistakes_are_reported_at_their_line_and_column() {
    let dir = Scratch::new("expand-errors");
    let file = dir.0.join("train.rs");
    std::fs::write(
        &file,
        "use ivme::accelerate;\n\n#[accelerate(grad_acum = 2, precision = \"fp8\")]\nfn train() -> candle_core::Result<()> { Ok(()) }\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let out = expand(&[f]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{f}:3:14: error: "))
            && stderr.contains("did you mean `grad_accum`"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("{f}:3:41: error: ")) && stderr.contains("fp16"),
        "{stderr}"
    );
    let broken = dir.0.join("broken.rs");
    std::fs::write(&broken, "fn train( {").unwrap();
    let e = refused(&expand(&[broken.to_str().unwrap()]));
    assert!(
        e.contains("broken.rs:1:") && e.contains("not valid Rust"),
        "{e}"
    );
}
