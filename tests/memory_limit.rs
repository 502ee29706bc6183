//! A model that does not fit, and fits with activation checkpointing: a Llama whose activations
//! outweigh its weights (examples/subjects/memory_limit.rs) cannot take a training step under a
//! 450 MiB address-space limit (`prlimit --as`) without checkpointing: the allocator's refusal
//! ends it (Rust's "memory allocation of N bytes failed", SIGABRT), not ivme; with
//! checkpointing it trains under the same limit to plain candle's weights. Measured peaks
//! (VmPeak): about 630 MiB without, 306 MiB with, 625 MiB for plain candle.

mod common;

use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Output};

const LIMIT: u64 = 450 << 20;

/// Runs the subject with `args` (and `out=FILE`), under the limit when `limited`.
fn subject(args: &[&str], out: &Path, limited: bool) -> Output {
    let bin = common::example_bin("memory_limit");
    let mut cmd = if limited {
        let mut c = Command::new("prlimit");
        c.arg(format!("--as={LIMIT}")).arg(bin);
        c
    } else {
        Command::new(bin)
    };
    cmd.args(args)
        .arg(format!("out={}", out.display()))
        // The same threads and heaps in every run, so the address space is comparable.
        .env("RAYON_NUM_THREADS", "2")
        .env("MALLOC_ARENA_MAX", "1")
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("running the memory_limit subject")
}

fn weights(file: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(file, &Device::Cpu).expect("the subject's weights")
}

#[test]
fn a_llama_that_does_not_fit_the_limit_trains_under_it_with_checkpointing() {
    let dir = common::scratch("memory-limit");
    std::fs::create_dir_all(&dir).unwrap();
    let (reference, without, with) = (
        dir.join("candle.safetensors"),
        dir.join("without.safetensors"),
        dir.join("with.safetensors"),
    );
    let o = subject(&["mode=candle"], &reference, false);
    assert!(o.status.success(), "plain candle: {o:?}");

    let o = subject(&["mode=ivme", "ckpt=0"], &without, true);
    let (_, stderr) = common::text(&o);
    assert!(
        !o.status.success(),
        "without checkpointing it fit: {stderr}"
    );
    assert!(
        stderr.contains("memory allocation of") && o.status.signal() == Some(6),
        "without checkpointing it must fail by the allocator's refusal: {:?}\n{stderr}",
        o.status
    );

    let o = subject(&["mode=ivme", "ckpt=1"], &with, true);
    let (_, stderr) = common::text(&o);
    assert!(
        o.status.success(),
        "with checkpointing: {:?}\n{stderr}",
        o.status
    );
    let (got, want) = (weights(&with), weights(&reference));
    assert_eq!(got.len(), want.len());
    let mut worst = 0f32;
    for (name, w) in &want {
        let d = (&got[name] - w).unwrap().abs().unwrap().max_all().unwrap();
        worst = worst.max(d.to_scalar::<f32>().unwrap());
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(worst <= 1e-5, "{worst} from plain candle's weights");
}
