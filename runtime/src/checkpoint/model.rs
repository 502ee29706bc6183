//! Model weights in the Hugging Face layout: one `model.safetensors`, or numbered shards plus a
//! `model.safetensors.index.json`, readable by candle, Python's `safetensors` and `transformers`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path, PathBuf};
use std::str::FromStr;

use candle_core::{Device, Tensor, Var};
use serde_json::{json, Value};

use super::format::{self, bad};
use super::fsio::{sync_dir, Staged};
use crate::error::io_at;
use crate::error::{Error, Result};

/// File name of an unsharded model.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of the index that maps each tensor to its shard.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

const SIZE_FORMS: &str = "a byte count (e.g. 1000000) or a number with a unit: B, KB, MB, GB, TB \
     (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. \"500MB\" or \"2GiB\"";

/// The largest a model shard may grow, in bytes of tensor data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ShardSize(u64);

impl ShardSize {
    /// A limit of `bytes` bytes (at least one).
    pub fn from_bytes(bytes: u64) -> Result<Self> {
        if bytes == 0 {
            return Err(Error::config(
                "max_shard_size",
                0,
                "use a positive size, or no limit",
            ));
        }
        Ok(ShardSize(bytes))
    }

    /// Reads a size such as `"500MB"`, `"1GB"` (10^9 bytes), `"1GiB"` (2^30 bytes) or `"4096"`.
    pub fn parse(text: &str) -> Result<Self> {
        let invalid = || Error::config("max_shard_size", text, format!("write {SIZE_FORMS}"));
        let t = text.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (digits, unit) = t.split_at(split);
        let number: u64 = digits.parse().map_err(|_| invalid())?;
        let scale: u64 = match unit.trim().to_ascii_uppercase().as_str() {
            "" | "B" => 1,
            "KB" => 1_000,
            "MB" => 1_000_000,
            "GB" => 1_000_000_000,
            "TB" => 1_000_000_000_000,
            "KIB" => 1 << 10,
            "MIB" => 1 << 20,
            "GIB" => 1 << 30,
            "TIB" => 1 << 40,
            _ => return Err(invalid()),
        };
        let bytes = number.checked_mul(scale).ok_or_else(invalid)?;
        Self::from_bytes(bytes)
    }

    /// The limit in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl FromStr for ShardSize {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        ShardSize::parse(s)
    }
}

impl TryFrom<&str> for ShardSize {
    type Error = Error;
    fn try_from(s: &str) -> Result<Self> {
        ShardSize::parse(s)
    }
}

impl TryFrom<u64> for ShardSize {
    type Error = Error;
    fn try_from(bytes: u64) -> Result<Self> {
        ShardSize::from_bytes(bytes)
    }
}

/// Groups tensor indices (already sorted by name) into shards of at most `max` bytes; a tensor
/// larger than `max` fills a shard alone.
fn plan_shards(sizes: &[u64], max: Option<ShardSize>) -> Vec<Vec<usize>> {
    let limit = max.map_or(u64::MAX, ShardSize::bytes);
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut current = Vec::new();
    let mut filled = 0u64;
    for (i, &size) in sizes.iter().enumerate() {
        if !current.is_empty() && filled.saturating_add(size) > limit {
            shards.push(std::mem::take(&mut current));
            filled = 0;
        }
        current.push(i);
        filled = filled.saturating_add(size);
    }
    if !current.is_empty() || shards.is_empty() {
        shards.push(current);
    }
    shards
}

fn shard_name(k: usize, n: usize) -> String {
    format!("model-{k:05}-of-{n:05}.safetensors")
}

