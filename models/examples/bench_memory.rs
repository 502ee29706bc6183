//! Peak memory per process and step time of ivme's Llama training step (every weight trains)
//! at each sharding stage, with activation checkpointing off and on, in f32 and bf16, on 1, 2
//! and 4 processes: every configuration a job of its own (`ivme launch`), rounds alternating
//! checkpointing off and on. Stage 3 always checkpoints: its rows have the "on" columns only.
//!
//! ```text
//! cargo build --release --workspace --bins --examples
//! target/release/examples/bench_memory [rounds=1] [sizes=M,MA] [ranks=1,2,4] [stages=0,1,2,3] \
//!     [precisions=f32,bf16]
//! ```
//!
//! The step is `bench_llama`'s: 2 micro-batches per process, global-norm clipping at 1.0,
//! AdamW. Two peaks, each the largest over the ranks: VmHWM (resident memory, which includes
//! what the allocator keeps after a free) and the most bytes the process held at once (counted
//! by this program's allocator: the memory the step needs). The time is rank 0's milliseconds
//! per optimizer step after one warm-up step. More processes than
//! cores share them, so times on 4 processes here measure the sharing, not the method; the
//! peaks do not depend on it.
//!
//! `bench_memory one SIZE PRECISION STAGE CKPT` (under `ivme launch`) runs one configuration;
//! rank 0 prints its milliseconds per step and the two largest peaks in MiB.

#[path = "support/init.rs"]
mod init;
#[path = "support/live_bytes.rs"]
mod live_bytes;
#[path = "support/llama_sizes.rs"]
mod llama_sizes;
#[path = "../../examples/support/peak_rss.rs"]
mod peak_rss;

use ivme::{Accelerator, Precision, Sharding};

#[global_allocator]
static ALLOCATOR: live_bytes::Live = live_bytes::Live;
use llama_sizes::{ivme_step, median, precision_of, size, Size};
use std::process::Command;
use std::time::Instant;

/// What one configuration measured: rank 0's ms per step, the largest VmHWM and the largest
/// peak of bytes held (MiB).
#[derive(Debug, Clone, Copy, Default)]
struct Peak {
    ms: f64,
    rss: f64,
    held: f64,
}

/// One configuration on this process: what it measured, on rank 0.
fn one(s: &Size, precision: Precision, stage: u8, ckpt: bool) -> ivme::Result<Option<Peak>> {
    let sharding = match stage {
        0 => Sharding::No,
        1 => Sharding::Optimizer,
        2 => Sharding::Gradients,
        _ => Sharding::Parameters,
    };
    let mut acc = Accelerator::builder()
        .grad_accum(2)
        .clip_grad_norm(1.0)
        .precision(precision)
        .sharding(sharding)
        .activation_checkpointing(ckpt)
        .build()?;
    let mut step = ivme_step(s, &mut acc)?;
    step(&mut acc)?;

    acc.wait_for_everyone()?;
    let t = Instant::now();
    for _ in 0..s.steps {
        step(&mut acc)?;
    }
    acc.wait_for_everyone()?;
    let ms = t.elapsed().as_secs_f64() * 1e3 / s.steps as f64;
    let peaks: Vec<(f64, f64)> =
        acc.gather_object(&(peak_rss::peak_rss_mb(), live_bytes::peak_mb()))?;
    let rss = peaks.iter().map(|p| p.0).fold(0.0, f64::max);
    let held = peaks.iter().map(|p| p.1).fold(0.0, f64::max);
    Ok(acc.is_main_process().then_some(Peak { ms, rss, held }))
}

