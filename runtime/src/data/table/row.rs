//! One row of a table data set, and the Arrow column types it can hold.

use crate::{Error, Result};
use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float16Type, Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type,
    UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::Array;
use arrow_schema::DataType;
use std::sync::Arc;

/// One value of a [`Row`].
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// A null.
    Null,
    /// A boolean.
    Bool(bool),
    /// An integer of any width (unsigned 64-bit values above `i64::MAX` are refused).
    Int(i64),
    /// A float of any width.
    Float(f64),
    /// A string.
    Text(String),
    /// A list of integers (token ids, labels).
    Ints(Vec<i64>),
    /// A list of floats (an embedding, features).
    Floats(Vec<f64>),
}

/// One sample of a table data set: the chosen columns of one row, by name.
///
/// The accessors name the file, the row and the column when a value is missing or of another
/// kind, so a bad row is found without a debugger.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    names: Arc<[String]>,
    values: Vec<Value>,
    file: Arc<str>,
    row: usize,
}

impl Row {
    /// Builds a row of `values` for the columns `names`, found at row `row` of `file`.
    pub(super) fn new(names: Arc<[String]>, values: Vec<Value>, file: Arc<str>, row: usize) -> Row {
        Row {
            names,
            values,
            file,
            row,
        }
    }

    /// Returns the value of `column`.
    pub fn get(&self, column: &str) -> Result<&Value> {
        match self.names.iter().position(|n| n == column) {
            Some(i) => Ok(&self.values[i]),
            None => Err(Error::Usage(format!(
                "{}: `{column}` is not one of the columns the data set reads ({})",
                self.place(),
                self.names.join(", ")
            ))),
        }
    }

    /// Returns the values, in the order the columns were chosen.
    pub fn values(&self) -> &[Value] {
        &self.values
    }

    /// Returns the file the row was read from and its row number there (0-based).
    pub fn source(&self) -> (&str, usize) {
        (&self.file, self.row)
    }

    /// Returns the text of `column`.
    pub fn text(&self, column: &str) -> Result<&str> {
        match self.get(column)? {
            Value::Text(s) => Ok(s),
            other => Err(self.wrong(column, "text", other)),
        }
    }

    /// Returns the integer of `column`.
    pub fn int(&self, column: &str) -> Result<i64> {
        match self.get(column)? {
            Value::Int(v) => Ok(*v),
            other => Err(self.wrong(column, "an integer", other)),
        }
    }

    /// Returns the float of `column` (an integer column's value is converted).
    pub fn float(&self, column: &str) -> Result<f64> {
        match self.get(column)? {
            Value::Float(v) => Ok(*v),
            Value::Int(v) => Ok(*v as f64),
            other => Err(self.wrong(column, "a number", other)),
        }
    }

    /// Returns the list of integers of `column`.
    pub fn ints(&self, column: &str) -> Result<&[i64]> {
        match self.get(column)? {
            Value::Ints(v) => Ok(v),
            other => Err(self.wrong(column, "a list of integers", other)),
        }
    }

    /// Returns the list of integers of `column` as token ids, refusing a negative or too large
    /// one (a `-100` "ignore" label, for instance, is not an id: read it with [`ints`](Row::ints)).
    pub fn ids(&self, column: &str) -> Result<Vec<u32>> {
        let ints = self.ints(column)?;
        ints.iter()
            .enumerate()
            .map(|(i, &v)| {
                u32::try_from(v).map_err(|_| {
                    Error::Usage(format!(
                        "{}: item {i} of column `{column}` is {v}, not a token id (0..=u32::MAX)",
                        self.place()
                    ))
                })
            })
            .collect()
    }

    /// Returns the list of floats of `column`.
    pub fn floats(&self, column: &str) -> Result<&[f64]> {
        match self.get(column)? {
            Value::Floats(v) => Ok(v),
            other => Err(self.wrong(column, "a list of floats", other)),
        }
    }

    /// Says where the row is, for errors.
    fn place(&self) -> String {
        format!("row {} of {}", self.row, self.file)
    }

