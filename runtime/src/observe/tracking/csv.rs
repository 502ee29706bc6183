//! A tracker writing a CSV table: one row per `log` call.

use super::{project_dir, wall_time, Tracker};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Writes `<dir>/<project>/metrics.csv` with columns `step,wall_time,<metric>...`.
///
/// The metric columns start as the first call's names (sorted); a name first seen later gets
/// a new column at the right, and the file is rewritten once with the wider header, earlier
/// rows getting empty cells there. That keeps the file one valid table that any CSV reader
/// loads, at the cost of a rewrite each time a new name appears (rare in practice). A name
/// missing from a call leaves its cell empty. An existing file is continued, so a resumed run
/// keeps one table. Names with line breaks are refused; names with commas or quotes are quoted.
#[derive(Debug)]
pub struct CsvTracker {
    dir: PathBuf,
    path: Option<PathBuf>,
    columns: Vec<String>,
    header_written: bool,
    out: Option<BufWriter<File>>,
}

const FIXED: [&str; 2] = ["step", "wall_time"];

impl CsvTracker {
    /// A tracker writing under `dir` (one folder per project).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        CsvTracker {
            dir: dir.into(),
            path: None,
            columns: Vec::new(),
            header_written: false,
            out: None,
        }
    }

    /// The metrics file, once `init` has run.
    pub fn path(&self) -> Option<&PathBuf> {
        self.path.as_ref()
    }

    fn file(&self) -> Result<&Path> {
        self.path
            .as_deref()
            .ok_or_else(|| Error::Usage("csv: log before init".into()))
    }

    fn header(&self) -> String {
        let cells: Vec<String> = FIXED
            .iter()
            .map(|s| s.to_string())
            .chain(self.columns.iter().map(|c| quote(c)))
            .collect();
        cells.join(",") + "\n"
    }

    fn open_append(path: &Path) -> Result<BufWriter<File>> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        Ok(BufWriter::new(file))
    }

    /// Rewrites the file with `added` more columns: a wider header and an empty cell per new
    /// column in every earlier row (rows hold only numbers, so each is one line).
    fn widen(&mut self, added: usize) -> Result<()> {
        let path = self.file()?.to_path_buf();
        if let Some(mut out) = self.out.take() {
            out.flush()
                .map_err(|e| Error::io(format!("flushing {}", path.display()), e))?;
        }
        let old = std::fs::read_to_string(&path)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        let mut text = self.header();
        let pad = ",".repeat(added);
        for row in old.lines().skip(1).filter(|l| !l.is_empty()) {
            text.push_str(row);
            text.push_str(&pad);
            text.push('\n');
        }
        let tmp = path.with_extension("csv.tmp");
        std::fs::write(&tmp, text)
            .and_then(|_| std::fs::rename(&tmp, &path))
            .map_err(|e| Error::io(format!("rewriting {}", path.display()), e))?;
        self.out = Some(Self::open_append(&path)?);
        Ok(())
    }
}

impl Tracker for CsvTracker {
    fn name(&self) -> &str {
        "csv"
    }

    fn init(&mut self, project: &str, _config: &serde_json::Value) -> Result<()> {
        let path = project_dir(&self.dir, project)?.join("metrics.csv");
        let existing = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(Error::io(format!("reading {}", path.display()), e)),
        };
        if let Some(first) = existing.lines().next() {
            let cells = split_row(first);
            if cells.len() < 2 || cells[..2] != FIXED {
                return Err(Error::Usage(format!(
                    "{} exists but is not a metrics table written by ivme (its header does not \
                     start with `step,wall_time`); move it away or track into another folder",
                    path.display()
                )));
            }
            self.columns = cells[2..].to_vec();
            self.header_written = true;
        }
        self.out = Some(Self::open_append(&path)?);
        self.path = Some(path);
        Ok(())
    }

    fn log(&mut self, values: &BTreeMap<String, f64>, step: u64) -> Result<()> {
        let path = self.file()?.to_path_buf();
        if let Some(bad) = values.keys().find(|k| k.contains(['\n', '\r'])) {
            return Err(Error::Usage(format!(
                "csv: metric name {bad:?} contains a line break; rename it"
            )));
        }
        let new: Vec<String> = values
            .keys()
            .filter(|k| !self.columns.contains(k) && !FIXED.contains(&k.as_str()))
            .cloned()
            .collect();
        let added = new.len();
        self.columns.extend(new);
        let mut text = String::new();
        if !self.header_written {
            text.push_str(&self.header());
            self.header_written = true;
        } else if added > 0 {
            self.widen(added)?;
        }
        text.push_str(&format!("{step},{}", wall_time()));
        for col in &self.columns {
            text.push(',');
            if let Some(v) = values.get(col) {
                text.push_str(&v.to_string());
            }
        }
        text.push('\n');
        let Some(out) = self.out.as_mut() else {
            return Err(Error::Usage("csv: log after finish".into()));
        };
        out.write_all(text.as_bytes())
            .and_then(|_| out.flush())
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))
    }

    fn finish(&mut self) -> Result<()> {
        if let Some(mut out) = self.out.take() {
            let path = self.path.clone().unwrap_or_default();
            out.flush()
                .and_then(|_| out.get_ref().sync_all())
                .map_err(|e| Error::io(format!("closing {}", path.display()), e))?;
        }
        Ok(())
    }
}

/// Quotes a cell that holds a comma or a quote, doubling inner quotes (RFC 4180).
fn quote(cell: &str) -> String {
    if cell.contains([',', '"']) {
        format!("\"{}\"", cell.replace('"', "\"\""))
    } else {
        cell.to_string()
    }
}

/// Splits one CSV line into cells, undoing [`quote`].
fn split_row(line: &str) -> Vec<String> {
    let mut cells = Vec::new();
    let mut cell = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cell.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => cells.push(std::mem::take(&mut cell)),
            _ => cell.push(c),
        }
    }
    cells.push(cell);
    cells
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_round_trips() {
        let names = ["plain", "a,b", "say \"hi\"", ""];
        let line: Vec<String> = names.iter().map(|n| quote(n)).collect();
        assert_eq!(split_row(&line.join(",")), names);
    }
}
