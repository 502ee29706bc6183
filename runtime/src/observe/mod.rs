//! Seeing a run: metrics gathered across processes, output once, progress bars, held memory,
//! step times and profiles, and experiment trackers.

pub mod logging;
pub mod memory;
pub mod metrics;
pub mod profile;
pub mod progress;
pub mod step_times;
pub mod tracking;
