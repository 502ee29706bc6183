//! Crash-safe, verified checkpoint folders holding every rank's training state.
//!
//! A save goes through three calls so the caller can put barriers between them on N ranks that
//! share a file system: the main process calls [`begin`], which creates a temporary folder
//! unique to this save, and hands its path to the other ranks; every rank calls [`write_rank`]
//! into it; after a barrier the main process alone calls [`commit`], which checksums every
//! file, writes `manifest.json` last and renames the folder into place (never over a folder
//! that appeared meanwhile). A folder without a manifest that verifies is never a checkpoint,
//! so a crash at any moment leaves either the previous checkpoint or the new one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::faults::crash_point;
use super::format::{self, bad};
use super::fsio::{
    parent_of, read_regular, remove_dir_atomic, rename_noreplace, sync_dir, write_synced,
};
pub(crate) use super::manifest::verify_listing;
use super::manifest::{check_entry, encode_manifest, list_files, rank_dir, safe_rel, RANK_INDEX};
pub use super::manifest::{
    read_manifest, verify, FileEntry, Manifest, CANDLE_VERSION, FORMAT_VERSION, MANIFEST_FILE,
};
use super::read;
pub use super::staging::{abandon, begin, clean_stale, Cleaned};
use crate::error::{io_at, CheckpointErrorKind, Error, Result};

/// One saved piece of a rank's state (a model, optimizer, loader, RNG, ...): tensors plus JSON.
#[derive(Debug, Clone)]
pub struct Component {
    /// File stem, e.g. `model_0`, `optimizer_0`, `rng`; letters, digits, `_`, `-` and `.`.
    pub name: String,
    /// Named tensors, restored in this order; may be empty.
    pub tensors: Vec<(String, Tensor)>,
    /// Everything that is not a tensor; `Value::Null` when there is nothing.
    pub json: Value,
}

/// Everything one rank saves, in the order the components were registered.
#[derive(Debug, Clone, Default)]
pub struct RankState {
    /// The components, in saving order.
    pub components: Vec<Component>,
}

impl RankState {
    /// The component called `name`, if it was saved.
    pub fn get(&self, name: &str) -> Option<&Component> {
        self.components.iter().find(|c| c.name == name)
    }
}

/// What the caller records about a save besides the files.
#[derive(Debug, Clone)]
pub struct ManifestMeta {
    /// Number of ranks that wrote state.
    pub world_size: usize,
    /// The optimizer step the state belongs to.
    pub step: u64,
    /// Free-form JSON for the caller (e.g. the automatic-naming counter).
    pub extra: Value,
}

fn check_component_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
        && name != "components";
    if ok {
        Ok(())
    } else {
        Err(Error::Usage(format!(
            "component name `{name}` cannot be a file name: use letters, digits, `_`, `-` or `.`"
        )))
    }
}

/// Writes one rank's state into `tmp/rank{rank}`: `{component}.safetensors` and
/// `{component}.json` per component, then `components.json` (the saving order), all fsynced.
///
/// `tmp` is the folder [`begin`] made on the main process; a rank that does not see it (a
/// checkpoint folder that is not shared between machines) gets an error saying so.
pub fn write_rank(tmp: &Path, rank: usize, state: &RankState) -> Result<()> {
    // Creating `tmp` here would write into a folder of this machine alone, which the main
    // process's commit never sees.
    if !tmp.is_dir() {
        return Err(Error::checkpoint(
            tmp,
            CheckpointErrorKind::Failed,
            format!(
                "is not there for rank {rank} (on {}), though the main process made it for this \
                 save: the checkpoint folder must be one folder every machine sees at the same \
                 path (a shared file system such as NFS), not a folder on each machine's own \
                 disk or in /dev/shm",
                crate::setup::state::host_name()
            ),
        ));
    }
    let mut seen = BTreeSet::new();
    for c in &state.components {
        check_component_name(&c.name)?;
        if !seen.insert(c.name.as_str()) {
            return Err(Error::Usage(format!(
                "component `{}` is saved twice on rank {rank}",
                c.name
            )));
        }
    }
    let dir = tmp.join(rank_dir(rank));
    // Only this rank touches its folder, so clearing a crashed attempt's files here is race-free.
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(io_at("clearing", &dir))?;
    }
    std::fs::create_dir_all(&dir).map_err(io_at("creating", &dir))?;
    // Checksums are taken as the bytes are written, so commit need not read the files back.
    let mut files = BTreeMap::new();
    for c in &state.components {
        let items: Vec<(&str, &Tensor)> = c.tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let name = format!("{}.safetensors", c.name);
        let sum = write_synced(&dir.join(&name), |w| {
            format::write_safetensors(w, &items, None).map(drop)
        })?;
        files.insert(name, sum);
        let name = format!("{}.json", c.name);
        let path = dir.join(&name);
        let text = serde_json::to_vec(&c.json)?;
        let sum = write_synced(&path, |w| {
            std::io::Write::write_all(w, &text).map_err(io_at("writing", &path))
        })?;
        files.insert(name, sum);
    }
    let index = RankIndex {
        components: state.components.iter().map(|c| c.name.clone()).collect(),
        files: files
            .into_iter()
            .map(|(name, (size, crc32))| (name, Sum { size, crc32 }))
            .collect(),
    };
    let text = serde_json::to_vec(&index)?;
    let path = dir.join(RANK_INDEX);
    write_synced(&path, |w| {
        std::io::Write::write_all(w, &text).map_err(io_at("writing", &path))
    })?;
    sync_dir(&dir)?;
    sync_dir(tmp)
}

