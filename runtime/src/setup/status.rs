//! What a rank tells `ivme launch` through the status folder its rank wrapper names
//! (`IVME_STATUS_DIR`): that its failure would recur on a restart, so `--max_restarts` stops.

use crate::error::Error;

/// The variable in which the launcher's rank wrapper names the status folder.
pub const STATUS_DIR_VAR: &str = "IVME_STATUS_DIR";

/// Notes `e` for the launcher when a restart would fail the same way
/// ([`Error::recurs_on_restart`]): `final-{rank}` holds its message. Returns `e`. Nothing is
/// written outside `ivme launch`.
pub(crate) fn note_final(rank: usize, e: Error) -> Error {
    if e.recurs_on_restart() {
        if let Some(dir) = std::env::var_os(STATUS_DIR_VAR).filter(|d| !d.is_empty()) {
            let file = std::path::Path::new(&dir).join(format!("final-{rank}"));
            // Best effort: the error itself still reaches the program.
            let _ = std::fs::write(file, format!("{e}\n"));
        }
    }
    e
}