/// One job: `ranks` processes under `ivme launch`; what it measured.
fn job(s: &Size, word: &str, ranks: usize, stage: u8, ckpt: bool) -> ivme::Result<Peak> {
    let exe = std::env::current_exe().map_err(|e| ivme::Error::io("finding this program", e))?;
    let ivme = exe
        .parent()
        .and_then(|p| p.parent())
        .map(|p| p.join("ivme"))
        .ok_or_else(|| ivme::Error::Usage("no ivme beside the examples".into()))?;
    let out = Command::new(ivme)
        .args(["launch", "--num_processes", &ranks.to_string(), "--cpu"])
        .arg(&exe)
        .args([
            "one",
            s.name,
            word,
            &stage.to_string(),
            if ckpt { "1" } else { "0" },
        ])
        .output()
        .map_err(|e| ivme::Error::io("starting a job", e))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let numbers: Vec<f64> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("RESULT "))
        .flat_map(|l| l.split_whitespace().map(str::parse::<f64>))
        .collect::<Result<_, _>>()
        .unwrap_or_default();
    match numbers.as_slice() {
        [ms, rss, held] => Ok(Peak {
            ms: *ms,
            rss: *rss,
            held: *held,
        }),
        _ => Err(ivme::Error::Usage(format!(
            "a job printed `{text}`: {}",
            String::from_utf8_lossy(&out.stderr)
        ))),
    }
}

/// The median time and the largest peaks of some rounds.
fn summary(rounds: &[Peak]) -> Peak {
    Peak {
        ms: median(rounds.iter().map(|p| p.ms).collect()),
        rss: rounds.iter().map(|p| p.rss).fold(0.0, f64::max),
        held: rounds.iter().map(|p| p.held).fold(0.0, f64::max),
    }
}

fn list<T: std::str::FromStr>(arg: Option<&String>, default: &str) -> ivme::Result<Vec<T>> {
    arg.map_or(default, String::as_str)
        .split(',')
        .map(|w| {
            w.parse()
                .map_err(|_| ivme::Error::Usage(format!("`{w}` is not a list item here")))
        })
        .collect()
}

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("one") {
        let s = size(&args[1])?;
        let precision = precision_of(&args[2])?;
        let stage: u8 = args[3].parse().unwrap_or(0);
        if let Some(p) = one(s, precision, stage, args[4] == "1")? {
            println!("RESULT {} {} {}", p.ms, p.rss, p.held);
        }
        return Ok(());
    }
    let rounds: usize = args
        .first()
        .and_then(|a| a.parse().ok())
        .unwrap_or(1)
        .max(1);
    let sizes: Vec<String> = list(args.get(1), "M,MA")?;
    let ranks: Vec<usize> = list(args.get(2), "1,2,4")?;
    let stages: Vec<u8> = list(args.get(3), "0,1,2,3")?;
    let words: Vec<String> = list(args.get(4), "f32,bf16")?;
    println!(
        "llama step, peak per process (VmHWM, MiB) and ms per optimizer step, {rounds} round(s) \
         (medians), every configuration a job of its own"
    );
    println!(
        "| size | precision | processes | stage | VmHWM MiB | with checkpointing | ratio | held \
         MiB | with checkpointing | ratio | ms/step | with checkpointing | ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for name in &sizes {
        let s = size(name)?;
        for word in &words {
            precision_of(word)?;
            for &n in &ranks {
                for &stage in &stages {
                    if n == 1 && stage > 0 {
                        continue; // one process holds everything at any stage
                    }
                    let (mut off, mut on) = (Vec::new(), Vec::new());
                    for round in 0..rounds {
                        for ckpt in [round % 2 == 1, round % 2 == 0] {
                            if stage == 3 && !ckpt {
                                continue; // stage 3 gathers per checkpointed segment
                            }
                            let p = job(s, word, n, stage, ckpt)?;
                            if ckpt {
                                on.push(p)
                            } else {
                                off.push(p)
                            }
                        }
                    }
                    if off.is_empty() {
                        let on = summary(&on);
                        println!(
                            "| {name} | {word} | {n} | {stage} | — | {:.0} | — | — | {:.0} | — | \
                             — | {:.0} | — |",
                            on.rss, on.held, on.ms
                        );
                        continue;
                    }
                    let (off, on) = (summary(&off), summary(&on));
                    println!(
                        "| {name} | {word} | {n} | {stage} | {:.0} | {:.0} | {:.2} | {:.0} | {:.0} \
                         | {:.2} | {:.0} | {:.0} | {:.2} |",
                        off.rss,
                        on.rss,
                        on.rss / off.rss,
                        off.held,
                        on.held,
                        on.held / off.held,
                        off.ms,
                        on.ms,
                        on.ms / off.ms
                    );
                }
            }
        }
    }
    Ok(())
}