/// Size and checksum as recorded by the rank that wrote a file.
#[derive(Serialize, Deserialize)]
struct Sum {
    size: u64,
    crc32: u32,
}

/// A rank's own record: its components in saving order and the sums of the files it wrote.
#[derive(Serialize, Deserialize)]
struct RankIndex {
    components: Vec<String>,
    files: BTreeMap<String, Sum>,
}

/// The manifest entries of one rank's folder, from its index (checked against the folder).
fn rank_entries(tmp: &Path, rank: usize) -> Result<Vec<FileEntry>> {
    let dir = tmp.join(rank_dir(rank));
    let path = dir.join(RANK_INDEX);
    let bytes = read_regular(&path, false)?;
    let index: RankIndex = serde_json::from_slice(&bytes)
        .map_err(|e| bad(&path, format!("is not a rank index ({e})")))?;
    let mut out = vec![FileEntry {
        path: format!("{}/{RANK_INDEX}", rank_dir(rank)),
        size: bytes.len() as u64,
        crc32: crc32fast::hash(&bytes),
    }];
    for (name, sum) in index.files {
        let file = dir.join(&name);
        let len = std::fs::symlink_metadata(&file)
            .map_err(io_at("inspecting", &file))?
            .len();
        if len != sum.size {
            return Err(bad(
                &file,
                format!("is {len} bytes but rank {rank} wrote {}", sum.size),
            ));
        }
        out.push(FileEntry {
            path: format!("{}/{name}", rank_dir(rank)),
            size: sum.size,
            crc32: sum.crc32,
        });
    }
    let listed: BTreeSet<String> = out.iter().map(|e| e.path.clone()).collect();
    for rel in list_files(&dir)? {
        let rel = format!("{}/{rel}", rank_dir(rank));
        if !listed.contains(&rel) {
            return Err(bad(
                &tmp.join(&rel),
                "was not written by this save's write_rank",
            ));
        }
    }
    Ok(out)
}

/// Finishes a save on the main process: checksums every rank's files, writes `manifest.json`
/// last, renames `tmp` to `final_dir` and syncs the parent folder.
///
/// Call it after a barrier that follows every rank's [`write_rank`]. An existing `final_dir`
/// that verifies is never overwritten (error); one that does not verify is replaced. If
/// `final_dir` appears while the save is being committed (another process saved there), the
/// rename fails and this save is discarded: the two are never merged. On any error after the
/// ranks' files were checked the temporary folder is removed ([`abandon`]).
pub fn commit(tmp: &Path, final_dir: &Path, meta: ManifestMeta) -> Result<Manifest> {
    if meta.world_size == 0 {
        return Err(Error::Usage("commit needs world_size >= 1".into()));
    }
    let ours = super::staging::target_of(tmp).is_some_and(|t| {
        t.file_name() == final_dir.file_name() && parent_of(&t) == parent_of(final_dir)
    });
    if !ours {
        return Err(Error::Usage(format!(
            "{} is not a folder begin() made for {}",
            tmp.display(),
            final_dir.display()
        )));
    }
    for r in 0..meta.world_size {
        if !tmp.join(rank_dir(r)).join(RANK_INDEX).is_file() {
            return Err(bad(
                tmp,
                format!("rank {r} has not written its state: every rank must call write_rank before the barrier that precedes commit"),
            ));
        }
    }
    let done = finish(tmp, final_dir, meta);
    match &done {
        Ok(_) => super::staging::release(tmp),
        Err(_) => {
            let _ = abandon(tmp);
        }
    }
    done
}

