//! Where automatically named checkpoints live, how they are numbered, found and rotated.

use std::path::{Path, PathBuf};

use super::fsio::remove_dir_atomic;
use super::store::{verify, Manifest, MANIFEST_FILE};
use crate::error::io_at;
use crate::error::{CheckpointErrorKind, Error, Result};

/// Prefix of automatically named checkpoint folders (`checkpoint_0`, `checkpoint_1`, ...).
const PREFIX: &str = "checkpoint_";

/// Settings for a project's output folder and its automatically named checkpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProjectConfiguration {
    /// The folder everything is saved under.
    pub project_dir: PathBuf,
    /// Whether saves without a path go to `project_dir/checkpoints/checkpoint_{n}`.
    pub automatic_checkpoint_naming: bool,
    /// How many committed checkpoints to keep; older ones are deleted after each new commit.
    pub total_limit: Option<usize>,
    /// The number the next automatic checkpoint gets, unless a higher one already exists.
    pub iteration: u64,
}

impl Default for ProjectConfiguration {
    fn default() -> Self {
        ProjectConfiguration {
            project_dir: PathBuf::from("."),
            automatic_checkpoint_naming: false,
            total_limit: None,
            iteration: 0,
        }
    }
}

impl ProjectConfiguration {
    /// A configuration saving under `project_dir`, with the other settings at their defaults.
    pub fn new(project_dir: impl Into<PathBuf>) -> Self {
        ProjectConfiguration {
            project_dir: project_dir.into(),
            ..Self::default()
        }
    }

    /// Turns automatic `checkpoint_{n}` naming on or off.
    pub fn automatic_checkpoint_naming(mut self, on: bool) -> Self {
        self.automatic_checkpoint_naming = on;
        self
    }

    /// Keeps at most `limit` committed checkpoints.
    pub fn total_limit(mut self, limit: usize) -> Self {
        self.total_limit = Some(limit);
        self
    }

    /// Sets the counter the next automatic checkpoint number starts from.
    pub fn iteration(mut self, n: u64) -> Self {
        self.iteration = n;
        self
    }

    /// Checks the settings once, with an error that says what to change.
    pub fn validate(&self) -> Result<()> {
        if self.total_limit == Some(0) {
            return Err(Error::config(
                ivme_settings::TOTAL_LIMIT.name,
                0,
                "keep at least 1 checkpoint, or set no limit",
            ));
        }
        Ok(())
    }

    /// The folder automatically named checkpoints go into: `project_dir/checkpoints`.
    pub fn checkpoints_dir(&self) -> PathBuf {
        self.project_dir.join("checkpoints")
    }

    /// The number the next automatic checkpoint gets: past both `iteration` and every
    /// `checkpoint_{n}` already on disk, so a resumed run never collides with an existing one.
    pub fn next_checkpoint_number(&self) -> Result<u64> {
        let after_existing = numbered(&self.checkpoints_dir())?
            .last()
            .map_or(0, |(n, _)| n + 1);
        Ok(after_existing.max(self.iteration))
    }

    /// The folder of the next automatic checkpoint: `project_dir/checkpoints/checkpoint_{n}`.
    pub fn next_checkpoint_dir(&self) -> Result<PathBuf> {
        let n = self.next_checkpoint_number()?;
        Ok(self.checkpoints_dir().join(format!("{PREFIX}{n}")))
    }
}

