//! The manifest that makes a folder a checkpoint, and the checks that a folder matches it.

use std::collections::BTreeSet;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::format::bad;
use super::fsio::{kind_name, read_regular, size_and_crc};
use crate::error::io_at;
use crate::error::{CheckpointErrorKind, Error, Result};

/// Version of the folder layout written by this build.
pub const FORMAT_VERSION: u32 = 1;
/// The candle release ivme is built against (read from Cargo.lock by build.rs), recorded in
/// every manifest.
pub const CANDLE_VERSION: &str = env!("IVME_BUILD_CANDLE");
/// The file whose presence (and checksum) marks a committed checkpoint.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The per-rank file listing that rank's components in saving order.
pub(super) const RANK_INDEX: &str = "components.json";

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

pub(super) fn encode_manifest(m: &Manifest) -> Result<Vec<u8>> {
    let body = serde_json::to_vec_pretty(m)?;
    let mut out = format!("{FRAME_HEAD}{:08x}{FRAME_MID}", crc32fast::hash(&body)).into_bytes();
    out.extend_from_slice(&body);
    out.extend_from_slice(FRAME_TAIL.as_bytes());
    Ok(out)
}

/// Reads and self-checks `dir/manifest.json` without touching the other files.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST_FILE);
    if std::fs::symlink_metadata(dir).is_err() {
        return Err(Error::checkpoint(
            dir,
            CheckpointErrorKind::Missing,
            "does not exist: no checkpoint was saved there (check the path)",
        ));
    }
    if std::fs::symlink_metadata(&path).is_err() {
        return Err(bad(
            dir,
            "has no manifest.json, so it is not a committed checkpoint (an interrupted save?); \
             pick another checkpoint",
        ));
    }
    let bytes = read_regular(&path, false)?;
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

pub(super) fn rank_dir(r: usize) -> String {
    format!("rank{r}")
}

/// Every regular file under `dir` (relative, `/`-separated), except the manifest; anything
/// that is neither a regular file nor a folder is an error naming it.
pub(super) fn list_files(dir: &Path) -> Result<BTreeSet<String>> {
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
            } else if !kind.is_file() {
                // Links, FIFOs, sockets and devices are refused without being opened: a FIFO
                // would block a reader forever, a link could point anywhere.
                return Err(bad(
                    &entry.path(),
                    format!(
                        "is {}; a checkpoint folder holds only regular files and folders: \
                         remove it",
                        kind_name(kind)
                    ),
                ));
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

/// Checks a listed path is a plain relative path inside the checkpoint.
pub(super) fn safe_rel(dir: &Path, rel: &str) -> Result<()> {
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

pub(super) fn check_entry(dir: &Path, e: &FileEntry, size: u64, crc: u32) -> Result<()> {
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
    check(dir, true)
}

/// [`verify`] without reading the files: the manifest, every rank present, every listed file
/// present with its recorded size, nothing unlisted. A load that checksums every file as it
/// reads it picks its checkpoint with this, so each file is read once.
pub(crate) fn verify_listing(dir: &Path) -> Result<Manifest> {
    check(dir, false)
}

fn check(dir: &Path, contents: bool) -> Result<Manifest> {
    let m = read_manifest(dir)?;
    let listed: BTreeSet<&str> = m.files.iter().map(|e| e.path.as_str()).collect();
    for r in 0..m.world_size {
        let index = format!("{}/{RANK_INDEX}", rank_dir(r));
        if !listed.contains(index.as_str()) {
            return Err(bad(dir, format!("manifest has no state for rank {r}")));
        }
    }
    // Listing first refuses FIFOs, devices and links before any file is opened.
    let present = list_files(dir)?;
    for e in &m.files {
        safe_rel(dir, &e.path)?;
        let path = dir.join(&e.path);
        if !present.contains(&e.path) {
            return Err(bad(&path, "is listed in the manifest but missing"));
        }
        if contents {
            let (size, crc) = size_and_crc(&path)?;
            check_entry(dir, e, size, crc)?;
        } else {
            let size = std::fs::symlink_metadata(&path)
                .map_err(io_at("reading the size of", &path))?
                .len();
            if size != e.size {
                // The size message of a full check; the checksum waits for the read.
                check_entry(dir, e, size, e.crc32)?;
            }
        }
    }
    for path in present {
        if !listed.contains(path.as_str()) {
            return Err(bad(
                &dir.join(&path),
                "is not listed in the manifest (a file from another save?)",
            ));
        }
    }
    Ok(m)
}