fn finish(tmp: &Path, final_dir: &Path, meta: ManifestMeta) -> Result<Manifest> {
    // Folders of a crashed save with a larger world, or an old manifest, must not be listed.
    let wanted: BTreeSet<String> = (0..meta.world_size).map(rank_dir).collect();
    for entry in std::fs::read_dir(tmp).map_err(io_at("listing", tmp))? {
        let entry = entry.map_err(io_at("listing", tmp))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !wanted.contains(&name) {
            let p = entry.path();
            let gone = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
            gone.map_err(io_at("removing stale", &p))?;
        }
    }
    if std::fs::symlink_metadata(final_dir).is_ok() {
        if verify(final_dir).is_ok() {
            return Err(bad(
                final_dir,
                "already holds a verified checkpoint; save under another name or delete it first",
            ));
        }
        remove_dir_atomic(final_dir)?;
    }
    let mut files = Vec::new();
    for r in 0..meta.world_size {
        files.extend(rank_entries(tmp, r)?);
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        ivme_version: env!("CARGO_PKG_VERSION").to_string(),
        candle_version: CANDLE_VERSION.to_string(),
        world_size: meta.world_size,
        step: meta.step,
        extra: meta.extra,
        files,
    };
    let text = encode_manifest(&manifest)?;
    let path = tmp.join(MANIFEST_FILE);
    write_synced(&path, |w| {
        std::io::Write::write_all(w, &text).map_err(io_at("writing", &path))
    })?;
    sync_dir(tmp)?;
    rename_noreplace(tmp, final_dir).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            bad(
                final_dir,
                "appeared while this save was being written (another process saved there at \
                 the same time); this save was discarded, nothing was merged: save under \
                 another name",
            )
        } else {
            Error::io(format!("renaming {} into place", final_dir.display()), e)
        }
    })?;
    crash_point(&format!("renamed into place {}", final_dir.display()));
    sync_dir(&parent_of(final_dir))?;
    Ok(manifest)
}

/// Reads rank `rank`'s state from a committed checkpoint, onto the CPU, in saving order.
///
/// Each file of the rank is checked against the manifest's size and checksum as it is read, so
/// a truncated or flipped file is an error naming it. Call [`verify`] first to check all ranks.
pub fn read_rank(dir: &Path, rank: usize) -> Result<RankState> {
    read_rank_with(dir, rank, |_| true)
}

/// Like [`read_rank`], but the tensors of components for which `keep` is false are only
/// checked, not loaded (their `tensors` come back empty): for components that
/// [`stream_tensors`] will set in place.
pub fn read_rank_with(dir: &Path, rank: usize, keep: impl Fn(&str) -> bool) -> Result<RankState> {
    read_rank_listed(dir, rank, keep).map(|(state, _)| state)
}

/// Like [`read_rank_with`], and also returns what each component's tensor file holds (names,
/// dtypes, shapes), so skipped components can be checked against live objects without a
/// second read.
pub fn read_rank_listed(
    dir: &Path,
    rank: usize,
    keep: impl Fn(&str) -> bool,
) -> Result<(RankState, BTreeMap<String, Listing>)> {
    read_rank_in(dir, &read_manifest(dir)?, rank, keep)
}

