//! Data-parallel training through ivme against the loop a competent Rust user writes by hand
//! with candle and MPI, each system in a job of its own.
//!
//! ```text
//! cargo build --release --workspace --bins --examples
//! target/release/examples/bench_ddp [rounds=9] [tiny|wide] [processes=2] [jobs=3] [overlap]
//! ```
//!
//! With `overlap`, each job also runs ivme with 1 MB buckets (`bench_ddp one buckets ...`) and
//! the same with `overlap = true` (`one overlap`), in alternating order.
//!
//! It starts `jobs` jobs of each system (`ivme launch --num_processes N --cpu` of itself with
//! `one SYSTEM ROUNDS CASE`), alternating which system goes first. Each job runs one warm-up
//! round and `rounds` timed ones and rank 0 prints their median; the table gives the median over
//! the jobs and the median of the paired ratios. Under a launcher of your own (another machine
//! layout, a hostfile), run the jobs yourself: `ivme launch ... bench_ddp one hand 5 wide` and
//! `... one ivme 5 wide`.
//!
//! The hand-written loop: candle's forward and backward, every gradient copied to one host
//! buffer (variables in name order), one blocking `MPI_Allreduce` into a second buffer kept
//! across steps, the mean rebuilt as tensors, candle-nn's AdamW. The ivme loop: the same model
//! and batches through a prepared AdamW and `Accelerator::backward`. Every round starts at a
//! barrier. Reported per model: median µs per step of each, the median of the paired ratios,
//! and what each step allocates (counted by a global allocator).

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder, VarMap};
use ivme::rng::Rng;
use ivme::Accelerator;
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator, CommunicatorCollectives};
use std::time::Instant;

#[path = "../support/count_alloc.rs"]
mod count_alloc;
use count_alloc::Counts;

#[global_allocator]
static ALLOCATOR: count_alloc::Counting = count_alloc::Counting;

#[path = "../support/mlp.rs"]
mod mlp;
use mlp::Mlp;

struct Case {
    name: &'static str,
    dims: Vec<usize>,
    batch: usize,
    steps: usize,
}

/// This rank's batches: every `world`-th of `steps * world`, as both loops shard them.
fn batches(case: &Case, rank: usize, world: usize) -> ivme::Result<Vec<(Tensor, Tensor)>> {
    let mut rng = Rng::new(5);
    let n = case.steps * world * case.batch;
    let x = rng.randn(0.0, 1.0, (n, case.dims[0]), &Device::Cpu)?;
    let y = rng.randn(0.0, 1.0, (n, *case.dims.last().unwrap_or(&1)), &Device::Cpu)?;
    (0..case.steps)
        .map(|i| {
            let at = (i * world + rank) * case.batch;
            Ok((x.narrow(0, at, case.batch)?, y.narrow(0, at, case.batch)?))
        })
        .collect()
}

fn sorted_vars(varmap: &VarMap) -> Vec<Var> {
    let data = varmap.data().lock().unwrap();
    let mut named: Vec<(&String, &Var)> = data.iter().collect();
    named.sort_by(|a, b| a.0.cmp(b.0));
    named.into_iter().map(|(_, v)| v.clone()).collect()
}

/// The hand-written data-parallel loop's model, optimizer and buffers.
struct Hand {
    model: Mlp,
    vars: Vec<Var>,
    opt: candle_nn::AdamW,
    send: Vec<f32>,
    recv: Vec<f32>,
}

impl Hand {
    fn new(case: &Case) -> ivme::Result<Hand> {
        let varmap = VarMap::new();
        let model = Mlp::new(
            VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
            &case.dims,
        )?;
        let vars = sorted_vars(&varmap);
        let opt = candle_nn::AdamW::new(vars.clone(), ParamsAdamW::default())?;
        let total: usize = vars.iter().map(|v| v.elem_count()).sum();
        Ok(Hand {
            model,
            vars,
            opt,
            send: Vec::with_capacity(total),
            recv: vec![0f32; total],
        })
    }

    /// One timed round: seconds per step and allocations per step.
    fn round(
        &mut self,
        world: &SimpleCommunicator,
        data: &[(Tensor, Tensor)],
    ) -> ivme::Result<(f64, Counts)> {
        let inv = 1.0 / world.size() as f32;
        world.barrier();
        let (start, counts) = (Instant::now(), Counts::now());
        for (x, y) in data {
            let loss = candle_nn::loss::mse(&self.model.forward(x)?, y)?;
            let grads = loss.backward()?;
            self.send.clear();
            for v in &self.vars {
                let g = grads
                    .get(v.as_tensor())
                    .expect("every weight has a gradient");
                self.send
                    .extend_from_slice(&g.flatten_all()?.to_vec1::<f32>()?);
            }
            world.all_reduce_into(&self.send[..], &mut self.recv[..], SystemOperation::sum());
            let mut mean = GradStore::default();
            let mut at = 0;
            for v in &self.vars {
                let n = v.elem_count();
                let g: Vec<f32> = self.recv[at..at + n].iter().map(|x| x * inv).collect();
                mean.insert(v.as_tensor(), Tensor::from_vec(g, v.shape(), &Device::Cpu)?);
                at += n;
            }
            self.opt.step(&mean)?;
        }
        let steps = data.len() as f64;
        Ok((
            start.elapsed().as_secs_f64() / steps,
            per_step(Counts::since(counts), data.len()),
        ))
    }
}

