//! Save/load time of a model's f32 weights: ivme's `save_state`/`load_state` against candle's
//! `VarMap::save` (plus one fsync of the file it wrote, so both pay for the disk) and
//! `VarMap::load`, and ivme's model files (`save_model`/`load_checkpoint_in_model`).
//!
//! Run with `cargo run --release --example bench_checkpoint [MB[,MB...]] [rounds]` (default
//! `100 5`; e.g. `100,1000 5` benches both sizes in one run). Each round runs every contender
//! once, alternating which goes first, and the table gives the best and the median round.
//! Loads read files the previous save left in the page cache (warm cache): this bench cannot
//! drop it.

use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Init, VarMap};
use ivme::checkpoint::{load_checkpoint_in_model, save_model};

/// What one contender took in each round, in seconds.
#[derive(Default)]
struct Times(Vec<f64>);

impl Times {
    fn time(&mut self, f: impl FnOnce() -> ivme::Result<()>) -> ivme::Result<()> {
        let t = Instant::now();
        f()?;
        self.0.push(t.elapsed().as_secs_f64());
        Ok(())
    }
    fn min(&self) -> f64 {
        self.0.iter().copied().fold(f64::INFINITY, f64::min)
    }
    fn median(&self) -> f64 {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        }
    }
}

fn fresh(path: &Path) {
    let _ = std::fs::remove_dir_all(path);
    let _ = std::fs::remove_file(path);
}

fn fsync(path: &Path) -> ivme::Result<()> {
    let io = |e| ivme::Error::io(format!("syncing {}", path.display()), e);
    std::fs::File::open(path)
        .map_err(io)?
        .sync_all()
        .map_err(io)
}

fn bench(mb: usize, rounds: usize, root: &Path) -> ivme::Result<()> {
    // 20 layers of equal size add up to `mb` megabytes of f32.
    let per_layer = mb * 1_000_000 / 4 / 20;
    let mut varmap = VarMap::new();
    for i in 0..20 {
        let init = Init::Uniform { lo: -1.0, up: 1.0 };
        let name = format!("layer{i:02}.weight");
        varmap.get(per_layer, &name, init, DType::F32, &Device::Cpu)?;
    }
    let mut named: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let tensors: Vec<(String, Tensor)> = named
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    let bytes = (per_layer * 20 * 4) as f64;
    // The whole path a training program takes: the Accelerator gathers the prepared model's
    // state (and its RNG, counters) and saves/loads it through the checkpoint store.
    let mut acc = ivme::Accelerator::builder().cpu(true).build()?;
    let _prepared = acc.prepare(varmap.clone())?;

    let plain = root.join("varmap.safetensors");
    let model_dir = root.join("model");
    let state_dir = root.join("state");
    let [mut c_save, mut i_save, mut c_load, mut i_load, mut m_save, mut m_load] =
        std::array::from_fn(|_| Times::default());
    for round in 0..rounds {
        // Alternate who goes first, so drift in the machine's load falls on both.
        for turn in 0..2 {
            if (round + turn) % 2 == 0 {
                fresh(&plain);
                c_save.time(|| {
                    varmap.save(&plain)?;
                    fsync(&plain)
                })?;
                fresh(&model_dir);
                m_save.time(|| save_model(&tensors, &model_dir, None).map(drop))?;
            } else {
                fresh(&state_dir);
                i_save.time(|| acc.save_state(Some(&state_dir)).map(drop))?;
            }
        }
        for turn in 0..2 {
            if (round + turn) % 2 == 0 {
                c_load.time(|| Ok(varmap.load(&plain)?))?;
                m_load.time(|| {
                    load_checkpoint_in_model(&named, &model_dir, &Device::Cpu).map(drop)
                })?;
            } else {
                i_load.time(|| acc.load_state(Some(&state_dir)).map(drop))?;
            }
        }
    }
    for p in [&plain, &model_dir, &state_dir] {
        fresh(p);
    }

    println!(
        "\n{:.0} MB of f32 weights in 20 tensors, {rounds} alternating rounds (loads warm-cache)",
        bytes / 1e6
    );
    println!(
        "{:<38} {:>8} {:>8} {:>7} {:>14}",
        "", "min s", "median s", "MB/s", "÷ baseline"
    );
    let rows = [
        ("candle VarMap::save + fsync (baseline)", &c_save, &c_save),
        ("ivme Accelerator::save_state", &i_save, &c_save),
        ("ivme save_model (atomic, fsync)", &m_save, &c_save),
        ("candle VarMap::load (baseline)", &c_load, &c_load),
        ("ivme Accelerator::load_state", &i_load, &c_load),
        ("ivme load_checkpoint_in_model", &m_load, &c_load),
    ];
    for (name, t, base) in rows {
        println!(
            "{name:<38} {:>8.4} {:>8.4} {:>7.0} {:>5.2}x /{:>5.2}x",
            t.min(),
            t.median(),
            bytes / t.min() / 1e6,
            t.min() / base.min(),
            t.median() / base.median()
        );
    }
    let verdict = |what: &str, t: &Times, base: &Times, target: f64| {
        let (best, mid) = (t.min() / base.min(), t.median() / base.median());
        let met = if mid <= target { "met" } else { "missed" };
        println!("{what}: {best:.2}x (min) / {mid:.2}x (median), target <= {target}x: {met}");
    };
    verdict("save_state", &i_save, &c_save, 1.3);
    verdict("load_state", &i_load, &c_load, 1.5);
    Ok(())
}

fn main() -> ivme::Result<()> {
    let mut args = std::env::args().skip(1);
    let sizes: Vec<usize> = args
        .next()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![100]);
    let rounds: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(5).max(1);
    let root = std::env::temp_dir().join(format!("ivme-bench-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&root).map_err(|e| ivme::Error::io("creating bench folder", e))?;
    let result = sizes.iter().try_for_each(|&mb| bench(mb, rounds, &root));
    let _ = std::fs::remove_dir_all(&root);
    result
}
