//! Seeing a run: metrics gathered across processes, output once, progress bars, held memory
//! and experiment trackers.

pub mod logging;
pub mod memory;
pub mod metrics;
pub mod progress;
pub mod step_times;
pub mod tracking;
