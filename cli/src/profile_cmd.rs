//! `ivme profile DIR`: a profile's summary, every rank's Chrome trace in one file, and one
//! picture (SVG) of the ranks' phases over their last steps above the run's loss curve. Also
//! the summary `ivme launch --profile DIR` prints after a job that did not print its own.

use crate::cli;
use clap::Parser;
use ivme::profile::{chrome_trace, read_dir, RankRecord, SpanKind, Summary};
use ivme::{Error, Result};
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// The subcommand's name.
pub const COMMAND: &str = "profile";

/// Summarise and draw a profile that `ivme launch --profile DIR` (or IVME_PROFILE) recorded.
#[derive(Parser, Debug)]
#[command(rename_all = "snake_case", after_help = NOTES)]
struct Flags {
    /// the picture to write (default DIR/profile.svg)
    #[arg(long, value_name = "file.svg")]
    out: Option<PathBuf>,
    /// how many of the last optimizer steps the timeline shows
    #[arg(long, value_name = "n", default_value_t = 4)]
    steps: usize,
    /// the logged value drawn below the timeline
    #[arg(long, value_name = "name", default_value = "loss")]
    metric: String,
    /// the profile folder
    #[arg(value_name = "DIR")]
    dir: Option<PathBuf>,
}

const NOTES: &str = "Prints the summary (every rank's milliseconds per step by phase, the time each
waited at the gradient sync for a slower rank, the rank the others wait for, steps/s and
samples/s), writes DIR/trace.json (every rank's Chrome trace in one file: open it at
ui.perfetto.dev or chrome://tracing) and draws DIR/profile.svg: each rank's phases over the last
--steps optimizer steps, and the --metric values the program logged (`accelerator.log`).";

/// The colour of each kind of span in the picture.
fn colour(kind: SpanKind) -> RGBColor {
    match kind {
        SpanKind::Data => RGBColor(230, 159, 0),
        SpanKind::Backward => RGBColor(0, 114, 178),
        SpanKind::Sync => RGBColor(0, 158, 115),
        SpanKind::Collective => RGBColor(213, 94, 0),
        SpanKind::Optimizer => RGBColor(204, 121, 167),
        SpanKind::Checkpoint => RGBColor(86, 180, 233),
        SpanKind::Recompute => RGBColor(0, 60, 110),
    }
}

/// Runs `ivme profile` with the words after the command name.
pub fn main(words: &[String]) -> Result<i32> {
    let Some(flags) = cli::read::<Flags>(COMMAND, words)? else {
        return Ok(0);
    };
    let Some(dir) = &flags.dir else {
        return Err(Error::Usage(format!(
            "expected the profile folder, e.g. `ivme {COMMAND} runs/profile`"
        )));
    };
    let records = read_dir(dir)?;
    let steps: Vec<_> = records.iter().map(RankRecord::rank_steps).collect();
    print!("{}", Summary::of(&steps).table());
    let trace = dir.join("trace.json");
    write(&trace, &serde_json::to_vec(&chrome_trace(&records))?)?;
    let out = flags.out.clone().unwrap_or_else(|| dir.join("profile.svg"));
    let metric = metric_values(dir, &flags.metric)?;
    draw(&records, flags.steps.max(1), &flags.metric, &metric, &out)?;
    println!(
        "wrote {} (every rank's trace) and {}",
        trace.display(),
        out.display()
    );
    Ok(0)
}

/// After `ivme launch --profile DIR`: the summary, unless the program's `end_training`
/// printed it; records older than the launch are someone else's.
pub fn after_launch(dir: &Path, started: std::time::SystemTime) {
    let fresh = |p: &Path| {
        std::fs::metadata(p)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t >= started)
    };
    if fresh(&dir.join("summary.txt")) {
        return;
    }
    let records: Vec<RankRecord> = match read_dir(dir) {
        Ok(r) => r
            .into_iter()
            .filter(|r| fresh(&RankRecord::path(dir, r.rank)))
            .collect(),
        Err(_) => Vec::new(),
    };
    if records.is_empty() {
        eprintln!(
            "ivme: no rank wrote a profile into {} (a rank writes it at end_training or when \
             its Accelerator is dropped; a killed rank writes none)",
            dir.display()
        );
        return;
    }
    let world = records[0].world_size;
    let steps: Vec<_> = records.iter().map(RankRecord::rank_steps).collect();
    print!("{}", Summary::of(&steps).table());
    if records.len() < world {
        let have: Vec<String> = records.iter().map(|r| r.rank.to_string()).collect();
        println!(
            "(only rank(s) {} of {world} left a profile in {}: the others ran on other \
             machines or were killed)",
            have.join(", "),
            dir.display()
        );
    }
    println!("(`ivme profile {}` draws it)", dir.display());
}

fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// The (step, value) pairs of `name` the main process logged (`metrics.jsonl`), if any.
fn metric_values(dir: &Path, name: &str) -> Result<Vec<(f64, f64)>> {
    let path = dir.join("metrics.jsonl");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(format!("reading {}", path.display()), e)),
    };
    let mut points = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            Error::Usage(format!(
                "{} has a line that is not JSON: {e}",
                path.display()
            ))
        })?;
        if let (Some(step), Some(value)) = (v["step"].as_f64(), v["values"][name].as_f64()) {
            points.push((step, value));
        }
    }
    Ok(points)
}

fn drawing(e: impl std::fmt::Display) -> Error {
    Error::Usage(format!("drawing the profile: {e}"))
}

/// The timeline of the last `last` steps of rank 0 (every rank over the same wall-clock
/// window) above the metric's curve.
fn draw(
    records: &[RankRecord],
    last: usize,
    metric: &str,
    points: &[(f64, f64)],
    out: &Path,
) -> Result<()> {
    let base = records.iter().map(|r| r.origin_unix_ns).min().unwrap_or(0);
    let shift = |r: &RankRecord, ns: u64| (r.origin_unix_ns - base + ns) as f64 / 1e6;
    let first = &records[0];
    let steps = first.steps();
    let (from, to) = match (steps.len().checked_sub(last), steps.last()) {
        (Some(k), Some(end)) => (
            shift(first, steps[k].start_ns),
            shift(first, end.start_ns + end.wall_ns),
        ),
        (None, Some(end)) => (
            shift(first, steps[0].start_ns),
            shift(first, end.start_ns + end.wall_ns),
        ),
        _ => {
            let end = first.spans.iter().map(|s| s.end_ns()).max().unwrap_or(1);
            (0.0, shift(first, end))
        }
    };
    let lanes = records.len();
    let height = 160 + 36 * lanes as u32 + 300;
    let root = SVGBackend::new(out, (1200, height)).into_drawing_area();
    root.fill(&WHITE).map_err(drawing)?;
    let (top, bottom) = root.split_vertically(140 + 36 * lanes as u32);
    let mut chart = ChartBuilder::on(&top)
        .caption(
            format!("phases of each rank over the last {last} optimizer steps (ms; white: forward and the loop's own code)"),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..(to - from).max(1e-3) * 1.15, -0.5..lanes as f64 - 0.5)
        .map_err(drawing)?;
    // Lane k (from the top) is rank k, centred on y = lanes - 1 - k.
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(lanes)
        .y_label_formatter(&|y| match (*y - y.round()).abs() < 1e-6 {
            true => format!("rank {}", lanes as i64 - 1 - y.round() as i64),
            false => String::new(),
        })
        .draw()
        .map_err(drawing)?;
    let width = to - from;
    // Collectives sit inside their sync: drawn after it, narrower, on top.
    for collectives in [false, true] {
        for (lane, r) in records.iter().enumerate() {
            let y = (lanes - 1 - lane) as f64;
            let boxes = r
                .spans
                .iter()
                .filter(|s| (s.kind == SpanKind::Collective) == collectives)
                .filter_map(|s| {
                    let (x0, x1) = (shift(r, s.start_ns) - from, shift(r, s.end_ns()) - from);
                    let (lo, hi) = match collectives {
                        true => (y - 0.2, y + 0.2),
                        false => (y - 0.4, y + 0.4),
                    };
                    (x1 >= 0.0 && x0 <= width).then(|| {
                        Rectangle::new(
                            [(x0.max(0.0), lo), (x1.min(width), hi)],
                            colour(s.kind).filled(),
                        )
                    })
                });
            chart.draw_series(boxes).map_err(drawing)?;
        }
    }
    // One legend entry per kind.
    for kind in [
        SpanKind::Data,
        SpanKind::Backward,
        SpanKind::Sync,
        SpanKind::Collective,
        SpanKind::Optimizer,
        SpanKind::Checkpoint,
        SpanKind::Recompute,
    ] {
        chart
            .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
            .map_err(drawing)?
            .label(kind.name())
            .legend(move |(x, y)| {
                Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour(kind).filled())
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(drawing)?;
    if points.is_empty() {
        bottom
            .draw(&Text::new(
                format!("no `{metric}` values logged (accelerator.log) in this profile"),
                (40, 40),
                ("sans-serif", 16),
            ))
            .map_err(drawing)?;
    } else {
        let (lo, hi) = points.iter().fold((f64::MAX, f64::MIN), |(lo, hi), p| {
            (lo.min(p.1), hi.max(p.1))
        });
        let pad = ((hi - lo) * 0.05).max(1e-9);
        let x_end = points.iter().map(|p| p.0).fold(1.0, f64::max);
        let mut curve = ChartBuilder::on(&bottom)
            .caption(format!("{metric} by step"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(28)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..x_end, (lo - pad)..(hi + pad))
            .map_err(drawing)?;
        curve.configure_mesh().draw().map_err(drawing)?;
        curve
            .draw_series(LineSeries::new(points.iter().copied(), &BLUE))
            .map_err(drawing)?;
    }
    root.present().map_err(drawing)?;
    Ok(())
}
