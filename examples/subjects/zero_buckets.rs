//! A sharded run whose sync spans many buckets, for the multi-process tests: eight matrices of
//! awkward widths (so buckets, rank slices and variables all cut each other), trained with AdamW
//! on batches drawn from a fixed formula, bucket size 1 MB unless set. Each rank writes its
//! final weights to `out/rank{R}.safetensors` and, in `out/rank{R}.json`, the most its resident
//! memory grew during one `backward` call (the optimizer step and the sync happen inside it
//! under sharding) above what it held before the call, after the first step, the largest block
//! allocated during such a call, and what it holds once training is over (the weights and the
//! training state).
//!
//! Under `overlap=1` the report also says how many optimizer parts stepped while a later bucket
//! was still being averaged.
//!
//! Arguments are `key=value`: `stage=no|optimizer|gradients scale=S steps=K batch=B
//! precision=no|bf16 bucket=MB overlap=0|1 accum=A halve=0|1 out=DIR` (`steps` counts
//! micro-batches; `halve=1` halves the learning rate after every optimizer step).

use candle_core::{DType, Tensor};
use candle_nn::{Init, Optimizer, VarMap};
use ivme::optim::{AdamW, ParamsAdamW};
use ivme::{Accelerator, Precision, Sharding};
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, noting the largest block asked for.
struct Largest;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Largest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Largest = Largest;

#[path = "../support/formula_model.rs"]
mod formula_model;
use formula_model::{init, loss, rows, INPUT, WIDTHS};

/// This process's resident and peak resident memory, in bytes.
fn memory() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Lets the peak resident memory start again from the current one.
fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn main() -> ivme::Result<()> {
    let args: BTreeMap<String, String> = std::env::args()
        .skip(1)
        .filter_map(|a| a.split_once('=').map(|(k, v)| (k.into(), v.into())))
        .collect();
    let get = |k: &str, d: &str| args.get(k).cloned().unwrap_or_else(|| d.to_string());
    let stage: Sharding = get("stage", "gradients").parse()?;
    let precision: Precision = get("precision", "no").parse()?;
    let scale: usize = get("scale", "1").parse().expect("scale is a number");
    let steps: usize = get("steps", "3").parse().expect("steps is a number");
    let batch: usize = get("batch", "4").parse().expect("batch is a number");
    let out = PathBuf::from(get("out", "."));
    let bucket: usize = get("bucket", "1")
        .parse()
        .expect("bucket is a number of MB");

    let mut acc = Accelerator::builder()
        .sharding(stage)
        .precision(precision)
        .bucket_size_mb(bucket)
        .overlap(get("overlap", "0") == "1")
        .grad_accum(get("accum", "1").parse().expect("accum is a number"))
        .build()?;
    let varmap = VarMap::new();
    let vb = acc.var_builder(&varmap, DType::F32);
    let mut ws = Vec::new();
    for (i, w) in WIDTHS.iter().enumerate() {
        let v = vb.get_with_hints((INPUT, w * scale), &format!("w{i}"), Init::Const(0.0))?;
        let start = init(i, scale)?.to_dtype(v.dtype())?;
        varmap.data().lock().expect("varmap")[&format!("w{i}")].set(&start)?;
        ws.push(v);
    }
    let opt = AdamW::new(varmap.all_vars(), ParamsAdamW::default())?;
    let (_varmap, mut opt) = acc.prepare((varmap.clone(), opt))?;
    // `halve=1`: the learning rate halves after every optimizer step.
    let mut schedule = match get("halve", "0").as_str() {
        "1" => Some(ivme::optim::LrScheduler::new(
            &opt,
            ivme::optim::StepLr::new(1, 0.5)?,
        )),
        _ => None,
    };
    let world = acc.num_processes();
    let rank = acc.process_index();
    let dtype = acc.param_dtype(DType::F32);
    let (mut grew, mut largest) = (0u64, 0usize);
    for step in 0..steps {
        let x = rows(step * batch * world + rank * batch, batch)?.to_dtype(dtype)?;
        let loss = loss(&x, &ws)?;
        acc.wait_for_everyone()?;
        let (before, _) = memory();
        reset_peak();
        LARGEST.store(0, Ordering::Relaxed);
        let grads = acc.backward(&loss)?;
        opt.step(&grads)?;
        if let Some(s) = schedule.as_mut() {
            s.step();
        }
        let (_, peak) = memory();
        if step > 0 {
            grew = grew.max(peak.saturating_sub(before));
            largest = largest.max(LARGEST.load(Ordering::Relaxed));
        }
    }
    let (held, _) = memory();
    let weights: std::collections::HashMap<String, Tensor> = varmap
        .data()
        .lock()
        .expect("varmap")
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.as_tensor().to_dtype(DType::F32)?)))
        .collect::<candle_core::Result<_>>()?;
    std::fs::create_dir_all(&out).map_err(|e| ivme::Error::io("creating out", e))?;
    candle_core::safetensors::save(&weights, out.join(format!("rank{rank}.safetensors")))?;
    let params: usize = WIDTHS.iter().map(|w| INPUT * w * scale).sum();
    let overlapped = acc.step_times().overlapped;
    let report = serde_json::json!({
        "grew": grew, "held": held, "largest": largest, "params": params,
        "overlapped": overlapped,
    });
    std::fs::write(out.join(format!("rank{rank}.json")), report.to_string())
        .map_err(|e| ivme::Error::io("writing the report", e))?;
    Ok(())
}