/// Whether `name` looks like `model-<digits>-of-<digits>.safetensors`.
fn is_shard_name(name: &str) -> bool {
    let Some(middle) = name
        .strip_prefix("model-")
        .and_then(|s| s.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    matches!(middle.split_once("-of-"), Some((a, b)) if all_digits(a) && all_digits(b))
}

/// Saves named tensors into `dir` in the Hugging Face layout and returns the files written.
///
/// Without a limit (or when everything fits one shard) this writes `model.safetensors`;
/// otherwise `model-0000k-of-0000n.safetensors` shards, packed greedily in name order, plus
/// `model.safetensors.index.json`. Every file carries the `format: pt` metadata. All files are
/// written and fsynced under temporary names before any replaces its old version, so a write
/// error (a full disk) names the file and leaves an earlier save in `dir` as it was. Files of
/// an earlier save that the new layout does not use are removed afterwards, so loaders never
/// pick up a stale shard or index.
pub fn save_model(
    tensors: &[(String, Tensor)],
    dir: &Path,
    max_shard_size: Option<ShardSize>,
) -> Result<Vec<PathBuf>> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| tensors[a].0.cmp(&tensors[b].0));
    for pair in order.windows(2) {
        if tensors[pair[0]].0 == tensors[pair[1]].0 {
            return Err(Error::Usage(format!(
                "save_model got two tensors named `{}`: names must be unique",
                tensors[pair[0]].0
            )));
        }
    }
    std::fs::create_dir_all(dir).map_err(io_at("creating folder", dir))?;
    let sizes: Vec<u64> = order
        .iter()
        .map(|&i| format::byte_len(&tensors[i].1))
        .collect();
    let shards = plan_shards(&sizes, max_shard_size);
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let n = shards.len();
    let mut written = Vec::new();
    let mut staged = Staged::default();
    let mut weight_map = BTreeMap::new();
    for (k, shard) in shards.iter().enumerate() {
        let file = if n == 1 {
            SINGLE_FILE.to_string()
        } else {
            shard_name(k + 1, n)
        };
        let items: Vec<(&str, &Tensor)> = shard
            .iter()
            .map(|&j| {
                let (name, t) = &tensors[order[j]];
                (name.as_str(), t)
            })
            .collect();
        let path = dir.join(&file);
        staged.write(&path, |w| {
            format::write_safetensors(w, &items, Some(&metadata)).map(drop)
        })?;
        for (name, _) in &items {
            weight_map.insert(name.to_string(), Value::String(file.clone()));
        }
        written.push(path);
    }
    if n > 1 {
        let index = json!({
            "metadata": {"total_size": sizes.iter().sum::<u64>()},
            "weight_map": weight_map,
        });
        let path = dir.join(INDEX_FILE);
        let text = serde_json::to_vec_pretty(&index)?;
        staged.write(&path, |w| {
            std::io::Write::write_all(w, &text).map_err(io_at("writing", &path))
        })?;
        written.push(path);
    }
    // Nothing is replaced until every file is written: a full disk leaves the old model whole.
    staged.commit()?;
    remove_stale(dir, &written)?;
    Ok(written)
}

