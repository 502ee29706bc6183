//! Reading a family's `config.json` from a Hugging Face folder, with the file named in what is
//! refused.

use crate::error::{Error, Result};
use std::path::Path;

/// Reads `folder/config.json` (or `folder` itself when it is the file) and parses it with
/// `parse`; a refusal names the file.
pub(crate) fn read<T>(folder: &Path, parse: impl FnOnce(&str) -> Result<T>) -> Result<T> {
    let path = if folder.is_dir() {
        folder.join("config.json")
    } else {
        folder.to_path_buf()
    };
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    parse(&text).map_err(|e| match e {
        Error::Usage(m) => Error::Usage(format!("{}: {m}", path.display())),
        e => e,
    })
}
