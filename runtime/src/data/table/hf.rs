//! Finding a split's Arrow files in a Hugging Face `datasets` folder.

use crate::error::io_at;
use crate::{Error, Result};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};

/// Returns the Arrow files of `split` in `folder`, in order: those a `save_to_disk` folder's
/// `state.json` lists (through `dataset_dict.json` and the split's folder for a dictionary of
/// splits), or the `NAME-SPLIT[-NNNNN-of-NNNNN].arrow` files of a `load_dataset` cache folder.
pub(super) fn split_files(folder: &Path, split: &str) -> Result<Vec<PathBuf>> {
    if folder.join("dataset_dict.json").is_file() {
        let dict = read_json(&folder.join("dataset_dict.json"))?;
        let splits: Vec<String> = dict["splits"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        if !splits.iter().any(|s| s == split) {
            return Err(no_split(folder, split, &splits));
        }
        return saved_files(&folder.join(split), Some(split));
    }
    if folder.join("state.json").is_file() {
        return saved_files(folder, Some(split));
    }
    cached_files(folder, split)
}

/// The files a `save_to_disk` folder's `state.json` lists.
fn saved_files(folder: &Path, split: Option<&str>) -> Result<Vec<PathBuf>> {
    let state_path = folder.join("state.json");
    let state = read_json(&state_path)?;
    if let (Some(want), Some(saved)) = (split, state["_split"].as_str()) {
        if want != saved {
            return Err(no_split(folder, want, &[saved.to_string()]));
        }
    }
    let files: Vec<PathBuf> = state["_data_files"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|f| f["filename"].as_str())
                .map(|name| folder.join(name))
                .collect()
        })
        .unwrap_or_default();
    if files.is_empty() {
        return Err(Error::Usage(format!(
            "{} lists no data files (`_data_files`): is this a Hugging Face datasets folder?",
            state_path.display()
        )));
    }
    Ok(files)
}

/// The `NAME-SPLIT.arrow` or `NAME-SPLIT-NNNNN-of-NNNNN.arrow` files of a cache folder, in
/// shard order.
fn cached_files(folder: &Path, split: &str) -> Result<Vec<PathBuf>> {
    let listing = std::fs::read_dir(folder).map_err(io_at("listing", folder))?;
    let mut found: Vec<(usize, PathBuf)> = Vec::new();
    let mut splits: Vec<String> = Vec::new();
    for entry in listing {
        let path = entry.map_err(io_at("listing", folder))?.path();
        let Some(stem) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".arrow"))
        else {
            continue;
        };
        // `cache-HASH.arrow` files hold the results of `.map()` and the like, not a split.
        if stem.starts_with("cache-") {
            continue;
        }
        let Some((name_split, shard)) = split_and_shard(stem) else {
            continue;
        };
        // The split is the last dash-separated word before the shard numbers.
        let Some((_, this)) = name_split.rsplit_once('-') else {
            continue;
        };
        if this == split {
            found.push((shard, path));
        } else if !splits.iter().any(|s| s == this) {
            splits.push(this.to_string());
        }
    }
    if found.is_empty() {
        return Err(no_split(folder, split, &splits));
    }
    found.sort();
    Ok(found.into_iter().map(|(_, p)| p).collect())
}

/// Splits `NAME-SPLIT-00001-of-00004` into (`NAME-SPLIT`, 1); `NAME-SPLIT` is shard 0.
fn split_and_shard(stem: &str) -> Option<(&str, usize)> {
    let parts: Vec<&str> = stem.rsplitn(4, '-').collect();
    if let [total, "of", shard, rest] = parts[..] {
        let numeric = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if numeric(total) && numeric(shard) {
            return Some((rest, shard.parse().ok()?));
        }
    }
    Some((stem, 0))
}

fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).map_err(io_at("reading", path))?;
    serde_json::from_str(&text)
        .map_err(|e| Error::Usage(format!("{} is not valid JSON: {e}", path.display())))
}

fn no_split(folder: &Path, split: &str, have: &[String]) -> Error {
    let have = if have.is_empty() {
        "none".to_string()
    } else {
        have.join(", ")
    };
    Error::Usage(format!(
        "{} has no split `{split}` (splits found: {have})",
        folder.display()
    ))
}