/// The same model and optimizer, prepared by the Accelerator.
struct Ours {
    model: Mlp,
    opt: ivme::optim::AcceleratedOptimizer<ivme::optim::AdamW>,
}

impl Ours {
    fn new(acc: &mut Accelerator, case: &Case) -> ivme::Result<Ours> {
        let varmap = VarMap::new();
        let model = Mlp::new(
            VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
            &case.dims,
        )?;
        let opt = ivme::optim::AdamW::new(varmap.all_vars(), ParamsAdamW::default())?;
        let (_varmap, opt) = acc.prepare((varmap, opt))?;
        Ok(Ours { model, opt })
    }

    /// One timed round: seconds per step and allocations per step.
    fn round(
        &mut self,
        acc: &mut Accelerator,
        data: &[(Tensor, Tensor)],
    ) -> ivme::Result<(f64, Counts)> {
        acc.wait_for_everyone()?;
        let (start, counts) = (Instant::now(), Counts::now());
        for (x, y) in data {
            let loss = candle_nn::loss::mse(&self.model.forward(x)?, y)?;
            let grads = acc.backward(&loss)?;
            self.opt.step(&grads)?;
        }
        let steps = data.len() as f64;
        Ok((
            start.elapsed().as_secs_f64() / steps,
            per_step(Counts::since(counts), data.len()),
        ))
    }
}

