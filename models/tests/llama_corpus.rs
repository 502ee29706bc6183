//! The disk-corpus llama example (`models/examples/llama_corpus.rs`) on real processes: trained
//! from its token file with prefetching on 2 processes, stopped mid-epoch and resumed on 3,
//! every window of every epoch is trained on exactly once; the same text's lines packed by
//! `Packed`, read from the text, from a Parquet file and from a Hugging Face style folder of
//! Arrow files, give the same windows in the same order.

#[path = "../../tests/common/mod.rs"]
mod common;

use common::{example_bin, launch, text, Scratch};
use std::collections::BTreeMap;
use std::path::Path;

/// Windows of the example's corpus: 240 lines of 32 bytes, windows of 32 ids and a target.
const WINDOWS: usize = (240 * 32 - 1) / 32;

fn run(processes: usize, args: &[String]) -> String {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = launch(processes, &example_bin("llama_corpus"), &args, &[]);
    let (stdout, stderr) = text(&o);
    assert!(
        o.status.success(),
        "llama_corpus {args:?} on {processes} failed\n{stdout}\n{stderr}"
    );
    stdout
}

/// Each rank's record: per epoch, the windows it trained on in order, padding dropped.
fn seen(dir: &Path) -> Vec<BTreeMap<usize, Vec<usize>>> {
    (0..3)
        .map(|r| {
            let text = std::fs::read_to_string(dir.join(format!("rank{r}.txt"))).unwrap();
            let mut epochs: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
            for line in text.lines() {
                let words: Vec<&str> = line.split(' ').collect();
                let rows = epochs.entry(words[0].parse().unwrap()).or_default();
                match words[1..] {
                    ["pad", k] => {
                        let k: usize = k.parse().unwrap();
                        rows.truncate(rows.len() - k);
                    }
                    [id] => rows.push(id.parse().unwrap()),
                    _ => panic!("rank {r}: {line}"),
                }
            }
            epochs
        })
        .collect()
}

/// Stops a 2-process run after 4 optimizer steps (of 8 in the first epoch) and resumes it on
/// 3; returns each rank's record.
fn stopped_on_2_resumed_on_3(data: &str) -> Vec<BTreeMap<usize, Vec<usize>>> {
    let scratch = Scratch::new(&format!("llama-corpus-{data}"));
    let seen_dir = scratch.0.join("seen");
    std::fs::create_dir_all(&seen_dir).unwrap();
    let args = [
        format!("dir={}", scratch.0.join("run").display()),
        format!("seen={}", seen_dir.display()),
        format!("data={data}"),
        "epochs=2".to_string(),
    ];
    let mut first = args.to_vec();
    first.push("stop_after=4".into());
    let out = run(2, &first);
    assert!(out.contains(&format!("{WINDOWS} windows")), "{out}");
    assert!(out.contains("stopping after 4 steps"), "{out}");
    let out = run(3, &args);
    assert!(out.contains("resumed from"), "{out}");
    let losses: Vec<f32> = out
        .lines()
        .filter_map(|l| l.split("train loss ").nth(1))
        .map(|l| l.split(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(losses.len(), 2, "{out}");
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    seen(&seen_dir)
}

#[test]
fn stopped_mid_epoch_on_2_processes_and_resumed_on_3_every_window_is_trained_once() {
    let from_tokens = stopped_on_2_resumed_on_3("tokens");
    for epoch in 0..2 {
        let mut all: Vec<usize> = from_tokens
            .iter()
            .flat_map(|rank| rank[&epoch].iter().copied())
            .collect();
        all.sort_unstable();
        assert_eq!(
            all,
            (0..WINDOWS).collect::<Vec<_>>(),
            "epoch {epoch}: each window once"
        );
    }
    // Rank 2 joined on the resume: it trained only on the rest of epoch 0.
    assert!(!from_tokens[2][&0].is_empty() && from_tokens[2][&0].len() < WINDOWS / 3 + 8);
    for data in ["lines", "parquet", "arrow"] {
        assert_eq!(
            stopped_on_2_resumed_on_3(data),
            from_tokens,
            "data={data}: the text's lines packed make the token file's windows, in order"
        );
    }
}
