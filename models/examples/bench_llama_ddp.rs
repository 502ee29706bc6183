//! A Llama's full training step (ivme's trainable `models::llama::Llama`) on 2 processes through
//! ivme against the same data-parallel step written by hand with candle and MPI, each system in
//! a job of its own, started by `ivme launch` and by plain `mpirun`.
//!
//! ```text
//! cargo build --release --workspace --bins --examples
//! target/release/examples/bench_llama_ddp [rounds=3] [sizes=T,S,M]
//! ```
//!
//! The step on each rank: 2 micro-batches of the size's shape, the loss on every position's
//! logits against a random target each, global-norm clipping at 1.0, AdamW (lr 3e-4). The
//! hand-written loop sums the two micro-batches' gradients into one host buffer (variables in name order), one blocking
//! `MPI_Allreduce` into a second buffer kept across steps, divides by the world size, clips on
//! the host and steps candle-nn's AdamW; ivme's is an `Accelerator` with `grad_accum(2)`,
//! `clip_grad_norm(1.0)` and its AdamW. Every (system, size, starter) measurement is a job of
//! its own (`ivme launch --num_processes 2 --cpu`, or `mpirun -np 2` with
//! `RAYON_NUM_THREADS=1` as `ivme launch` sets and glibc's defaults), one warm-up step, then
//! the timed steps between barriers; rounds alternate which system goes first; medians.
//!
//! `bench_llama_ddp one SYSTEM SIZE` is one measurement (run under a launcher); rank 0 prints
//! ms per step.

#[path = "support/init.rs"]
mod init;
#[path = "support/llama_sizes.rs"]
mod llama_sizes;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, VarMap};
use ivme::Accelerator;
use llama_sizes::{data, ivme_step, loss_of, median, model, size, Size, LR};
use mpi::collective::SystemOperation;
use mpi::traits::{Communicator, CommunicatorCollectives};
use std::process::Command;
use std::time::Instant;

/// The hand-written step's milliseconds, on rank 0 (`None` elsewhere).
fn hand(s: &Size) -> ivme::Result<Option<f64>> {
    let universe = mpi::initialize().ok_or_else(|| ivme::Error::Usage("MPI twice".into()))?;
    let world = universe.world();
    let varmap = VarMap::new();
    let model = model(s, &varmap, DType::F32)?;
    let batches = data(s)?;
    let mut vars: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .expect("varmap lock")
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let vars: Vec<Var> = vars.into_iter().map(|(_, v)| v).collect();
    let total: usize = vars.iter().map(|v| v.elem_count()).sum();
    let mut opt = candle_nn::AdamW::new(
        vars.clone(),
        candle_nn::ParamsAdamW {
            lr: LR,
            ..Default::default()
        },
    )?;
    let (mut send, mut recv) = (vec![0f32; total], vec![0f32; total]);
    let inv = 1.0 / world.size() as f32;
    let mut step = || -> ivme::Result<()> {
        send.iter_mut().for_each(|x| *x = 0.0);
        for (x, y) in &batches {
            let loss = (loss_of(&model, x, y)? / 2.0)?;
            let grads = loss.backward()?;
            let mut at = 0;
            for v in &vars {
                let n = v.elem_count();
                if let Some(g) = grads.get(v.as_tensor()) {
                    let g = g.flatten_all()?.to_vec1::<f32>()?;
                    for (s, g) in send[at..at + n].iter_mut().zip(g) {
                        *s += g;
                    }
                }
                at += n;
            }
        }
        world.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
        let norm = recv
            .iter()
            .map(|g| (g * inv) as f64 * (g * inv) as f64)
            .sum::<f64>()
            .sqrt();
        let scale = inv
            * if norm > 1.0 {
                (1.0 / (norm + 1e-6)) as f32
            } else {
                1.0
            };
        let mut mean = GradStore::default();
        let mut at = 0;
        for v in &vars {
            let n = v.elem_count();
            let g: Vec<f32> = recv[at..at + n].iter().map(|x| x * scale).collect();
            mean.insert(v.as_tensor(), Tensor::from_vec(g, v.shape(), &Device::Cpu)?);
            at += n;
        }
        opt.step(&mean)?;
        Ok(())
    };
    step()?;
    world.barrier();
    let t = Instant::now();
    for _ in 0..s.steps {
        step()?;
    }
    world.barrier();
    let ms = t.elapsed().as_secs_f64() * 1e3 / s.steps as f64;
    Ok((world.rank() == 0).then_some(ms))
}