    /// The error for a value of another kind than asked.
    fn wrong(&self, column: &str, wanted: &str, got: &Value) -> Error {
        let got = match got {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Int(_) => "an integer",
            Value::Float(_) => "a float",
            Value::Text(_) => "text",
            Value::Ints(_) => "a list of integers",
            Value::Floats(_) => "a list of floats",
        };
        Error::Usage(format!(
            "{}: column `{column}` holds {got}, not {wanted}",
            self.place()
        ))
    }
}

/// Returns true when a column of type `dt` can be read into [`Value`]s.
pub(super) fn readable(dt: &DataType) -> bool {
    use DataType::*;
    match dt {
        Boolean | Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64 | Float16
        | Float32 | Float64 | Utf8 | LargeUtf8 | Utf8View | Null => true,
        List(f) | LargeList(f) | FixedSizeList(f, _) => {
            is_int(f.data_type()) || is_float(f.data_type())
        }
        _ => false,
    }
}

fn is_int(dt: &DataType) -> bool {
    use DataType::*;
    matches!(
        dt,
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64
    )
}

fn is_float(dt: &DataType) -> bool {
    use DataType::*;
    matches!(dt, Float16 | Float32 | Float64)
}

/// Reads entry `i` of `array` (of a [`readable`] type).
pub(super) fn value_at(array: &dyn Array, i: usize) -> std::result::Result<Value, String> {
    use DataType::*;
    if array.is_null(i) {
        return Ok(Value::Null);
    }
    Ok(match array.data_type() {
        Null => Value::Null,
        Boolean => Value::Bool(array.as_boolean().value(i)),
        Utf8 => Value::Text(array.as_string::<i32>().value(i).to_string()),
        LargeUtf8 => Value::Text(array.as_string::<i64>().value(i).to_string()),
        Utf8View => Value::Text(array.as_string_view().value(i).to_string()),
        List(_) => list(array.as_list::<i32>().value(i).as_ref())?,
        LargeList(_) => list(array.as_list::<i64>().value(i).as_ref())?,
        FixedSizeList(..) => list(array.as_fixed_size_list().value(i).as_ref())?,
        dt if is_float(dt) => Value::Float(float_at(array, i)),
        dt if is_int(dt) => Value::Int(int_at(array, i)?),
        dt => return Err(format!("a column of {dt} cannot be read")),
    })
}

/// Reads a list's items: integers or floats, no nulls.
fn list(items: &dyn Array) -> std::result::Result<Value, String> {
    if items.null_count() > 0 {
        return Err("the list holds a null item; ivme reads lists without nulls".into());
    }
    let n = items.len();
    if is_float(items.data_type()) {
        return Ok(Value::Floats((0..n).map(|j| float_at(items, j)).collect()));
    }
    Ok(Value::Ints(
        (0..n)
            .map(|j| int_at(items, j))
            .collect::<std::result::Result<_, _>>()?,
    ))
}

fn float_at(array: &dyn Array, i: usize) -> f64 {
    match array.data_type() {
        DataType::Float16 => array.as_primitive::<Float16Type>().value(i).to_f64(),
        DataType::Float32 => array.as_primitive::<Float32Type>().value(i) as f64,
        _ => array.as_primitive::<Float64Type>().value(i),
    }
}

fn int_at(array: &dyn Array, i: usize) -> std::result::Result<i64, String> {
    Ok(match array.data_type() {
        DataType::Int8 => array.as_primitive::<Int8Type>().value(i) as i64,
        DataType::Int16 => array.as_primitive::<Int16Type>().value(i) as i64,
        DataType::Int32 => array.as_primitive::<Int32Type>().value(i) as i64,
        DataType::Int64 => array.as_primitive::<Int64Type>().value(i),
        DataType::UInt8 => array.as_primitive::<UInt8Type>().value(i) as i64,
        DataType::UInt16 => array.as_primitive::<UInt16Type>().value(i) as i64,
        DataType::UInt32 => array.as_primitive::<UInt32Type>().value(i) as i64,
        _ => {
            let v = array.as_primitive::<UInt64Type>().value(i);
            i64::try_from(v).map_err(|_| format!("the unsigned value {v} is above i64::MAX"))?
        }
    })
}