/// The number in a `checkpoint_{n}` folder name.
pub fn checkpoint_number(dir: &Path) -> Option<u64> {
    let name = dir.file_name()?.to_str()?;
    let digits = name.strip_prefix(PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Every `checkpoint_{n}` folder in `dir`, committed or not, sorted by number.
fn numbered(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    if !dir.is_dir() {
        return Ok(out);
    }
    for entry in std::fs::read_dir(dir).map_err(io_at("listing", dir))? {
        let path = entry.map_err(io_at("listing", dir))?.path();
        if let Some(n) = checkpoint_number(&path) {
            if path.is_dir() {
                out.push((n, path));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Every `checkpoint_{n}` folder in `checkpoints_dir`, newest (highest number) first.
pub(crate) fn newest_first(checkpoints_dir: &Path) -> Result<Vec<PathBuf>> {
    Ok(numbered(checkpoints_dir)?
        .into_iter()
        .rev()
        .map(|(_, d)| d)
        .collect())
}

/// The newest (by number) checkpoint in `checkpoints_dir` whose manifest verifies.
///
/// Checkpoints that fail verification are skipped with a warning on stderr naming why;
/// `Ok(None)` means there is none to resume from.
pub fn latest_valid(checkpoints_dir: &Path) -> Result<Option<(PathBuf, Manifest)>> {
    for (_, dir) in numbered(checkpoints_dir)?.into_iter().rev() {
        match verify(&dir) {
            Ok(manifest) => return Ok(Some((dir, manifest))),
            Err(e) => warn_user!("skipping checkpoint {}: {e}", dir.display()),
        }
    }
    Ok(None)
}

/// The checkpoint a restarted run should resume from: the newest in `checkpoints_dir` that
/// verifies.
///
/// `Ok(None)` when the folder holds no checkpoint at all (start fresh); an error naming the
/// newest one's problem when there are checkpoints but none verifies. Skipped damaged ones
/// are reported on stderr. Call [`clean_stale`](super::store::clean_stale) first, so a save
/// that crashed between its manifest and its rename counts.
pub fn find_resumable(checkpoints_dir: &Path) -> Result<Option<PathBuf>> {
    let all = numbered(checkpoints_dir)?;
    let mut newest_error = None;
    for (_, dir) in all.iter().rev() {
        match verify(dir) {
            Ok(_) => return Ok(Some(dir.clone())),
            Err(e) => {
                warn_user!(
                    "warning: skipping damaged checkpoint {}: {e}",
                    dir.display()
                );
                newest_error.get_or_insert(e);
            }
        }
    }
    match newest_error {
        None => Ok(None),
        Some(e) => Err(Error::checkpoint(
            checkpoints_dir,
            CheckpointErrorKind::Damaged,
            format!(
                "holds {} checkpoint(s) but none verifies (newest: {e}); delete the damaged \
                 folders to start fresh, or load an intact copy",
                all.len()
            ),
        )),
    }
}

/// Deletes the oldest committed checkpoints in `checkpoints_dir` so at most `total_limit`
/// remain, and returns the folders removed.
///
/// Call it only after a new checkpoint is committed. Folders without a manifest (a save in
/// progress or a damaged one) are neither counted nor touched.
pub fn rotate(checkpoints_dir: &Path, total_limit: usize) -> Result<Vec<PathBuf>> {
    if total_limit == 0 {
        return Err(Error::config(
            ivme_settings::TOTAL_LIMIT.name,
            0,
            "keep at least 1 checkpoint, or set no limit",
        ));
    }
    let committed: Vec<PathBuf> = numbered(checkpoints_dir)?
        .into_iter()
        .map(|(_, p)| p)
        .filter(|p| p.join(MANIFEST_FILE).is_file())
        .collect();
    let excess = committed.len().saturating_sub(total_limit);
    let doomed: Vec<PathBuf> = committed.into_iter().take(excess).collect();
    for dir in &doomed {
        remove_dir_atomic(dir)?;
    }
    Ok(doomed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_come_only_from_plain_checkpoint_names() {
        assert_eq!(checkpoint_number(Path::new("a/checkpoint_12")), Some(12));
        assert_eq!(checkpoint_number(Path::new("checkpoint_")), None);
        assert_eq!(checkpoint_number(Path::new(".checkpoint_3.tmp")), None);
        assert_eq!(checkpoint_number(Path::new("checkpoint_3b")), None);
    }

    #[test]
    fn builder_sets_every_field_and_validates_the_limit() {
        let c = ProjectConfiguration::new("/tmp/p")
            .automatic_checkpoint_naming(true)
            .total_limit(2)
            .iteration(5);
        assert_eq!(c.checkpoints_dir(), PathBuf::from("/tmp/p/checkpoints"));
        assert!(c.automatic_checkpoint_naming && c.iteration == 5);
        assert!(c.validate().is_ok());
        assert!(ProjectConfiguration::default()
            .total_limit(0)
            .validate()
            .is_err());
    }
}