/// ivme's step's milliseconds, on rank 0 (`None` elsewhere).
fn ours(s: &Size) -> ivme::Result<Option<f64>> {
    let mut acc = Accelerator::builder()
        .grad_accum(2)
        .clip_grad_norm(1.0)
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
    Ok(acc.is_main_process().then_some(ms))
}

/// One job of `system` at `size` started by `starter`: rank 0's milliseconds per step.
fn job(starter: &str, system: &str, size: &str) -> ivme::Result<f64> {
    let exe = std::env::current_exe().map_err(|e| ivme::Error::io("finding this program", e))?;
    let me = exe.display().to_string();
    let mut cmd = match starter {
        "ivme launch" => {
            let ivme = exe
                .parent()
                .and_then(|p| p.parent())
                .map(|p| p.join("ivme"))
                .ok_or_else(|| ivme::Error::Usage("no ivme beside the examples".into()))?;
            let mut c = Command::new(ivme);
            c.args(["launch", "--num_processes", "2", "--cpu", &me]);
            c
        }
        _ => {
            let mut c = Command::new("mpirun");
            c.args(["-np", "2", "-x", "RAYON_NUM_THREADS", &me])
                .env("RAYON_NUM_THREADS", "1");
            c
        }
    };
    let out = cmd
        .args(["one", system, size])
        .env_remove("MALLOC_MMAP_THRESHOLD_")
        .env_remove("MALLOC_TRIM_THRESHOLD_")
        .output()
        .map_err(|e| ivme::Error::io(format!("starting {starter}"), e))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.trim().parse::<f64>().ok())
        .ok_or_else(|| {
            ivme::Error::Usage(format!(
                "{starter} {system} {size} printed `{text}`: {}",
                String::from_utf8_lossy(&out.stderr)
            ))
        })
}

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("one") {
        let s = size(&args[2])?;
        let ms = match args[1].as_str() {
            "hand" => hand(s)?,
            _ => ours(s)?,
        };
        if let Some(ms) = ms {
            println!("{ms}");
        }
        return Ok(());
    }
    let rounds: usize = args
        .first()
        .and_then(|a| a.parse().ok())
        .unwrap_or(3)
        .max(1);
    let sizes: Vec<&Size> = args
        .get(1)
        .map_or("T,S,M", String::as_str)
        .split(',')
        .map(size)
        .collect::<ivme::Result<_>>()?;
    println!(
        "llama training step on 2 processes × 1 thread, f32, {rounds} rounds (medians), each \
         system in a job of its own"
    );
    println!(
        "| size | started by | hand-written candle + MPI ms/step | ivme ms/step | ivme / hand |"
    );
    println!("|---|---|---|---|---|");
    for s in sizes {
        for starter in ["ivme launch", "mpirun"] {
            let (mut h, mut o) = (Vec::new(), Vec::new());
            for round in 0..rounds {
                let order = if round % 2 == 0 {
                    ["hand", "ivme"]
                } else {
                    ["ivme", "hand"]
                };
                for system in order {
                    let ms = job(starter, system, s.name)?;
                    if system == "hand" {
                        h.push(ms)
                    } else {
                        o.push(ms)
                    }
                }
            }
            let (h, o) = (median(h), median(o));
            println!(
                "| {} | {starter} | {h:.1} | {o:.1} | {:.2} |",
                s.name,
                o / h
            );
        }
    }
    Ok(())
}
