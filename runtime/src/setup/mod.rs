//! Who this process is and how it is set: settings by precedence (code, then the launcher's
//! environment, then defaults), the launcher's contract, and the process's place and device.

pub(crate) mod allocator;
pub mod config;
pub mod env;
pub mod preempt;
pub mod state;
pub(crate) mod status;
pub(crate) mod threads;
