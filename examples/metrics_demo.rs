//! Exercises metrics across processes, once-only output, progress bars and tracking, printing
//! one line per result for the multi-process tests (`tests/metrics.rs`, `tests/tracking.rs`).
//!
//! ```text
//! cargo build --workspace --bins --examples
//! target/debug/ivme launch --num_processes 2 --cpu target/debug/examples/metrics_demo gather_for_metrics 10 4
//! ```
//!
//! Modes (first argument): `gather_for_metrics N BATCH`, `collectives`, `mismatch`,
//! `log main|all`, `first DIR`, `track DIR`, `progress N`. Result lines read
//! `rank{R} {name} {json}`.

use candle_core::{DType, Device, Tensor};
use ivme::comm::ReduceOp;
use ivme::data::{DataLoader, TensorDataset};
use ivme::logging::{tracing, LogConfig};
use ivme::tracking::{CsvTracker, JsonlTracker, TensorBoardTracker, Tracker};
use ivme::{Accelerator, Error, Result};
use serde_json::json;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| -> Result<&str> {
        args.get(i)
            .map(String::as_str)
            .ok_or_else(|| Error::Usage(format!("metrics_demo: argument {i} is missing")))
    };
    let num = |i: usize| -> Result<usize> {
        arg(i)?
            .parse()
            .map_err(|_| Error::Usage(format!("metrics_demo: argument {i} must be a number")))
    };
    let mut acc = Accelerator::builder().cpu(true).build()?;
    match arg(0)? {
        "gather_for_metrics" => gather_for_metrics(&mut acc, num(1)?, num(2)?),
        "collectives" => collectives(&acc),
        "mismatch" => mismatch(&acc),
        "log" => log(&acc, arg(1)? == "all"),
        "first" => first(&acc, arg(1)?),
        "track" => track(&acc, arg(1)?),
        "progress" => progress(&mut acc, num(1)?),
        other => Err(Error::Usage(format!(
            "metrics_demo: unknown mode `{other}`"
        ))),
    }
}

fn show(acc: &Accelerator, name: &str, value: serde_json::Value) -> Result<()> {
    println!("rank{} {name} {value}", acc.process_index());
    Ok(())
}

