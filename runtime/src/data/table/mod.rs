//! Tables on disk (Parquet files, Arrow IPC files, a Hugging Face `datasets` cache folder) as
//! data sets: each row of the chosen columns is one sample, a [`Row`] of [`Value`]s.

#[cfg(feature = "arrow")]
mod arrow_files;
#[cfg(feature = "arrow")]
mod hf;
#[cfg(feature = "parquet")]
mod parquet_files;
mod row;
#[cfg(test)]
mod tests;

#[cfg(feature = "arrow")]
pub use arrow_files::ArrowFiles;
#[cfg(feature = "parquet")]
pub use parquet_files::ParquetFiles;
pub use row::{Row, Value};

use crate::{Error, Result};
use arrow_array::RecordBatch;
use arrow_schema::Schema;
use std::path::Path;
use std::sync::Arc;

/// The columns a table data set reads, checked against a file's schema.
#[derive(Clone, Debug)]
struct Columns {
    names: Arc<[String]>,
}

impl Columns {
    /// Takes the chosen column names; none chosen is refused (a table has no implied columns).
    fn new<S: AsRef<str>>(names: &[S], kind: &str) -> Result<Columns> {
        if names.is_empty() {
            return Err(Error::Usage(format!(
                "{kind}::open needs the names of the columns to read (e.g. &[\"text\"])"
            )));
        }
        let names: Vec<String> = names.iter().map(|n| n.as_ref().to_string()).collect();
        for (i, n) in names.iter().enumerate() {
            if names[..i].contains(n) {
                return Err(Error::Usage(format!(
                    "{kind}::open: the column `{n}` is named twice"
                )));
            }
        }
        Ok(Columns {
            names: names.into(),
        })
    }

    /// Checks that `schema` (of `path`) has every chosen column with a type a [`Value`] can
    /// hold, and returns their positions in the schema, in the chosen order.
    fn find_in(&self, schema: &Schema, path: &Path) -> Result<Vec<usize>> {
        self.names
            .iter()
            .map(|name| {
                let Ok(at) = schema.index_of(name) else {
                    let have: Vec<&str> =
                        schema.fields().iter().map(|f| f.name().as_str()).collect();
                    return Err(Error::Usage(format!(
                        "{} has no column `{name}`; its columns are: {}",
                        path.display(),
                        have.join(", ")
                    )));
                };
                let dt = schema.field(at).data_type();
                if !row::readable(dt) {
                    return Err(Error::Usage(format!(
                        "column `{name}` of {} holds {dt}; ivme reads booleans, integers, floats, \
                         text, and lists of integers or floats: choose another column or convert \
                         this one",
                        path.display()
                    )));
                }
                Ok(at)
            })
            .collect()
    }

    /// Returns the row `at` of `batch` (which holds the chosen columns by name) as a [`Row`].
    fn row_of(&self, batch: &RecordBatch, at: usize, file: &Arc<str>, row: usize) -> Result<Row> {
        let mut values = Vec::with_capacity(self.names.len());
        for name in self.names.iter() {
            let Some(col) = batch.column_by_name(name) else {
                return Err(Error::Usage(format!(
                    "row {row} of {file}: the column `{name}` is missing from its batch"
                )));
            };
            let value = row::value_at(col.as_ref(), at).map_err(|why| {
                Error::Usage(format!("row {row} of {file}, column `{name}`: {why}"))
            })?;
            values.push(value);
        }
        Ok(Row::new(self.names.clone(), values, file.clone(), row))
    }

    /// Returns the chosen column names.
    fn names(&self) -> &[String] {
        &self.names
    }
}

/// Where each file's rows start in the whole data set.
#[derive(Clone, Debug, Default)]
struct Offsets {
    /// The first row of each file, then the total.
    firsts: Vec<usize>,
}

impl Offsets {
    /// Adds a file of `rows` rows at the end.
    fn push(&mut self, rows: usize) {
        if self.firsts.is_empty() {
            self.firsts.push(0);
        }
        let last = *self.firsts.last().unwrap_or(&0);
        self.firsts.push(last + rows);
    }

    /// Returns the number of rows of all files.
    fn len(&self) -> usize {
        self.firsts.last().copied().unwrap_or(0)
    }

    /// Returns the file holding row `index` and the row's number within it.
    fn locate(&self, index: usize) -> (usize, usize) {
        let k = self.firsts.partition_point(|&f| f <= index) - 1;
        (k, index - self.firsts[k])
    }

    /// Refuses a row past the end, naming both numbers.
    fn check(&self, index: usize, kind: &str) -> Result<()> {
        if index < self.len() {
            return Ok(());
        }
        Err(Error::Usage(format!(
            "{kind}: row {index} is past the end ({} rows)",
            self.len()
        )))
    }
}

/// Refuses files whose chosen columns have other types than the first file's.
fn same_types(first: &Schema, first_path: &Path, now: &Schema, path: &Path) -> Result<()> {
    for (a, b) in first.fields().iter().zip(now.fields().iter()) {
        if a.data_type() != b.data_type() {
            return Err(Error::Usage(format!(
                "column `{}` holds {} in {} but {} in {}: the files of one data set need the same \
                 column types",
                a.name(),
                a.data_type(),
                first_path.display(),
                b.data_type(),
                path.display()
            )));
        }
    }
    Ok(())
}

/// What a file that a table reader refused holds, judged by its first and last bytes, and
/// which reader fits it: "it starts with 50 41 52 31 and ends with 50 41 52 31, as a Parquet
/// file does: open it with ParquetFiles".
pub(crate) fn what_it_is(path: &Path) -> String {
    use std::os::unix::fs::FileExt;
    let Ok(file) = std::fs::File::open(path) else {
        return String::new();
    };
    let size = file.metadata().map_or(0, |m| m.len());
    let mut head = vec![0u8; size.min(8) as usize];
    let tail_len = size.min(4);
    let mut tail = vec![0u8; tail_len as usize];
    if file.read_exact_at(&mut head, 0).is_err()
        || file.read_exact_at(&mut tail, size - tail_len).is_err()
    {
        return String::new();
    }
    let hex = |b: &[u8]| {
        b.iter()
            .map(|x| format!("{x:02x}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let read = format!(
        "its {size} bytes start with {} and end with {}",
        hex(&head),
        hex(&tail)
    );
    let fits = if head.starts_with(b"PAR1") && tail == b"PAR1" {
        "as a Parquet file's do (`PAR1` at both ends): open it with ParquetFiles"
    } else if head.starts_with(b"ARROW1") {
        "as an Arrow IPC file's do (`ARROW1`): open it with ArrowFiles"
    } else if head.starts_with(&[0xff; 4]) {
        "as an Arrow IPC stream's do (ff ff ff ff): open it with ArrowFiles"
    } else if head.len() >= 4 && head[..4] == 20240520i32.to_le_bytes() {
        "as an llm.c token file's do (magic 20240520): open it with TokenFile"
    } else if !head.is_empty()
        && head
            .iter()
            .all(|b| b.is_ascii_graphic() || b.is_ascii_whitespace())
    {
        "as text does: open it with TextLines or JsonLines"
    } else {
        "where a Parquet file has `PAR1` at both ends and an Arrow IPC file starts with `ARROW1` (a stream with ff ff ff ff)"
    };
    format!("{read}, {fits}")
}
