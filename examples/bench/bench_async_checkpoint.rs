//! How long a save stalls the training loop: the blocking `save_state` against the return of
//! `save_state_async` (folder prepared, state copied into host memory, writer thread started),
//! next to the bare in-memory copy of the same state: candle's `Tensor::copy` of each tensor
//! (into fresh memory, one thread) and ivme's copy into host buffers kept between saves.
//! Also shows how long the background write + commit took (`wait_for_checkpoint` called
//! right after the stall was measured, so nothing competes with the writer).
//!
//! Run with `cargo run --release --example bench_async_checkpoint [MB,MB,..] [rounds]`
//! (default `100,1000 5`); prints best and median over the rounds for each size of f32 state.

use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, Optimizer, VarMap};
use ivme::checkpoint::background::HostBuffers;
use ivme::checkpoint::{Component, RankState};
use ivme::optim::{ParamsSgd, Sgd};
use ivme::Accelerator;

/// Best and median of `xs`, in seconds.
fn best_median(xs: &mut [f64]) -> (f64, f64) {
    xs.sort_by(f64::total_cmp);
    (xs[0], xs[xs.len() / 2])
}

fn timed<T>(f: impl FnOnce() -> ivme::Result<T>) -> ivme::Result<(f64, T)> {
    let t = Instant::now();
    let out = f()?;
    Ok((t.elapsed().as_secs_f64(), out))
}

fn bench(mb: usize, rounds: usize, root: &Path) -> ivme::Result<()> {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .project_dir(root.join(format!("{mb}mb")))
        .total_limit(2)
        .build()?;
    // 20 tensors of equal size add up to `mb` megabytes of f32 weights; plain SGD keeps no
    // state of its own, so the weights are the whole state.
    let per = mb * 1_000_000 / 4 / 20;
    let varmap = VarMap::new();
    for i in 0..20 {
        let init = Init::Uniform { lo: -1.0, up: 1.0 };
        varmap.get(
            per,
            &format!("layer{i:02}.weight"),
            init,
            DType::F32,
            &Device::Cpu,
        )?;
    }
    let params = ParamsSgd {
        lr: 0.1,
        ..Default::default()
    };
    let opt = Sgd::new(varmap.all_vars(), params)?;
    let (varmap, _opt) = acc.prepare((varmap, opt))?;
    let tensors: Vec<(String, Tensor)> = {
        let data = varmap.data().lock().unwrap();
        let mut named: Vec<_> = data
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    };
    let state = || RankState {
        components: vec![Component {
            name: "model_0".into(),
            tensors: tensors.clone(),
            json: serde_json::Value::Null,
        }],
    };
    let mut buffers = HostBuffers::new();
    let (mut plain, mut kept, mut blocking, mut stall, mut background) =
        (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        // The copy a hand-written loop would make: candle's `Tensor::copy` of each tensor.
        let (t, copies) = timed(|| {
            Ok(tensors
                .iter()
                .map(|(_, t)| t.copy())
                .collect::<candle_core::Result<Vec<_>>>()?)
        })?;
        plain.push(t);
        drop(copies);
        // What the async save does: the same copy into host buffers kept between saves.
        let (t, copied) = timed(|| buffers.copy(state()))?;
        kept.push(t);
        drop(copied);
        blocking.push(timed(|| acc.save_state(None))?.0);
        let (t, _) = timed(|| acc.save_state_async(None))?;
        stall.push(t);
        let (w, _) = timed(|| acc.wait_for_checkpoint())?;
        background.push(t + w);
    }
    let row = |what: &str, xs: &mut Vec<f64>| {
        let (b, m) = best_median(xs);
        println!("  {what:<34} {b:7.3} s / {m:7.3} s");
        (b, m)
    };
    println!("{mb} MB of f32 state ({rounds} rounds), best / median:");
    let plain = row("copy, Tensor::copy (fresh memory)", &mut plain);
    let kept = row("copy into kept host buffers", &mut kept);
    let blocking = row("save_state (blocking)", &mut blocking);
    let stall = row("save_state_async stall", &mut stall);
    row("background write + commit", &mut background);
    println!(
        "  blocking / async stall: {:.1}x best, {:.1}x median; stall / Tensor::copy: {:.2} / \
         {:.2}; stall / kept-buffer copy: {:.2} / {:.2}",
        blocking.0 / stall.0,
        blocking.1 / stall.1,
        stall.0 / plain.0,
        stall.1 / plain.1,
        stall.0 / kept.0,
        stall.1 / kept.1
    );
    Ok(())
}

fn main() -> ivme::Result<()> {
    let mut args = std::env::args().skip(1);
    let sizes: Vec<usize> = args
        .next()
        .unwrap_or_else(|| "100,1000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let rounds: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(5).max(1);
    let root = std::env::temp_dir().join(format!("ivme-bench-async-{}", std::process::id()));
    for mb in sizes {
        bench(mb, rounds, &root)?;
        let _ = std::fs::remove_dir_all(&root);
    }
    Ok(())
}
