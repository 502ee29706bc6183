//! Crash-safe, verified checkpoint folders holding every rank's training state.
//!
//! A save goes through three calls so the caller can put barriers between them on N ranks that
//! share a file system: every rank calls [`begin`] then [`write_rank`]; after a barrier the main
//! process alone calls [`commit`], which checksums every file, writes `manifest.json` last and
//! renames the folder into place. A folder without a manifest that verifies is never a
//! checkpoint, so a crash at any moment leaves either the previous checkpoint or the new one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::format::{self, bad};
use super::fsio::{
    io_at, parent_of, read_with_crc, remove_dir_atomic, size_and_crc, sync_dir, write_synced,
};
use crate::error::{Error, Result};

/// Version of the folder layout written by this build.
pub const FORMAT_VERSION: u32 = 1;
/// The candle release ivme is built against, recorded in every manifest.
pub const CANDLE_VERSION: &str = "0.11.1";
/// The file whose presence (and checksum) marks a committed checkpoint.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The per-rank file listing that rank's components in saving order.
const RANK_INDEX: &str = "components.json";

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

/// Size and checksum of one file in a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Path relative to the checkpoint folder, with `/` separators.
    pub path: String,
    /// Length in bytes.
    pub size: u64,
    /// CRC-32 (IEEE) of the contents.
    pub crc32: u32,
}

/// The record that makes a folder a checkpoint: what was saved, by whom, and every file's checksum.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Layout version ([`FORMAT_VERSION`] when written by this build).
    pub format_version: u32,
    /// The ivme version that wrote it.
    pub ivme_version: String,
    /// The candle version that ivme was built against.
    pub candle_version: String,
    /// Number of ranks whose state is inside.
    pub world_size: usize,
    /// The optimizer step the state belongs to.
    pub step: u64,
    /// The caller's extra JSON.
    pub extra: Value,
    /// Every file except the manifest, sorted by path.
    pub files: Vec<FileEntry>,
}

/// The fixed frame around the manifest body; the body's own checksum sits in the frame so a
/// flipped byte in the manifest is caught like one in any other file.
const FRAME_HEAD: &str = "{\"manifest_crc32\": \"";
const FRAME_MID: &str = "\",\n\"manifest\": ";
const FRAME_TAIL: &str = "}\n";

fn encode_manifest(m: &Manifest) -> Result<Vec<u8>> {
    let body = serde_json::to_vec_pretty(m)?;
    let mut out = format!("{FRAME_HEAD}{:08x}{FRAME_MID}", crc32fast::hash(&body)).into_bytes();
    out.extend_from_slice(&body);
    out.extend_from_slice(FRAME_TAIL.as_bytes());
    Ok(out)
}

/// Reads and self-checks `dir/manifest.json` without touching the other files.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST_FILE);
    if !path.is_file() {
        return Err(bad(
            dir,
            "has no manifest.json, so it is not a committed checkpoint (an interrupted save?); \
             pick another checkpoint",
        ));
    }
    let bytes = std::fs::read(&path).map_err(io_at("reading", &path))?;
    let corrupt = |why: &str| {
        bad(
            &path,
            format!("is corrupt ({why}); this checkpoint cannot be trusted"),
        )
    };
    let rest = bytes
        .strip_prefix(FRAME_HEAD.as_bytes())
        .ok_or_else(|| corrupt("bad frame"))?;
    if rest.len() < 8 + FRAME_MID.len() + FRAME_TAIL.len() {
        return Err(corrupt("too short"));
    }
    let (hex, rest) = rest.split_at(8);
    let want = std::str::from_utf8(hex)
        .ok()
        .and_then(|h| u32::from_str_radix(h, 16).ok())
        .ok_or_else(|| corrupt("bad checksum field"))?;
    let body = rest
        .strip_prefix(FRAME_MID.as_bytes())
        .and_then(|r| r.strip_suffix(FRAME_TAIL.as_bytes()))
        .ok_or_else(|| corrupt("bad frame"))?;
    if crc32fast::hash(body) != want {
        return Err(corrupt("checksum mismatch"));
    }
    let m: Manifest = serde_json::from_slice(body).map_err(|e| corrupt(&e.to_string()))?;
    if m.format_version > FORMAT_VERSION {
        return Err(bad(
            dir,
            format!(
                "uses checkpoint format {} but this ivme reads up to {FORMAT_VERSION}; upgrade ivme",
                m.format_version
            ),
        ));
    }
    Ok(m)
}

fn rank_dir(r: usize) -> String {
    format!("rank{r}")
}

/// The deterministic temporary sibling a save of `final_dir` is written into.
pub fn temp_dir_for(final_dir: &Path) -> Result<PathBuf> {
    let name = final_dir.file_name().ok_or_else(|| {
        Error::Usage(format!(
            "{} does not name a checkpoint folder",
            final_dir.display()
        ))
    })?;
    Ok(parent_of(final_dir).join(format!(".{}.tmp", name.to_string_lossy())))
}

