//! Save/load time of a model's f32 weights: ivme's `save_state`/`load_state` against candle's
//! `VarMap::save` (plus one fsync of the file it wrote, so both pay for the disk) and
//! `VarMap::load`, and ivme's model files (`save_model`/`load_checkpoint_in_model`).
//!
//! Run with `cargo run --release --example bench_checkpoint [MB[,MB...]] [rounds]` (default
//! `100 5`; e.g. `100,1000 5` benches both sizes in one run). Every save and every load runs in
//! a process of its own, as a program's resume does (its memory fresh, no allocator state left
//! by the other contender), rounds alternating the order; the table gives the best and the
//! median round. Two allocator settings: as each program starts by itself (glibc's defaults for
//! plain candle; ivme tunes glibc when the Accelerator is built), and glibc tuned for both by
//! `ivme launch`'s variables. Loads read files the previous save left in the page cache (warm
//! cache): this bench cannot drop it.
//!
//! `bench_checkpoint one MODE MB DIR` runs one contender and prints its seconds.

#[path = "../support/rounds.rs"]
mod rounds;

use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Init, VarMap};
use ivme::checkpoint::{load_checkpoint_in_model, save_model};

/// The contenders: what each does, and the baseline it is compared with.
const MODES: [(&str, &str); 6] = [
    ("save-candle", "save-candle"),
    ("save-state", "save-candle"),
    ("save-model", "save-candle"),
    ("load-candle", "load-candle"),
    ("load-state", "load-candle"),
    ("load-model", "load-candle"),
];

/// 20 layers of equal size adding up to `mb` megabytes of f32, with their names.
fn model(mb: usize) -> ivme::Result<(VarMap, Vec<(String, Var)>)> {
    let per_layer = mb * 1_000_000 / 4 / 20;
    let varmap = VarMap::new();
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
    Ok((varmap, named))
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

/// One contender in this process: builds the model (and, for ivme's state, an Accelerator
/// with it prepared), then times only the save or the load.
fn one(mode: &str, mb: usize, dir: &Path) -> ivme::Result<()> {
    let (mut varmap, named) = model(mb)?;
    let plain = dir.join("varmap.safetensors");
    let model_dir = dir.join("model");
    let state_dir = dir.join("state");
    let mut acc = None;
    if mode.ends_with("-state") {
        let mut a = ivme::Accelerator::builder().cpu(true).build()?;
        let _prepared = a.prepare(varmap.clone())?;
        acc = Some(a);
    }
    let t = Instant::now();
    match (mode, acc.as_mut()) {
        ("save-candle", _) => {
            fresh(&plain);
            let t = Instant::now();
            varmap.save(&plain)?;
            fsync(&plain)?;
            println!("{}", t.elapsed().as_secs_f64());
            return Ok(());
        }
        ("save-model", _) => {
            fresh(&model_dir);
            let tensors: Vec<(String, Tensor)> = named
                .iter()
                .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
                .collect();
            let t = Instant::now();
            save_model(&tensors, &model_dir, None)?;
            println!("{}", t.elapsed().as_secs_f64());
            return Ok(());
        }
        ("save-state", Some(acc)) => {
            fresh(&state_dir);
            let t = Instant::now();
            acc.save_state(Some(&state_dir))?;
            println!("{}", t.elapsed().as_secs_f64());
            return Ok(());
        }
        ("load-candle", _) => varmap.load(&plain)?,
        ("load-model", _) => drop(load_checkpoint_in_model(&named, &model_dir, &Device::Cpu)?),
        ("load-state", Some(acc)) => drop(acc.load_state(Some(&state_dir))?),
        _ => return Err(ivme::Error::Usage(format!("unknown mode {mode}"))),
    }
    println!("{}", t.elapsed().as_secs_f64());
    Ok(())
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Every contender `rounds` times, each in its own process, under `envs`.
fn bench(
    mb: usize,
    rounds: usize,
    dir: &Path,
    label: &str,
    envs: &[(&str, &str)],
) -> ivme::Result<()> {
    let dir_arg = dir.display().to_string();
    let mb_arg = mb.to_string();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); MODES.len()];
    for round in 0..rounds {
        // Saves first (a load reads what they wrote), each group in a rotating order.
        for group in [0..3, 3..6] {
            let n = group.len();
            for k in 0..n {
                let i = group.start + (k + round) % n;
                let args = ["one", MODES[i].0, &mb_arg, &dir_arg];
                times[i].push(rounds::in_own_process(&args, envs)?);
            }
        }
    }
    println!(
        "\n{mb} MB of f32 weights in 20 tensors, {rounds} rounds, one process per run, {label}"
    );
    println!("| run | min s | median s | ÷ baseline min / median |");
    println!("|---|---|---|---|");
    for (i, (mode, base)) in MODES.iter().enumerate() {
        let b = MODES.iter().position(|(m, _)| m == base).unwrap_or(i);
        println!(
            "| {mode} | {:.4} | {:.4} | {:.2}x / {:.2}x |",
            min(&times[i]),
            median(&times[i]),
            min(&times[i]) / min(&times[b]),
            median(&times[i]) / median(&times[b])
        );
    }
    let ratio = |i: usize, b: usize| median(&times[i]) / median(&times[b]);
    println!(
        "save_state {:.2}x (target <= 1.3), load_state {:.2}x (target <= 1.5), medians",
        ratio(1, 0),
        ratio(4, 3)
    );
    Ok(())
}

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("one") {
        let mb = args[2].parse().unwrap_or(100);
        return one(&args[1], mb, Path::new(&args[3]));
    }
    let sizes: Vec<usize> = args
        .first()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![100]);
    let rounds: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(5).max(1);
    let root = std::env::temp_dir().join(format!("ivme-bench-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&root).map_err(|e| ivme::Error::io("creating bench folder", e))?;
    let tuned = [
        ("MALLOC_MMAP_THRESHOLD_", "33554432"),
        ("MALLOC_TRIM_THRESHOLD_", "17179869184"),
    ];
    let result = sizes.iter().try_for_each(|&mb| {
        bench(mb, rounds, &root, "as each program starts by itself", &[])?;
        bench(
            mb,
            rounds,
            &root,
            "glibc tuned for both (ivme launch's variables)",
            &tuned,
        )
    });
    let _ = std::fs::remove_dir_all(&root);
    result
}
