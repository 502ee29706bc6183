//! Data-parallel training through ivme against the loop a competent Rust user writes by hand
//! with candle and MPI, in one job.
//!
//! ```text
//! cargo build --release --workspace --bins --examples
//! target/release/ivme launch --num_processes 2 target/release/examples/bench_ddp [rounds] [tiny|wide]
//! ```
//!
//! The hand-written loop: candle's forward and backward, every gradient copied to one host
//! buffer (variables in name order), one blocking `MPI_Allreduce` into a second buffer kept
//! across steps, the mean rebuilt as tensors, candle-nn's AdamW. The ivme loop: the same model
//! and batches through a prepared AdamW and `Accelerator::backward`. Rounds alternate the two
//! (which goes first alternates too) and every round starts at a barrier. Reported per model:
//! min and median µs per step of each, the median of the per-round ratios, and what each step
//! allocates (counted by a global allocator).

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

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn main() -> ivme::Result<()> {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(9);
    let mut acc = Accelerator::new()?;
    let world = SimpleCommunicator::world();
    let (rank, size) = (acc.process_index(), acc.num_processes());
    acc.print(format!(
        "ivme vs hand-written candle + MPI data parallelism, {size} process(es), \
         RAYON_NUM_THREADS={}, {rounds} alternating rounds",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "unset".into())
    ));
    let cases = [
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
    ];
    // An optional second argument keeps only the cases whose name starts with it.
    let only = std::env::args().nth(2).unwrap_or_default();
    for case in cases.iter().filter(|c| c.name.starts_with(only.as_str())) {
        let data = batches(case, rank, size)?;
        let (mut hand_loop, mut our_loop) = (Hand::new(case)?, Ours::new(&mut acc, case)?);
        // Warm-up: one round of each.
        hand_loop.round(&world, &data)?;
        our_loop.round(&mut acc, &data)?;
        let (mut hand, mut ours, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        let (mut hand_alloc, mut ours_alloc) = (Counts::default(), Counts::default());
        for round in 0..rounds {
            let (h, o) = if round % 2 == 0 {
                let h = hand_loop.round(&world, &data)?;
                (h, our_loop.round(&mut acc, &data)?)
            } else {
                let o = our_loop.round(&mut acc, &data)?;
                (hand_loop.round(&world, &data)?, o)
            };
            hand.push(h.0);
            ours.push(o.0);
            ratios.push(o.0 / h.0);
            (hand_alloc, ours_alloc) = (h.1, o.1);
        }
        acc.print(format!(
            "{}: hand-written min {:.1} / median {:.1} µs/step, ivme min {:.1} / median {:.1} \
             µs/step, paired ratio median {:.3} (min-to-min {:.3})",
            case.name,
            min(&hand) * 1e6,
            median(hand.clone()) * 1e6,
            min(&ours) * 1e6,
            median(ours.clone()) * 1e6,
            median(ratios),
            min(&ours) / min(&hand),
        ));
        acc.print(format!(
            "  allocated per step: hand-written {} blocks ({} large, {:.2} MB), ivme {} blocks \
             ({} large, {:.2} MB)",
            hand_alloc.allocs,
            hand_alloc.large,
            hand_alloc.bytes as f64 / 1e6,
            ours_alloc.allocs,
            ours_alloc.large,
            ours_alloc.bytes as f64 / 1e6,
        ));
    }
    Ok(())
}