/// Removes model files in `dir` that belong to an earlier save with another layout.
fn remove_stale(dir: &Path, keep: &[PathBuf]) -> Result<()> {
    let mut removed = false;
    for entry in std::fs::read_dir(dir).map_err(io_at("listing", dir))? {
        let entry = entry.map_err(io_at("listing", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = is_shard_name(&name) || name == SINGLE_FILE || name == INDEX_FILE;
        if ours && !keep.contains(&entry.path()) {
            std::fs::remove_file(entry.path()).map_err(io_at("removing stale", &entry.path()))?;
            removed = true;
        }
    }
    if removed {
        sync_dir(dir)?;
    }
    Ok(())
}

/// What [`load_checkpoint_in_model`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Variables that received a value, sorted by name.
    pub loaded: Vec<String>,
    /// Tensors in the checkpoint that no variable asked for, sorted by name (not an error).
    pub unexpected: Vec<String>,
    /// The files read, in the order they were read.
    pub files: Vec<PathBuf>,
}

/// Resolves an index entry to a file in `dir`, refusing entries that climb out of it (`..`,
/// absolute paths).
///
/// The file itself may be a symbolic link to a regular file anywhere: that is how the Hugging
/// Face hub cache lays out every downloaded model (`snapshots/<rev>/<file>` are relative links
/// into `../../blobs/<sha>`). What the index names is checked; where the file system's own
/// links lead is the file system owner's choice.
fn shard_path(dir: &Path, index: &Path, entry: &str) -> Result<PathBuf> {
    let rel = Path::new(entry);
    let plain = !entry.is_empty()
        && rel
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    if !plain {
        return Err(bad(
            index,
            format!("index entry `{entry}` points outside the checkpoint folder; shard files must sit inside it"),
        ));
    }
    let full = dir.join(rel);
    if !full.exists() {
        return Err(bad(
            index,
            format!(
                "shard `{entry}` named in the index is missing from {} (or is a broken link)",
                dir.display()
            ),
        ));
    }
    Ok(full)
}

/// Lists which file holds each tensor: one file, or the shards named by an index json.
fn locate(path: &Path) -> Result<BTreeMap<PathBuf, Vec<String>>> {
    let (dir, index) = if path.is_dir() {
        let index = path.join(INDEX_FILE);
        if !index.is_file() {
            let single = path.join(SINGLE_FILE);
            if !single.is_file() {
                return Err(bad(
                    path,
                    format!("holds neither {SINGLE_FILE} nor {INDEX_FILE}; pass a .safetensors file or a saved model folder"),
                ));
            }
            return locate(&single);
        }
        (path.to_path_buf(), index)
    } else if path.is_file() && path.file_name().is_some_and(|n| n == INDEX_FILE) {
        (super::fsio::parent_of(path), path.to_path_buf())
    } else if path.is_file() {
        let header = format::read_header(path)?;
        let names = header.tensors.into_iter().map(|t| t.name).collect();
        return Ok(BTreeMap::from([(path.to_path_buf(), names)]));
    } else {
        return Err(bad(
            path,
            "does not exist; pass a .safetensors file or a saved model folder",
        ));
    };
    let text = super::fsio::read_regular(&index, true)?;
    let value: Value = serde_json::from_slice(&text)
        .map_err(|e| bad(&index, format!("is not valid JSON ({e})")))?;
    let map = value
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad(&index, "has no `weight_map` object"))?;
    let mut files: BTreeMap<PathBuf, Vec<String>> = BTreeMap::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(&index, format!("entry `{name}` is not a file name")))?;
        files
            .entry(shard_path(&dir, &index, file)?)
            .or_default()
            .push(name.clone());
    }
    Ok(files)
}

/// Loads a model file or folder into `varmap`'s variables by name, as
/// [`load_checkpoint_in_model`] does (the form to use on a model built outside an Accelerator).
pub fn load_checkpoint_in_varmap(
    varmap: &candle_nn::VarMap,
    path: &Path,
    device: &Device,
) -> Result<LoadReport> {
    let vars: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .map_err(|_| Error::Usage("the VarMap's lock is poisoned by an earlier panic".into()))?
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    load_checkpoint_in_model(&vars, path, device)
}

