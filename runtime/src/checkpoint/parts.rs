//! The Accelerator's checkpointing part: where automatic checkpoints go, the folder locks
//! this job holds, the save running in the background and the objects registered to be
//! saved with the training state.

use std::path::Path;

use super::background::BackgroundSaves;
use super::lock::FolderLock;
use super::project::ProjectConfiguration;
use crate::error::{Error, Result};
use crate::stateful::{StateDict, Stateful};

/// What the Accelerator keeps between saves.
pub(crate) struct Checkpointing {
    project: Option<ProjectConfiguration>,
    /// Checkpoint folders this job writes (held from the first automatic save until drop).
    locks: Vec<FolderLock>,
    background: BackgroundSaves,
    registered: Vec<Box<dyn Stateful>>,
    snapshots: super::snapshots::Snapshots,
}

impl Checkpointing {
    /// Nothing saved or registered yet; saves asynchronous by default when `async_saves`.
    pub(crate) fn new(project: Option<ProjectConfiguration>, async_saves: bool) -> Self {
        Checkpointing {
            project,
            locks: Vec::new(),
            background: BackgroundSaves::new(async_saves),
            registered: Vec::new(),
            snapshots: Default::default(),
        }
    }

    /// Takes in-memory snapshots as `snapshots` says.
    pub(crate) fn with_snapshots(mut self, snapshots: super::snapshots::Snapshots) -> Self {
        self.snapshots = snapshots;
        self
    }

    /// When and where in-memory snapshots are taken.
    pub(crate) fn snapshots(&self) -> &super::snapshots::Snapshots {
        &self.snapshots
    }

    /// The same, to record a snapshot taken.
    pub(crate) fn snapshots_mut(&mut self) -> &mut super::snapshots::Snapshots {
        &mut self.snapshots
    }

    /// The project configuration, if one was set.
    pub(crate) fn project(&self) -> Option<&ProjectConfiguration> {
        self.project.as_ref()
    }

    /// Sets the project configuration (validated by the caller).
    pub(crate) fn set_project(&mut self, config: ProjectConfiguration) {
        self.project = Some(config);
    }

    /// Counts a committed automatic checkpoint; the project, for rotation.
    pub(crate) fn count_committed(&mut self) -> Option<&ProjectConfiguration> {
        let p = self.project.as_mut()?;
        p.iteration += 1;
        Some(p)
    }

    /// Takes the lock on `parent` unless this job holds it already.
    pub(crate) fn hold_lock(&mut self, parent: &Path) -> Result<()> {
        let key = parent
            .canonicalize()
            .map_err(|e| Error::io(format!("resolving {}", parent.display()), e))?;
        if !self.locks.iter().any(|l| l.dir() == key) {
            self.locks.push(FolderLock::acquire(parent)?);
        }
        Ok(())
    }

    /// The save being written in the background, and the host buffers saves copy into.
    pub(crate) fn background(&self) -> &BackgroundSaves {
        &self.background
    }

    /// The background saves, to start, finish or give up one.
    pub(crate) fn background_mut(&mut self) -> &mut BackgroundSaves {
        &mut self.background
    }

    /// The registered objects, in registration order.
    pub(crate) fn registered(&self) -> &[Box<dyn Stateful>] {
        &self.registered
    }

    /// Each registered object's state, in registration order.
    pub(crate) fn registered_states(&self) -> Result<Vec<StateDict>> {
        self.registered.iter().map(|r| r.state_dict()).collect()
    }

    /// The registered objects, to restore.
    pub(crate) fn registered_mut(&mut self) -> &mut [Box<dyn Stateful>] {
        &mut self.registered
    }

    /// Registers one more object to save with the training state.
    pub(crate) fn register(&mut self, object: Box<dyn Stateful>) {
        self.registered.push(object);
    }
}
