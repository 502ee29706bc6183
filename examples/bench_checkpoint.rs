//! Save/load throughput of ~100 MB of f32 weights: candle's `VarMap::save`/`load` against ivme's
//! `save_model` + `load_checkpoint_in_model` and the checkpoint store (`begin`/`write_rank`/
//! `commit`, then `verify` + `read_rank`) and the Accelerator's `save_state`/`load_state`, which
//! also fsync every file and checksum everything.
//!
//! Run with `cargo run --release --example bench_checkpoint [MB] [runs]`; best of `runs`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Init, VarMap};
use ivme::checkpoint::store::write_rank;
use ivme::checkpoint::{
    begin, commit, load_checkpoint_in_model, read_rank, save_model, verify, Component,
    ManifestMeta, RankState,
};

fn best(runs: usize, mut f: impl FnMut() -> ivme::Result<()>) -> ivme::Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

fn fresh(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
}

fn main() -> ivme::Result<()> {
    let mut args = std::env::args().skip(1);
    let mb: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(100);
    let runs: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(5);
    let root = std::env::temp_dir().join(format!("ivme-bench-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&root).map_err(|e| ivme::Error::io("creating bench folder", e))?;

    // 20 layers of equal size add up to `mb` megabytes of f32.
    let per_layer = mb * 1_000_000 / 4 / 20;
    let mut varmap = VarMap::new();
    for i in 0..20 {
        let init = Init::Uniform { lo: -1.0, up: 1.0 };
        varmap.get(
            per_layer,
            &format!("layer{i:02}.weight"),
            init,
            DType::F32,
            &Device::Cpu,
        )?;
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

    let plain = root.join("varmap.safetensors");
    let candle_save = best(runs, || Ok(varmap.save(&plain)?))?;
    let candle_load = best(runs, || Ok(varmap.load(&plain)?))?;

    let model_dir = root.join("model");
    let model_save = best(runs, || save_model(&tensors, &model_dir, None).map(drop))?;
    let model_load = best(runs, || {
        load_checkpoint_in_model(&named, &model_dir, &Device::Cpu).map(drop)
    })?;

    let ckpt: PathBuf = root.join("checkpoint_0");
    let state = RankState {
        components: vec![Component {
            name: "model_0".into(),
            tensors: tensors.clone(),
            json: serde_json::Value::Null,
        }],
    };
    let store_save = best(runs, || {
        fresh(&ckpt);
        let tmp = begin(&ckpt)?;
        write_rank(&tmp, 0, &state)?;
        commit(
            &tmp,
            &ckpt,
            ManifestMeta {
                world_size: 1,
                step: 0,
                extra: serde_json::Value::Null,
            },
        )
        .map(drop)
    })?;
    let read_only = best(runs, || {
        let s = read_rank(&ckpt, 0)?;
        for ((_, var), (_, t)) in named.iter().zip(&s.components[0].tensors) {
            var.set(t)?;
        }
        Ok(())
    })?;
    let store_load = best(runs, || {
        verify(&ckpt)?;
        let s = read_rank(&ckpt, 0)?;
        for ((_, var), (_, t)) in named.iter().zip(&s.components[0].tensors) {
            var.set(t)?;
        }
        Ok(())
    })?;
    // The whole path a training program takes: the Accelerator gathers the prepared model's
    // state (and its RNG, counters) and saves/loads it through the store.
    let mut acc = ivme::Accelerator::builder().cpu(true).build()?;
    let _prepared = acc.prepare(varmap.clone())?;
    let acc_dir = root.join("state");
    let acc_save = best(runs, || {
        fresh(&acc_dir);
        acc.save_state(Some(&acc_dir)).map(drop)
    })?;
    let acc_load = best(runs, || acc.load_state(Some(&acc_dir)).map(drop))?;
    let _ = std::fs::remove_dir_all(&root);

    let mbs = |secs: f64| bytes / secs / 1e6;
    println!(
        "checkpoint bench: {:.0} MB of f32 weights, best of {runs}",
        bytes / 1e6
    );
    println!("{:<40} {:>9} {:>10} {:>8}", "", "seconds", "MB/s", "ratio");
    let rows = [
        ("candle VarMap::save", candle_save, candle_save),
        ("ivme save_model (atomic, fsync)", model_save, candle_save),
        ("ivme begin/write_rank/commit", store_save, candle_save),
        ("ivme Accelerator::save_state", acc_save, candle_save),
        ("candle VarMap::load", candle_load, candle_load),
        ("ivme load_checkpoint_in_model", model_load, candle_load),
        ("ivme read_rank (checksummed) + set", read_only, candle_load),
        ("ivme verify + read_rank + set", store_load, candle_load),
        ("ivme Accelerator::load_state", acc_load, candle_load),
    ];
    for (name, secs, base) in rows {
        println!(
            "{name:<40} {secs:>9.4} {:>10.0} {:>7.2}x",
            mbs(secs),
            secs / base
        );
    }
    Ok(())
}