/// Starts a save of `final_dir`: creates (or reuses) its temporary sibling and returns it.
///
/// Every rank calls this; it is idempotent, so ranks racing on a shared file system agree.
/// Leftovers of a crashed save are cleaned by [`clean_stale`], which the main process should
/// call (followed by a barrier) before any rank begins.
pub fn begin(final_dir: &Path) -> Result<PathBuf> {
    let tmp = temp_dir_for(final_dir)?;
    std::fs::create_dir_all(&tmp).map_err(io_at("creating", &tmp))?;
    Ok(tmp)
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
pub fn write_rank(tmp: &Path, rank: usize, state: &RankState) -> Result<()> {
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
    for c in &state.components {
        let items: Vec<(&str, &Tensor)> = c.tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let path = dir.join(format!("{}.safetensors", c.name));
        write_synced(&path, |w| {
            format::write_safetensors(w, &items, None).map(drop)
        })?;
        let path = dir.join(format!("{}.json", c.name));
        let text = serde_json::to_vec(&c.json)?;
        write_synced(&path, |w| {
            std::io::Write::write_all(w, &text).map_err(io_at("writing", &path))
        })?;
    }
    let names: Vec<&str> = state.components.iter().map(|c| c.name.as_str()).collect();
    let text = serde_json::to_vec(&names)?;
    let path = dir.join(RANK_INDEX);
    write_synced(&path, |w| {
        std::io::Write::write_all(w, &text).map_err(io_at("writing", &path))
    })?;
    sync_dir(&dir)?;
    sync_dir(tmp)
}

/// Every regular file under `dir` (relative, `/`-separated), except the manifest.
fn list_files(dir: &Path) -> Result<BTreeSet<String>> {
    fn walk(root: &Path, rel: &str, out: &mut BTreeSet<String>) -> Result<()> {
        let here = if rel.is_empty() {
            root.to_path_buf()
        } else {
            root.join(rel)
        };
        for entry in std::fs::read_dir(&here).map_err(io_at("listing", &here))? {
            let entry = entry.map_err(io_at("listing", &here))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let kind = entry
                .file_type()
                .map_err(io_at("inspecting", &entry.path()))?;
            if kind.is_dir() {
                walk(root, &path, out)?;
            } else if path != MANIFEST_FILE {
                out.insert(path);
            }
        }
        Ok(())
    }
    let mut out = BTreeSet::new();
    walk(dir, "", &mut out)?;
    Ok(out)
}

/// Finishes a save on the main process: checksums every rank's files, writes `manifest.json`
/// last, renames `tmp` to `final_dir` and syncs the parent folder.
///
/// Call it after a barrier that follows every rank's [`write_rank`]. An existing `final_dir`
/// that verifies is never overwritten (error); one that does not verify is replaced.
pub fn commit(tmp: &Path, final_dir: &Path, meta: ManifestMeta) -> Result<Manifest> {
    if meta.world_size == 0 {
        return Err(Error::Usage("commit needs world_size >= 1".into()));
    }
    if tmp != temp_dir_for(final_dir)? {
        return Err(Error::Usage(format!(
            "{} is not the folder begin() made for {}",
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
    if final_dir.exists() {
        if verify(final_dir).is_ok() {
            let _ = std::fs::remove_dir_all(tmp);
            return Err(bad(
                final_dir,
                "already holds a verified checkpoint; save under another name or delete it first",
            ));
        }
        remove_dir_atomic(final_dir)?;
    }
    let mut files = Vec::new();
    for path in list_files(tmp)? {
        let (size, crc32) = size_and_crc(&tmp.join(&path))?;
        files.push(FileEntry { path, size, crc32 });
    }
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
    std::fs::rename(tmp, final_dir).map_err(io_at("renaming into place", final_dir))?;
    sync_dir(&parent_of(final_dir))?;
    Ok(manifest)
}

/// Checks a listed path is a plain relative path inside the checkpoint.
fn safe_rel(dir: &Path, rel: &str) -> Result<()> {
    let ok = !rel.is_empty()
        && rel
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..");
    if ok {
        Ok(())
    } else {
        Err(bad(
            dir,
            format!("manifest lists `{rel}`, which is outside the checkpoint"),
        ))
    }
}

fn check_entry(dir: &Path, e: &FileEntry, size: u64, crc: u32) -> Result<()> {
    if size != e.size {
        return Err(bad(
            &dir.join(&e.path),
            format!(
                "is {size} bytes but the manifest says {} (truncated or overwritten)",
                e.size
            ),
        ));
    }
    if crc != e.crc32 {
        return Err(bad(
            &dir.join(&e.path),
            "checksum does not match the manifest (corrupt file)",
        ));
    }
    Ok(())
}

/// Checks that `dir` is a complete checkpoint: a sound manifest, every listed file with the
/// recorded size and checksum, every rank present and no unlisted files. Errors name the bad file.
pub fn verify(dir: &Path) -> Result<Manifest> {
    let m = read_manifest(dir)?;
    let listed: BTreeSet<&str> = m.files.iter().map(|e| e.path.as_str()).collect();
    for r in 0..m.world_size {
        let index = format!("{}/{RANK_INDEX}", rank_dir(r));
        if !listed.contains(index.as_str()) {
            return Err(bad(dir, format!("manifest has no state for rank {r}")));
        }
    }
    for e in &m.files {
        safe_rel(dir, &e.path)?;
        let path = dir.join(&e.path);
        if !path.is_file() {
            return Err(bad(&path, "is listed in the manifest but missing"));
        }
        let (size, crc) = size_and_crc(&path)?;
        check_entry(dir, e, size, crc)?;
    }
    for path in list_files(dir)? {
        if !listed.contains(path.as_str()) {
            return Err(bad(
                &dir.join(&path),
                "is not listed in the manifest (a file from another save?)",
            ));
        }
    }
    Ok(m)
}

/// Reads rank `rank`'s state from a committed checkpoint, onto the CPU, in saving order.
///
/// Each file of the rank is checked against the manifest's size and checksum as it is read, so
/// a truncated or flipped file is an error naming it. Call [`verify`] first to check all ranks.
pub fn read_rank(dir: &Path, rank: usize) -> Result<RankState> {
    let m = read_manifest(dir)?;
    if rank >= m.world_size {
        return Err(bad(
            dir,
            format!(
                "was saved by {} processes, so it has no state for rank {rank}; resume with the same \
                 number of processes (resharding is not supported yet)",
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
    let read = |name: &str| -> Result<Vec<u8>> {
        let e = entries.get(name).ok_or_else(|| {
            bad(
                &dir.join(&prefix).join(name),
                "is missing from the manifest",
            )
        })?;
        safe_rel(dir, &e.path)?;
        let (bytes, crc) = read_with_crc(&dir.join(&e.path))?;
        check_entry(dir, e, bytes.len() as u64, crc)?;
        Ok(bytes)
    };
    let index_path = dir.join(&prefix).join(RANK_INDEX);
    let names: Vec<String> = serde_json::from_slice(&read(RANK_INDEX)?).map_err(|e| {
        bad(
            &index_path,
            format!("is not a list of component names ({e})"),
        )
    })?;
    let mut components = Vec::with_capacity(names.len());
    for name in names {
        check_component_name(&name)?;
        let file = format!("{name}.safetensors");
        let bytes = read(&file)?;
        let path = dir.join(&prefix).join(&file);
        let header = format::parse_bytes(&path, &bytes)?;
        let tensors = header
            .tensors
            .iter()
            .map(|info| {
                Ok((
                    info.name.clone(),
                    format::tensor_at(&bytes, &header, info, &Device::Cpu)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let file = format!("{name}.json");
        let json = serde_json::from_slice(&read(&file)?).map_err(|e| {
            bad(
                &dir.join(&prefix).join(&file),
                format!("is not valid JSON ({e})"),
            )
        })?;
        components.push(Component {
            name,
            tensors,
            json,
        });
    }
    Ok(RankState { components })
}

/// What [`clean_stale`] did in a folder.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cleaned {
    /// Temporary folders of crashed saves that were deleted.
    pub removed: Vec<PathBuf>,
    /// Saves that crashed after writing a verified manifest but before their rename, now
    /// renamed into place.
    pub recovered: Vec<PathBuf>,
}

/// Removes the temporary folders that crashed saves left in `parent`, and finishes saves that
/// crashed between writing their manifest and renaming it into place.
///
/// Call it on the main process only, before a save begins (and before a barrier on N ranks).
pub fn clean_stale(parent: &Path) -> Result<Cleaned> {
    let mut done = Cleaned::default();
    if !parent.is_dir() {
        return Ok(done);
    }
    for entry in std::fs::read_dir(parent).map_err(io_at("listing", parent))? {
        let entry = entry.map_err(io_at("listing", parent))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if !path.is_dir() || !name.starts_with('.') {
            continue;
        }
        if let Some(stem) = name.strip_suffix(".tmp").map(|s| &s[1..]) {
            let target = parent.join(stem);
            if !stem.is_empty() && !target.exists() && verify(&path).is_ok() {
                std::fs::rename(&path, &target).map_err(io_at("renaming into place", &target))?;
                done.recovered.push(target);
                continue;
            }
        } else if !name.ends_with(".del") {
            continue;
        }
        std::fs::remove_dir_all(&path).map_err(io_at("removing", &path))?;
        done.removed.push(path);
    }
    if !done.removed.is_empty() || !done.recovered.is_empty() {
        sync_dir(parent)?;
    }
    Ok(done)
}