fn flat(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// Gathers each batch's sample ids, with and without dropping the even_batches padding.
fn gather_for_metrics(acc: &mut Accelerator, n: usize, batch: usize) -> Result<()> {
    let ids = Tensor::arange(0u32, n as u32, &Device::Cpu)?;
    let mut loader = acc.prepare(DataLoader::new(TensorDataset::new(ids)?, batch))?;
    let (mut kept, mut raw) = (Vec::new(), Vec::new());
    for batch in loader.iter() {
        let batch = batch?;
        kept.extend(acc.gather_for_metrics(&batch)?.to_vec1::<u32>()?);
        raw.extend(acc.gather(&batch)?.to_vec1::<u32>()?);
    }
    show(acc, "kept", json!(kept))?;
    show(acc, "raw", json!(raw))
}

fn collectives(acc: &Accelerator) -> Result<()> {
    let r = acc.process_index();
    let dev = Device::Cpu;
    // Rank r holds r + 1 rows of two values r * 100 + i.
    let rows = Tensor::arange(0f32, 2. * (r as f32 + 1.), &dev)?
        .affine(1., 100. * r as f64)?
        .reshape((r + 1, 2))?;
    show(acc, "gather", json!(flat(&acc.gather(&rows)?)?))?;
    show(
        acc,
        "gather_scalar",
        json!(flat(&acc.gather(&Tensor::new(r as f32, &dev)?)?)?),
    )?;

    let v = Tensor::new(&[r as f32 + 1., 10. - r as f32, (r * r) as f32], &dev)?;
    for (name, op) in [
        ("sum", ReduceOp::Sum),
        ("mean", ReduceOp::Mean),
        ("max", ReduceOp::Max),
        ("min", ReduceOp::Min),
    ] {
        show(acc, name, json!(flat(&acc.reduce(&v, op)?)?))?;
    }

    let end = acc.pad_across_processes(&rows, 0, -1., false)?;
    let start = acc.pad_across_processes(&rows, 0, -1., true)?;
    show(acc, "pad_end", json!((end.dims(), flat(&end)?)))?;
    show(acc, "pad_first", json!((start.dims(), flat(&start)?)))?;

    // Only rank 1's tensor counts; the others pass a placeholder of another shape.
    let mine = if r == 1 {
        Tensor::new(&[[7f32, 8., 9.]], &dev)?
    } else {
        Tensor::zeros(1, DType::F32, &dev)?
    };
    let got = acc.broadcast(&mine, 1)?;
    show(acc, "broadcast", json!((got.dims(), flat(&got)?)))?;

    let items: Vec<u32> = (0..7).collect();
    show(acc, "split", json!(acc.split_between_processes(&items)))?;
    show(
        acc,
        "split_padded",
        json!(acc.split_between_processes_padded(&items)),
    )?;
    show(
        acc,
        "objects",
        json!(acc.gather_object(&(r, format!("r{r}")))?),
    )?;
    let last = acc.num_processes() - 1;
    let greeting = format!("hello from {r}");
    let sent = acc.broadcast_object(acc.on_last_process(|| &greeting), last)?;
    show(acc, "broadcast_object", json!(sent))
}

/// Each call has rank 1 disagree; every rank must get an error and carry on.
fn mismatch(acc: &Accelerator) -> Result<()> {
    let r = acc.process_index();
    let dev = Device::Cpu;
    let report = |name: &str, res: Result<Tensor>| match res {
        Ok(t) => show(
            acc,
            name,
            json!(format!("unexpected success {:?}", t.dims())),
        ),
        Err(e) => show(acc, name, json!(e.to_string())),
    };
    report(
        "gather",
        acc.gather(&Tensor::zeros((2, 2 + r), DType::F32, &dev)?),
    )?;
    report(
        "reduce",
        acc.reduce(&Tensor::zeros(3 + r, DType::F32, &dev)?, ReduceOp::Sum),
    )?;
    let dims: Vec<usize> = vec![2; 1 + r];
    report(
        "pad",
        acc.pad_across_processes(&Tensor::zeros(dims, DType::F32, &dev)?, 0, 0., false),
    )?;
    acc.wait_for_everyone()?;
    show(acc, "done", json!(true))
}

fn log(acc: &Accelerator, all: bool) -> Result<()> {
    let installed = acc.init_logging(LogConfig::new().all_ranks(all))?;
    let again = acc.init_logging(LogConfig::new())?;
    tracing::info!("hello from rank {}", acc.process_index());
    tracing::debug!("debug detail from rank {}", acc.process_index());
    show(acc, "installed", json!((installed, again)))
}

fn first(acc: &Accelerator, dir: &str) -> Result<()> {
    let flag = std::path::Path::new(dir).join("flag");
    let saw = acc.main_process_first(|| {
        if acc.is_main_process() {
            // Slow on purpose: a rank that did not wait would look before the file exists.
            std::thread::sleep(std::time::Duration::from_millis(300));
            std::fs::write(&flag, "ready").map_err(|e| Error::io("writing flag", e))?;
        }
        Ok::<_, Error>(flag.exists())
    })??;
    show(acc, "saw_flag", json!(saw))?;
    show(acc, "on_main", json!(acc.on_main_process(|| "main")))?;
    show(
        acc,
        "on_local_main",
        json!(acc.on_local_main_process(|| "local main")),
    )?;
    show(acc, "on_1", json!(acc.on_process(1, || "one")))?;
    show(acc, "on_last", json!(acc.on_last_process(|| "last")))
}

/// Rank R tracks under `DIR/rankR`, so the test sees which ranks created anything.
fn track(acc: &Accelerator, dir: &str) -> Result<()> {
    let base = std::path::Path::new(dir).join(format!("rank{}", acc.process_index()));
    let trackers: Vec<Box<dyn Tracker>> = vec![
        Box::new(JsonlTracker::new(&base)),
        Box::new(CsvTracker::new(&base)),
        Box::new(TensorBoardTracker::new(&base)),
    ];
    let config = serde_json::json!({ "lr": 0.5, "processes": acc.num_processes() });
    acc.init_trackers("demo", &config, trackers)?;
    for step in 0..4u64 {
        let mut values = vec![
            ("loss", 1. / (step + 1) as f64),
            ("acc", step as f64 * 0.25),
        ];
        if step >= 2 {
            values.push(("extra", step as f64 * 10.));
        }
        acc.log(values, step)?;
    }
    acc.end_training()?;
    show(acc, "tracked", json!(true))
}

fn progress(acc: &mut Accelerator, n: usize) -> Result<()> {
    let xs = Tensor::arange(0f32, n as f32, &Device::Cpu)?;
    let mut loader = acc.prepare(DataLoader::new(TensorDataset::new(xs)?, 2))?;
    let batches = acc.progress(loader.iter());
    let visible = batches.is_visible();
    let bar = batches.handle();
    let mut count = 0;
    for batch in batches {
        let loss = batch?.sum_all()?.to_scalar::<f32>()?;
        bar.set_loss(loss as f64);
        count += 1;
    }
    show(acc, "progress", json!((count, visible)))
}
