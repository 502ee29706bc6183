//! What ivme's watched collectives (deadline, control channel) cost over plain MPI calls.
//!
//! ```text
//! cargo build --release --workspace --bins --examples
//! target/release/ivme launch --num_processes 2 target/release/examples/bench_collectives
//! ```
//!
//! For a small (1 K floats, the tiny model's gradients) and a large (1.3 M floats, the wide
//! model's) all-reduce, rounds alternate ivme's `all_reduce` with a blocking
//! `MPI_Allreduce` of the same host buffer written by hand, and report median µs per call and
//! the bus bandwidth (2(N-1)/N × the buffer's bytes per call). `bench_collectives bus` adds a
//! 64 MB all-reduce, where the link's bandwidth sets the time.

use candle_core::{Device, Tensor};
use ivme::comm::ReduceOp;
use ivme::Accelerator;
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::CommunicatorCollectives;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> ivme::Result<()> {
    let accelerator = Accelerator::new()?;
    let world = SimpleCommunicator::world();
    let comm = accelerator.comm();
    let mut cases = vec![("small", 1_089usize, 2_000usize), ("large", 1_315_841, 20)];
    if std::env::args().nth(1).as_deref() == Some("bus") {
        // 64 MB: large enough that the link's bandwidth, not its latency, sets the time.
        cases.push(("64 MB", 16 << 20, 3));
    }
    for (name, n, iters) in cases {
        let t = Tensor::ones(n, candle_core::DType::F32, &Device::Cpu)?;
        let (mut ours, mut plain) = (Vec::new(), Vec::new());
        for _round in 0..7 {
            let start = Instant::now();
            for _ in 0..iters {
                comm.all_reduce(&t, ReduceOp::Mean)?;
            }
            ours.push(start.elapsed().as_secs_f64() * 1e6 / iters as f64);
            let start = Instant::now();
            for _ in 0..iters {
                // What a hand-written loop does: to the host, reduce, back into a tensor.
                let send = t.to_vec1::<f32>()?;
                let mut recv = vec![0f32; n];
                world.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
                let inv = 1.0 / accelerator.num_processes() as f32;
                recv.iter_mut().for_each(|x| *x *= inv);
                Tensor::from_vec(recv, n, &Device::Cpu)?;
            }
            plain.push(start.elapsed().as_secs_f64() * 1e6 / iters as f64);
        }
        let (o, p) = (median(ours), median(plain));
        // Bus bandwidth: the bytes each rank sends and receives in a ring all-reduce, 2(N-1)/N
        // times the buffer, over the time.
        let world_size = accelerator.num_processes() as f64;
        let bus = |us: f64| 2.0 * (world_size - 1.0) / world_size * (n * 4) as f64 / us / 1e3;
        accelerator.print(format!(
            "{name} all-reduce of {n} floats: ivme {o:.1} µs ({:.2} GB/s bus), plain MPI {p:.1} µs \
             ({:.2} GB/s bus), ratio {:.3}",
            bus(o),
            bus(p),
            o / p
        ));
    }
    Ok(())
}
