//! Crash-test subject: commits numbered checkpoints of a few MB, over and over, through ivme's
//! checkpoint store, printing a line before each step so a test can kill it at chosen moments.
//!
//! Usage: `ckpt_crash <project_dir> [--once]`. Checkpoint `n` holds, for ranks 0 and 1, a
//! `model_0` tensor `w` with `w[i] = n*1000 + r*100 + i % 97` (600 000 f32), an `optimizer_0`
//! tensor `m` with `m[i] = -(n*1000 + r) - i % 13` (200 000 f32) and JSON `{"n": n, "rank": r}`,
//! so any mix of two saves is visible. It keeps the newest 3 and stops after a minute.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use ivme::checkpoint::project::checkpoint_number;
use ivme::checkpoint::store::write_rank;
use ivme::checkpoint::{
    begin, clean_stale, commit, rotate, Component, ManifestMeta, ProjectConfiguration, RankState,
};

const WORLD: usize = 2;

fn state(n: u64, rank: usize) -> ivme::Result<RankState> {
    let base = (n * 1000) as f32;
    let w: Vec<f32> = (0..600_000)
        .map(|i| base + (rank * 100) as f32 + (i % 97) as f32)
        .collect();
    let m: Vec<f32> = (0..200_000)
        .map(|i| -(base + rank as f32) - (i % 13) as f32)
        .collect();
    Ok(RankState {
        components: vec![
            Component {
                name: "model_0".into(),
                tensors: vec![("w".into(), Tensor::from_vec(w, 600_000, &Device::Cpu)?)],
                json: serde_json::Value::Null,
            },
            Component {
                name: "optimizer_0".into(),
                tensors: vec![("m".into(), Tensor::from_vec(m, 200_000, &Device::Cpu)?)],
                json: serde_json::json!({"n": n, "rank": rank}),
            },
        ],
    })
}

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    // A test reading this output may have gone; there is nobody to report to then.
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn main() -> ivme::Result<()> {
    let mut args = std::env::args().skip(1);
    let project = PathBuf::from(args.next().unwrap_or_else(|| "ckpt_crash_project".into()));
    let once = args.next().as_deref() == Some("--once");
    let cfg = ProjectConfiguration::new(project)
        .automatic_checkpoint_naming(true)
        .total_limit(3);
    let dir = cfg.checkpoints_dir();
    let started = Instant::now();
    say("start".into());
    while started.elapsed() < Duration::from_secs(60) {
        clean_stale(&dir)?;
        let final_dir = cfg.next_checkpoint_dir()?;
        let n = checkpoint_number(&final_dir).unwrap_or_default();
        let states = (0..WORLD)
            .map(|r| state(n, r))
            .collect::<ivme::Result<Vec<_>>>()?;
        say(format!("begin {n}"));
        let tmp = begin(&final_dir)?;
        for (r, s) in states.iter().enumerate() {
            say(format!("rank{r} {n}"));
            write_rank(&tmp, r, s)?;
        }
        say(format!("commit {n}"));
        let meta = ManifestMeta {
            world_size: WORLD,
            step: n,
            extra: serde_json::json!({"n": n}),
        };
        commit(&tmp, &final_dir, meta)?;
        say(format!("committed {n}"));
        rotate(&dir, 3)?;
        say(format!("rotated {n}"));
        if once {
            break;
        }
    }
    Ok(())
}
