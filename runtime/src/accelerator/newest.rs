//! Resuming from the newest sound checkpoint of a project, reading each of its files once.
//!
//! The main process lists the checkpoints newest first and takes the first whose manifest,
//! listing and file sizes check out (no file is read for that). Every rank then reads what it
//! would load, checksumming each file as it arrives ([`Accelerator::classify_checkpoint`]). If
//! any rank finds a file that does not match the manifest, every rank drops that checkpoint
//! and the next older one is tried; a checkpoint that is sound but does not fit the run is an
//! error, with nothing changed.

use crate::accelerator::Accelerator;
use crate::checkpoint::plan::Checked;
use crate::checkpoint::plan::{skip, Newest, DAMAGED, FAILED, READY};
use crate::checkpoint::project::newest_first;
use crate::checkpoint::store::verify_listing;
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

impl Accelerator {
    /// Loads the newest checkpoint of `folders` (by the optimizer step its manifest records;
    /// the first folder's on a tie) whose every file matches its manifest, skipping damaged
    /// newer ones with a warning. Every rank must call it.
    pub(crate) fn load_newest(&mut self, folders: &[PathBuf]) -> Result<Newest> {
        let main = self.is_main_process();
        let candidates = if main {
            candidates(folders, |dir| self.recover_for_load(dir))
        } else {
            Ok(Vec::new())
        };
        let candidates = self.agree("listing the checkpoints", candidates)?;
        let mut next = 0;
        let mut newest_error: Option<String> = None;
        loop {
            // The main process picks the next candidate that passes the listing check.
            let pick = match main {
                true => next_listed(&candidates, &mut next, &mut newest_error),
                false => None,
            };
            let Some(dir) = self.broadcast_path(pick)? else {
                let found = match newest_error.take() {
                    Some(e) => Newest::NoneSound(candidates.len(), e),
                    None => Newest::Empty,
                };
                return self.agree_on_outcome(found);
            };
            if self.try_candidate(&dir, &mut newest_error)? {
                return Ok(Newest::Loaded(dir));
            }
        }
    }

    /// Checks candidate `dir` on every rank and loads it if every rank found it sound; false
    /// (with the reason in `newest_error` if none is there yet) when it is damaged here or on
    /// another rank, so that every rank moves on to the next older one. A candidate that does
    /// not fit this run is an error.
    fn try_candidate(&mut self, dir: &Path, newest_error: &mut Option<String>) -> Result<bool> {
        let checked = self.classify_checkpoint(dir);
        let code = match &checked {
            Ok(Checked::Ready(_)) => READY,
            Ok(Checked::Damaged(e)) => {
                skip(dir, e, newest_error);
                DAMAGED
            }
            Err(_) => FAILED,
        };
        let all = self.comm().all_gather_bytes(&[code])?;
        let worst = all.iter().filter_map(|c| c.first().copied()).max();
        match (checked, worst) {
            (Err(e), _) => Err(e),
            (Ok(_), Some(FAILED)) => Err(Error::Comm(format!(
                "checking the checkpoint {} failed on another rank; see its error message",
                dir.display()
            ))),
            (Ok(Checked::Ready(plan)), Some(READY)) => {
                self.apply_checked(*plan)?;
                Ok(true)
            }
            (Ok(_), _) => {
                newest_error.get_or_insert_with(|| {
                    format!(
                        "{} is damaged on another rank (see its warning)",
                        dir.display()
                    )
                });
                Ok(false)
            }
        }
    }

    /// Every rank ends the search alike: the main process's outcome decides, so a rank that
    /// saw no candidates (all but the main process) reports what the main process found.
    fn agree_on_outcome(&self, mine: Newest) -> Result<Newest> {
        // An empty message: nothing found; otherwise how many checkpoints, none sound.
        let said = match &mine {
            Newest::NoneSound(n, _) => (*n as u64).to_le_bytes().to_vec(),
            _ => Vec::new(),
        };
        let main = self.comm().broadcast_bytes(said, 0)?;
        Ok(match (mine, <[u8; 8]>::try_from(main.as_slice())) {
            (n @ Newest::NoneSound(..), _) if self.is_main_process() => n,
            (_, Ok(count)) => Newest::NoneSound(
                u64::from_le_bytes(count) as usize,
                "every one is damaged (see the main process's warnings)".into(),
            ),
            (_, Err(_)) => Newest::Empty,
        })
    }
}

/// Every checkpoint of `folders`, newest step first (the earlier folder's first on a tie);
/// `recover` runs on each folder before it is listed.
fn candidates(folders: &[PathBuf], recover: impl Fn(&Path)) -> Result<Vec<PathBuf>> {
    let mut all: Vec<PathBuf> = Vec::new();
    for folder in folders {
        recover(folder);
        all.extend(newest_first(folder)?);
    }
    if folders.len() > 1 {
        // Only then are manifests read here (the load reads them again): an unreadable one
        // sorts last and the listing check skips it. Stable: a tie keeps the earlier folder's.
        let step = |dir: &Path| crate::checkpoint::store::read_manifest(dir).map_or(0, |m| m.step);
        let mut stepped: Vec<(u64, PathBuf)> = all.into_iter().map(|d| (step(&d), d)).collect();
        stepped.sort_by_key(|(s, _)| std::cmp::Reverse(*s));
        all = stepped.into_iter().map(|(_, d)| d).collect();
    }
    Ok(all)
}

/// The next of `candidates` from `next` on whose listing checks out (no file is read for
/// that), moving `next` past it; the ones that fail are skipped with a warning.
fn next_listed(
    candidates: &[PathBuf],
    next: &mut usize,
    newest_error: &mut Option<String>,
) -> Option<PathBuf> {
    while *next < candidates.len() {
        let dir = &candidates[*next];
        *next += 1;
        match verify_listing(dir) {
            Ok(_) => return Some(dir.clone()),
            Err(e) => skip(dir, &e, newest_error),
        }
    }
    None
}