/// [`read_rank_listed`] against a manifest the caller already read (and will act on), so a
/// load reads every file of the checkpoint once. Each file is read exactly once, its size and
/// checksum compared with `manifest` on the bytes as they arrive; the tensors of kept
/// components are read straight into the buffers they come back in.
pub(crate) fn read_rank_in(
    dir: &Path,
    manifest: &Manifest,
    rank: usize,
    keep: impl Fn(&str) -> bool,
) -> Result<(RankState, BTreeMap<String, Listing>)> {
    let m = manifest;
    if rank >= m.world_size {
        return Err(bad(
            dir,
            format!(
                "was saved by {} processes, so it has no state for rank {rank}",
                m.world_size
            ),
        ));
    }
    let prefix = format!("{}/", rank_dir(rank));
    let entries: BTreeMap<&str, &FileEntry> = m
        .files
        .iter()
        .filter_map(|e| e.path.strip_prefix(&prefix).map(|name| (name, e)))
        .collect();
    for path in list_files(&dir.join(rank_dir(rank)))? {
        if !entries.contains_key(path.as_str()) {
            return Err(bad(
                &dir.join(&prefix).join(&path),
                "is not listed in the manifest",
            ));
        }
    }
    let entry = |name: &str| -> Result<&FileEntry> {
        let e = entries.get(name).ok_or_else(|| {
            bad(
                &dir.join(&prefix).join(name),
                "is missing from the manifest",
            )
        })?;
        safe_rel(dir, &e.path)?;
        Ok(e)
    };
    let read = |name: &str| -> Result<Vec<u8>> {
        let e = entry(name)?;
        let path = dir.join(&e.path);
        let bytes = read_regular(&path, false)?;
        check_entry(dir, e, bytes.len() as u64, crc32fast::hash(&bytes))?;
        Ok(bytes)
    };
    let index_path = dir.join(&prefix).join(RANK_INDEX);
    let index: RankIndex = serde_json::from_slice(&read(RANK_INDEX)?)
        .map_err(|e| bad(&index_path, format!("is not a rank index ({e})")))?;
    let mut components = Vec::with_capacity(index.components.len());
    let mut listings = BTreeMap::new();
    for name in index.components {
        check_component_name(&name)?;
        let e = entry(&format!("{name}.safetensors"))?;
        let path = dir.join(&e.path);
        let (header, tensors) = if keep(&name) {
            let (header, tensors) = read::read_checked(&path, (e.size, e.crc32))?;
            let named = header.tensors.iter().map(|t| t.name.clone()).zip(tensors);
            let named = named.collect();
            (header, named)
        } else {
            let expect = Some((e.size, e.crc32));
            let header =
                format::read_tensors(&path, false, expect, &Device::Cpu, |_| false, |_, _| Ok(()))?;
            (header, Vec::new())
        };
        let file = format!("{name}.json");
        let json = serde_json::from_slice(&read(&file)?).map_err(|e| {
            bad(
                &dir.join(&prefix).join(&file),
                format!("is not valid JSON ({e})"),
            )
        })?;
        let listing = header
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
            .collect();
        listings.insert(name.clone(), listing);
        components.push(Component {
            name,
            tensors,
            json,
        });
    }
    Ok((RankState { components }, listings))
}

/// Names, dtypes and shapes of the tensors in a component's file.
pub type Listing = Vec<(String, candle_core::DType, Vec<usize>)>;

fn component_file(dir: &Path, rank: usize, component: &str) -> Result<(PathBuf, FileEntry)> {
    check_component_name(component)?;
    let m = read_manifest(dir)?;
    let rel = format!("{}/{component}.safetensors", rank_dir(rank));
    let e = m
        .files
        .into_iter()
        .find(|e| e.path == rel)
        .ok_or_else(|| bad(&dir.join(&rel), "is missing from the manifest"))?;
    safe_rel(dir, &e.path)?;
    Ok((dir.join(&e.path), e))
}

/// Reads rank `rank`'s component file once to check its size and checksum against the
/// manifest, keeping no tensor, and returns what it holds: the first half of
/// [`stream_tensors`], for a caller that checks everything before changing anything.
pub fn check_tensors(dir: &Path, rank: usize, component: &str) -> Result<Listing> {
    let (path, e) = component_file(dir, rank, component)?;
    let header = format::read_tensors(
        &path,
        false,
        Some((e.size, e.crc32)),
        &Device::Cpu,
        |_| false,
        |_, _| Ok(()),
    )?;
    Ok(header
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
        .collect())
}

/// Hands each tensor of a component already checked by [`check_tensors`] to `take`, one at a
/// time (memory stays near one tensor).
pub fn stream_checked(
    dir: &Path,
    rank: usize,
    component: &str,
    mut take: impl FnMut(&str, Tensor) -> Result<()>,
) -> Result<()> {
    let (path, _) = component_file(dir, rank, component)?;
    format::read_tensors(
        &path,
        false,
        None,
        &Device::Cpu,
        |_| true,
        |info, t| take(&info.name, t),
    )?;
    Ok(())
}

/// Hands each tensor of rank `rank`'s component `component` to `take`, one at a time (memory
/// stays near one tensor). The file is first read once to check its size and checksum against
/// the manifest, and `check` is shown every tensor's name, dtype and shape, so a damaged or
/// mismatched file is refused before `take` sees anything.
pub fn stream_tensors(
    dir: &Path,
    rank: usize,
    component: &str,
    check: impl FnOnce(&[(String, candle_core::DType, Vec<usize>)]) -> Result<()>,
    take: impl FnMut(&str, Tensor) -> Result<()>,
) -> Result<()> {
    check(&check_tensors(dir, rank, component)?)?;
    stream_checked(dir, rank, component, take)
}
