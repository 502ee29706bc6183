//! A model that does not fit one process trains on four under ZeRO-3 within the same
//! per-process memory limit: a Llama of 27 M parameters (examples/subjects/zero3.rs, `size=big`)
//! whose training state (weights, gradients and AdamW's moments: about 430 MB in f32) outweighs
//! its activations. Every process runs in a memory cgroup of its own whose limit the test sets
//! (the kernel's, not ivme's: an address-space limit does not work for MPI ranks, whose
//! reserved mappings are larger than the limit), 380 MiB. On one process, with activation
//! checkpointing, the kernel's OOM killer ends the run (the cgroup counts the kill); on four
//! under ZeRO-3 + checkpointing each rank stays under it, saves its slice, and the merged
//! weights are plain candle's within 1e-5. Measured peaks (VmHWM): about 466 MiB on one
//! process, 250 MiB per rank while training on four.

mod common;

use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};

const LIMIT: u64 = 380 << 20;

/// A memory cgroup (v1 or v2) under this process's own, with one child per rank made by the
/// wrapper script; removed when dropped.
struct Cgroups {
    dir: PathBuf,
    v2: bool,
}

impl Cgroups {
    /// A fresh cgroup under this process's memory cgroup.
    fn new(tag: &str) -> Cgroups {
        let own = std::fs::read_to_string("/proc/self/cgroup").expect("/proc/self/cgroup");
        let v1 = own.lines().find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            controllers
                .split(',')
                .any(|c| c == "memory")
                .then(|| format!("/sys/fs/cgroup/memory{path}"))
        });
        let (base, v2) = match v1 {
            Some(dir) => (dir, false),
            None => {
                let path = own.lines().find_map(|l| l.strip_prefix("0::"));
                let path = path.expect("a memory cgroup (v1) or a unified hierarchy (v2)");
                (format!("/sys/fs/cgroup{path}"), true)
            }
        };
        let dir = Path::new(&base).join(format!("ivme-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("creating the cgroup {}: {e}", dir.display()));
        if v2 {
            // Children of this one may limit memory.
            let _ = std::fs::write(dir.join("cgroup.subtree_control"), "+memory");
        }
        Cgroups { dir, v2 }
    }

    /// A script that puts itself in `rank{R}` (R from Open MPI's environment, 0 alone) with
    /// `limit` bytes, then runs its arguments.
    fn wrapper(&self, limit: u64, at: &Path) -> PathBuf {
        let file = if self.v2 {
            "memory.max"
        } else {
            "memory.limit_in_bytes"
        };
        let script = format!(
            "#!/bin/sh\nset -e\nd='{}'/rank${{OMPI_COMM_WORLD_RANK:-0}}\nmkdir -p \"$d\"\n\
             echo {limit} > \"$d/{file}\"\necho $$ > \"$d/cgroup.procs\"\nexec \"$@\"\n",
            self.dir.display()
        );
        let name = self.dir.file_name().unwrap().to_string_lossy().into_owned();
        let path = at.join(format!("{name}.sh"));
        std::fs::write(&path, script).unwrap();
        let mut perms = std::fs::metadata(&path).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(&path, perms).unwrap();
        path
    }

    /// How many processes the kernel's OOM killer ended in rank `r`'s cgroup.
    fn oom_kills(&self, r: usize) -> u64 {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        let text = std::fs::read_to_string(self.dir.join(format!("rank{r}")).join(file))
            .unwrap_or_default();
        text.lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Rank `r`'s cgroup's peak memory, where the kernel keeps it.
    fn peak(&self, r: usize) -> Option<u64> {
        let file = if self.v2 {
            "memory.peak"
        } else {
            "memory.max_usage_in_bytes"
        };
        let text = std::fs::read_to_string(self.dir.join(format!("rank{r}")).join(file)).ok()?;
        text.trim().parse().ok()
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        if let Ok(children) = std::fs::read_dir(&self.dir) {
            for c in children.flatten() {
                if c.path().is_dir() {
                    let _ = std::fs::remove_dir(c.path());
                }
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

fn weights(file: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(file, &Device::Cpu).expect("safetensors weights")
}

#[test]
fn a_llama_that_does_not_fit_one_process_trains_on_four_under_zero3_within_the_same_limit() {
    let scratch = common::Scratch::new("zero3-limit");
    // A cgroup per run, one child per rank: an OOM kill counts where it happened.
    let (one, four) = (Cgroups::new("limit-one"), Cgroups::new("limit-four"));
    let subject = common::example_bin("zero3");
    let args = ["size=big", "steps=2", "accum=1"];
    // Plain candle, no limit: the reference weights.
    let reference = scratch.0.join("candle.safetensors");
    let o = std::process::Command::new(&subject)
        .args(["mode=candle", &format!("weights={}", reference.display())])
        .args(args)
        .arg(format!("out={}", scratch.0.join("candle").display()))
        .output()
        .unwrap();
    common::ok(&o);
    // The same threads and heaps in every run.
    let env = [("RAYON_NUM_THREADS", "2"), ("MALLOC_ARENA_MAX", "1")];
    let launch = |n: usize, cgroups: &Cgroups, extra: &[String]| {
        let wrapper = cgroups.wrapper(LIMIT, &scratch.0);
        let mut all: Vec<String> = vec![subject.display().to_string()];
        all.extend(args.iter().map(|s| s.to_string()));
        all.extend(extra.iter().cloned());
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        common::launch(n, &wrapper, &all, &env)
    };

    // One process, checkpointing on, no sharding: the kernel ends it at the limit.
    let out = format!("out={}", scratch.0.join("one").display());
    let o = launch(1, &one, &["sharding=no".into(), "ckpt=1".into(), out]);
    let (_, stderr) = common::text(&o);
    assert!(!o.status.success(), "one process fit the limit: {stderr}");
    assert!(
        one.oom_kills(0) >= 1,
        "one process must be ended by the cgroup's OOM killer, not by ivme: {:?} ({:?})\n{stderr}",
        o.status,
        o.status.signal()
    );

    // Four processes under ZeRO-3 (checkpointing is part of it), each in its own cgroup.
    let state = scratch.0.join("state");
    let o = launch(
        4,
        &four,
        &[
            "sharding=parameters".into(),
            format!("state={}", state.display()),
            format!("out={}", scratch.0.join("four").display()),
        ],
    );
    let (_, stderr) = common::text(&o);
    assert!(
        o.status.success(),
        "four ranks under ZeRO-3: {:?}\n{stderr}",
        o.status
    );
    for r in 0..4 {
        assert_eq!(four.oom_kills(r), 0, "rank {r} was OOM-killed");
        if let Some(peak) = four.peak(r) {
            assert!(peak <= LIMIT, "rank {r} peaked at {peak} bytes");
            eprintln!("rank {r}: peak {} MiB in its cgroup", peak >> 20);
        }
    }
    // Each rank saved its slice; merged offline they are plain candle's weights.
    let merged = scratch.0.join("merged");
    let o = std::process::Command::new(common::ivme_bin())
        .args(["merge-weights", &state.display().to_string()])
        .arg(&merged)
        .output()
        .unwrap();
    common::ok(&o);
    let (got, want) = (
        weights(&merged.join("model.safetensors")),
        weights(&reference),
    );
    assert_eq!(got.len(), want.len());
    let mut worst = 0f32;
    for (name, w) in &want {
        let d = (&got[name] - w).unwrap().abs().unwrap().max_all().unwrap();
        worst = worst.max(d.to_scalar::<f32>().unwrap());
    }
    assert!(worst <= 1e-5, "{worst} from plain candle's weights");
}
