//! Building a model's variables: ivme's seeded `var_builder` against candle's own
//! `VarBuilder::from_varmap`, measured in one run.
//!
//! `cargo run --release --example bench_init [MILLIONS]` builds an MLP of about MILLIONS
//! million parameters (default 64) both ways on the Accelerator's device, alternating the two
//! over 5 rounds so machine noise hits both alike, and prints each median and their ratio.
//! Set `RAYON_NUM_THREADS` to see how the seeded draw scales with cores.

use candle_core::DType;
use candle_nn::{VarBuilder, VarMap};
use ivme::Accelerator;
use std::time::Instant;

#[path = "../support/mlp.rs"]
mod mlp;
use mlp::Mlp;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> ivme::Result<()> {
    let millions: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(64);
    // Square layers of width w: about w * w parameters each, four of them.
    let width = ((millions * 1_000_000 / 4) as f64).sqrt() as usize;
    let dims = vec![width; 5];
    let acc = Accelerator::builder().seed(1).build()?;
    let (mut plain, mut seeded) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let start = Instant::now();
        let varmap = VarMap::new();
        Mlp::new(
            VarBuilder::from_varmap(&varmap, DType::F32, acc.device()),
            &dims,
        )?;
        acc.device().synchronize()?;
        plain.push(start.elapsed().as_secs_f64());

        let start = Instant::now();
        let varmap = VarMap::new();
        Mlp::new(acc.var_builder(&varmap, DType::F32), &dims)?;
        acc.device().synchronize()?;
        seeded.push(start.elapsed().as_secs_f64());
    }
    let (p, s) = (median(plain), median(seeded));
    println!(
        "{} parameters on {:?}, {} rayon threads: candle's initialisers {:.1} ms, ivme's seeded \
         var_builder {:.1} ms, ratio {:.2}",
        4 * width * (width + 1),
        acc.device().location(),
        rayon_threads(),
        p * 1e3,
        s * 1e3,
        s / p
    );
    Ok(())
}

fn rayon_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}