/// Loads a checkpoint into `vars`, one file at a time, converting each tensor to the dtype and
/// device of its variable.
///
/// `path` is a `.safetensors` file, a folder with `model.safetensors.index.json`, or a folder
/// holding `model.safetensors`. Tensors are staged on `device` (pass the variables' device to
/// avoid a copy). Nothing is changed unless every variable has a tensor of the right shape: the
/// error lists every missing and mis-shaped name. Tensors no variable asked for are listed in
/// the report's `unexpected`.
pub fn load_checkpoint_in_model(
    vars: &[(String, Var)],
    path: &Path,
    device: &Device,
) -> Result<LoadReport> {
    let mut targets: HashMap<&str, &Var> = HashMap::new();
    for (name, var) in vars {
        if targets.insert(name.as_str(), var).is_some() {
            return Err(Error::Usage(format!(
                "two variables are named `{name}`: names must be unique"
            )));
        }
    }
    let files = locate(path)?;
    let mut found: HashMap<String, Vec<usize>> = HashMap::new();
    for (file, names) in &files {
        let header = format::read_header(file)?;
        for name in names {
            let info = header.tensors.iter().find(|t| &t.name == name).ok_or_else(|| {
                bad(file, format!("the index places `{name}` in this shard but the shard does not hold it"))
            })?;
            found.insert(name.clone(), info.shape.clone());
        }
    }
    let mut problems = Vec::new();
    let mut names: Vec<&str> = targets.keys().copied().collect();
    names.sort_unstable();
    for name in &names {
        match found.get(*name) {
            None => problems.push(format!("missing `{name}`")),
            Some(shape) if shape.as_slice() != targets[name].dims() => problems.push(format!(
                "`{name}` has shape {shape:?} in the checkpoint but {:?} in the model",
                targets[name].dims()
            )),
            Some(_) => {}
        }
    }
    if !problems.is_empty() {
        return Err(bad(
            path,
            format!(
                "does not match the model ({}); nothing was loaded",
                problems.join("; ")
            ),
        ));
    }
    let mut unexpected: Vec<String> = found
        .keys()
        .filter(|n| !targets.contains_key(n.as_str()))
        .cloned()
        .collect();
    unexpected.sort();
    let mut report = LoadReport {
        unexpected,
        ..LoadReport::default()
    };
    for (file, wanted) in &files {
        // Tensors stream one at a time, so memory stays near the largest tensor.
        let wanted: std::collections::HashSet<&str> = wanted.iter().map(String::as_str).collect();
        let keep = |info: &format::TensorInfo| {
            wanted.contains(info.name.as_str()) && targets.contains_key(info.name.as_str())
        };
        format::read_tensors(file, true, None, device, keep, |info, t| {
            let var = targets[info.name.as_str()];
            var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
            report.loaded.push(info.name.clone());
            Ok(())
        })?;
        report.files.push(file.clone());
    }
    report.loaded.sort();
    Ok(report)
}

/// The `__metadata__` strings of a safetensors file (e.g. `format: pt`), read from its header.
pub fn read_safetensors_metadata(path: &Path) -> Result<BTreeMap<String, String>> {
    Ok(format::read_header(path)?.metadata)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_the_hub() {
        assert_eq!(ShardSize::parse("1GB").unwrap().bytes(), 1_000_000_000);
        assert_eq!(ShardSize::parse("500MB").unwrap().bytes(), 500_000_000);
        assert_eq!(ShardSize::parse("10KB").unwrap().bytes(), 10_000);
        assert_eq!(ShardSize::parse("1GiB").unwrap().bytes(), 1 << 30);
        assert_eq!(ShardSize::parse(" 4096 ").unwrap().bytes(), 4096);
        assert_eq!("2mib".parse::<ShardSize>().unwrap().bytes(), 2 << 20);
        for bad in [
            "",
            "GB",
            "1.5GB",
            "-1MB",
            "10 parsecs",
            "0",
            "99999999999999TB",
        ] {
            let err = ShardSize::parse(bad).unwrap_err().to_string();
            assert!(err.contains("max_shard_size"), "{bad}: {err}");
        }
        assert!(ShardSize::parse("x")
            .unwrap_err()
            .to_string()
            .contains("GiB"));
    }

    #[test]
    fn shards_pack_greedily_and_big_tensors_stand_alone() {
        let limit = Some(ShardSize(10));
        assert_eq!(plan_shards(&[4, 4, 4], limit), vec![vec![0, 1], vec![2]]);
        assert_eq!(
            plan_shards(&[3, 20, 3, 3], limit),
            vec![vec![0], vec![1], vec![2, 3]]
        );
        assert_eq!(plan_shards(&[10, 10], limit), vec![vec![0], vec![1]]);
        assert_eq!(plan_shards(&[4, 4], None), vec![vec![0, 1]]);
        assert_eq!(plan_shards(&[], limit), vec![Vec::<usize>::new()]);
    }

    #[test]
    fn shard_names_are_recognised() {
        assert!(is_shard_name(&shard_name(2, 7)));
        assert!(is_shard_name("model-1-of-2.safetensors"));
        assert!(!is_shard_name("model.safetensors"));
        assert!(!is_shard_name("model-a-of-2.safetensors"));
        assert!(!is_shard_name("my-model-00001-of-00002.safetensors"));
    }
}