fn per_step(c: Counts, steps: usize) -> Counts {
    let s = steps.max(1) as u64;
    Counts {
        allocs: c.allocs / s,
        large: c.large / s,
        bytes: c.bytes / s,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs one system's rounds in this job; rank 0 prints `µs/step allocs large bytes`.
fn one(system: &str, rounds: usize, case: &Case) -> ivme::Result<()> {
    let mut acc = match system {
        // 1 MB buckets, so that the wide model's 5.3 MB of gradient make several.
        "buckets" => Accelerator::builder().bucket_size_mb(1).build()?,
        "overlap" => Accelerator::builder()
            .bucket_size_mb(1)
            .overlap(true)
            .build()?,
        _ => Accelerator::new()?,
    };
    let world = SimpleCommunicator::world();
    let data = batches(case, acc.process_index(), acc.num_processes())?;
    let mut times = Vec::new();
    let mut alloc = Counts::default();
    if system == "hand" {
        let mut hand = Hand::new(case)?;
        hand.round(&world, &data)?; // warm-up
        for _ in 0..rounds {
            let (t, c) = hand.round(&world, &data)?;
            times.push(t);
            alloc = c;
        }
    } else {
        let mut ours = Ours::new(&mut acc, case)?;
        ours.round(&mut acc, &data)?; // warm-up
        for _ in 0..rounds {
            let (t, c) = ours.round(&mut acc, &data)?;
            times.push(t);
            alloc = c;
        }
    }
    acc.print(format!(
        "{} {} {} {}",
        median(times) * 1e6,
        alloc.allocs,
        alloc.large,
        alloc.bytes
    ));
    Ok(())
}

/// One job of `system`: rank 0's µs per step and allocations per step.
fn job(system: &str, rounds: usize, case: &str, processes: usize) -> ivme::Result<(f64, Counts)> {
    let exe = std::env::current_exe().map_err(|e| ivme::Error::io("finding this program", e))?;
    let ivme = exe
        .parent()
        .and_then(|p| p.parent())
        .map(|p| p.join("ivme"))
        .ok_or_else(|| ivme::Error::Usage("no ivme beside the examples".into()))?;
    let out = std::process::Command::new(&ivme)
        .args(["launch", "--num_processes", &processes.to_string(), "--cpu"])
        .arg(&exe)
        .args(["one", system, &rounds.to_string(), case])
        .output()
        .map_err(|e| ivme::Error::io(format!("starting {}", ivme.display()), e))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let numbers: Option<Vec<f64>> = text
        .lines()
        .rev()
        .map(|l| {
            l.split_whitespace()
                .map(|w| w.parse::<f64>().ok())
                .collect::<Option<Vec<f64>>>()
        })
        .find(|v| v.as_ref().is_some_and(|v| v.len() == 4))
        .flatten();
    match numbers {
        Some(v) => Ok((
            v[0],
            Counts {
                allocs: v[1] as u64,
                large: v[2] as u64,
                bytes: v[3] as u64,
            },
        )),
        None => Err(ivme::Error::Usage(format!(
            "a {system} job printed `{text}`: {}",
            String::from_utf8_lossy(&out.stderr)
        ))),
    }
}

fn cases() -> [Case; 2] {
    [
        Case {
            name: "tiny 32-32-1, batch 16",
            dims: vec![32, 32, 1],
            batch: 16,
            steps: 1000,
        },
        Case {
            name: "wide 256-1024-1024-1, batch 64",
            dims: vec![256, 1024, 1024, 1],
            batch: 64,
            steps: 16,
        },
    ]
}

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |i: usize, default: usize| {
        args.get(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(default)
            .max(1)
    };
    if args.first().map(String::as_str) == Some("one") {
        let only = args.get(3).cloned().unwrap_or_default();
        let case = cases()
            .into_iter()
            .find(|c| c.name.starts_with(only.as_str()))
            .ok_or_else(|| ivme::Error::Usage(format!("no case `{only}`: use tiny or wide")))?;
        return one(&args[1], number(2, 9), &case);
    }
    if std::env::var("OMPI_COMM_WORLD_SIZE").is_ok_and(|n| n != "1") {
        return Err(ivme::Error::Usage(
            "bench_ddp starts its own jobs: run it without a launcher, or run `bench_ddp one \
             hand|ivme ROUNDS CASE` under yours"
                .into(),
        ));
    }
    let rounds = number(0, 9);
    let only = args.get(1).cloned().unwrap_or_default();
    let processes = number(2, 2);
    let jobs = number(3, 3);
    println!(
        "ivme vs hand-written candle + MPI data parallelism, {processes} processes (ivme launch: \
         RAYON_NUM_THREADS = cores / processes), {jobs} jobs of each system, {rounds} rounds each"
    );
    for case in cases().iter().filter(|c| c.name.starts_with(only.as_str())) {
        let word = case.name.split_whitespace().next().unwrap_or("tiny");
        let (mut hand, mut ours, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        let (mut hand_alloc, mut ours_alloc) = (Counts::default(), Counts::default());
        // With `overlap` as the fifth argument, two more systems per job: ivme with 1 MB
        // buckets, and the same with the optimizer overlapped with the sync.
        let mut extra: Vec<(&str, Vec<f64>, Vec<f64>)> = match args.get(4).map(String::as_str) {
            Some("overlap") => vec![("buckets", vec![], vec![]), ("overlap", vec![], vec![])],
            _ => vec![],
        };
        for j in 0..jobs {
            for (system, times, _) in extra.iter_mut().filter(|_| j % 2 == 1) {
                times.push(job(system, rounds, word, processes)?.0);
            }
            let (h, o) = if j % 2 == 0 {
                let h = job("hand", rounds, word, processes)?;
                (h, job("ivme", rounds, word, processes)?)
            } else {
                let o = job("ivme", rounds, word, processes)?;
                (job("hand", rounds, word, processes)?, o)
            };
            for (system, times, _) in extra.iter_mut().filter(|_| j % 2 == 0) {
                times.push(job(system, rounds, word, processes)?.0);
            }
            for (_, times, ratios) in extra.iter_mut() {
                ratios.push(times[times.len() - 1] / h.0);
            }
            hand.push(h.0);
            ours.push(o.0);
            ratios.push(o.0 / h.0);
            (hand_alloc, ours_alloc) = (h.1, o.1);
        }
        for (system, times, ratios) in extra {
            println!(
                "  ivme, {}: {:.1} µs/step, paired ratio to hand-written median {:.3}",
                match system {
                    "buckets" => "1 MB buckets",
                    _ => "1 MB buckets, overlap = true",
                },
                median(times),
                median(ratios),
            );
        }
        println!(
            "{}: hand-written {:.1} µs/step, ivme {:.1} µs/step (medians of the jobs), paired \
             ratio median {:.3}",
            case.name,
            median(hand),
            median(ours),
            median(ratios),
        );
        println!(
            "  allocated per step: hand-written {} blocks ({} large, {:.2} MB), ivme {} blocks \
             ({} large, {:.2} MB)",
            hand_alloc.allocs,
            hand_alloc.large,
            hand_alloc.bytes as f64 / 1e6,
            ours_alloc.allocs,
            ours_alloc.large,
            ours_alloc.bytes as f64 / 1e6,
        );
    }
    Ok(())
}
