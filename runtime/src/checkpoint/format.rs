//! A small reader and writer for the safetensors file format, shared by model files and
//! checkpoint folders.
//!
//! The format is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
//! shape and byte range, plus an optional `__metadata__` string map), then the raw
//! little-endian tensor bytes. Writing it here (rather than through candle's `save`) lets ivme
//! stream tensors straight from their storage and add the `format: pt` metadata the Hugging
//! Face loaders check.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use serde_json::{Map, Value};

pub(crate) use super::read::{read_header, read_tensors};
use crate::error::{CheckpointErrorKind, Error, Result};

/// Upper bound on the JSON header, matching the reference implementation's guard against
/// files that claim absurd header sizes.
const MAX_HEADER: u64 = 100_000_000;

/// Where a tensor lives inside a safetensors file.
#[derive(Debug, Clone)]
pub(crate) struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Byte range relative to the start of the data section.
    pub start: usize,
    pub end: usize,
}

/// A parsed safetensors header.
#[derive(Debug, Clone)]
pub(crate) struct Header {
    /// Tensors in the order their bytes appear in the file.
    pub tensors: Vec<TensorInfo>,
    pub metadata: BTreeMap<String, String>,
}

pub(crate) fn bad(path: &Path, msg: impl Into<String>) -> Error {
    Error::checkpoint(path, CheckpointErrorKind::Damaged, msg)
}

/// A sound checkpoint (its files match their manifest) that does not fit this run: `path`,
/// then what differs and what to do. A load refused this way falls back to nothing.
pub(crate) fn unfit(path: &Path, msg: impl Into<String>) -> Error {
    Error::checkpoint(path, CheckpointErrorKind::Unfit, msg)
}

fn dtype_name(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::U8 => "U8",
        DType::U32 => "U32",
        DType::I16 => "I16",
        DType::I32 => "I32",
        DType::I64 => "I64",
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        DType::F32 => "F32",
        DType::F64 => "F64",
        DType::F8E4M3 => "F8_E4M3",
        _ => return None,
    })
}

fn dtype_from_name(name: &str) -> Option<DType> {
    Some(match name {
        "U8" => DType::U8,
        "U32" => DType::U32,
        "I16" => DType::I16,
        "I32" => DType::I32,
        "I64" => DType::I64,
        "BF16" => DType::BF16,
        "F16" => DType::F16,
        "F32" => DType::F32,
        "F64" => DType::F64,
        "F8_E4M3" => DType::F8E4M3,
        _ => return None,
    })
}

/// Number of data bytes a tensor occupies in a file.
pub(crate) fn byte_len(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// Writes `tensors` (in the given order) as one safetensors stream and returns the bytes written.
pub(crate) fn write_safetensors<W: Write>(
    w: &mut W,
    tensors: &[(&str, &Tensor)],
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<u64> {
    let mut header = Map::new();
    if let Some(meta) = metadata {
        let meta: Map<String, Value> = meta
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        header.insert("__metadata__".into(), Value::Object(meta));
    }
    let mut offset = 0u64;
    for (name, t) in tensors {
        let dtype = dtype_name(t.dtype()).ok_or_else(|| {
            Error::Usage(format!(
                "tensor `{name}` has dtype {:?}, which ivme cannot save yet: convert it to \
                 f32, f16 or bf16 first",
                t.dtype()
            ))
        })?;
        if *name == "__metadata__" || header.contains_key(*name) {
            return Err(Error::Usage(format!(
                "tensor name `{name}` is reserved or appears twice: give each tensor a unique name"
            )));
        }
        let end = offset + byte_len(t);
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": t.dims(), "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut text = serde_json::to_vec(&Value::Object(header))?;
    // Aligning the data section to 8 bytes lets readers map it without copying.
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let io = |e| Error::io("writing the safetensors header", e);
    w.write_all(&(text.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(&text).map_err(io)?;
    for (_, t) in tensors {
        write_tensor_bytes(w, t)?;
    }
    Ok(8 + text.len() as u64 + offset)
}

/// Writes elements as little-endian bytes: straight from memory on a little-endian machine,
/// else converted in bounded chunks so no second full copy is made.
fn put<T: Copy, const N: usize, W: Write>(
    w: &mut W,
    xs: &[T],
    to_bytes: impl Fn(T) -> [u8; N],
) -> Result<()> {
    if cfg!(target_endian = "little") && std::mem::size_of::<T>() == N {
        // SAFETY: `T` is one of candle's plain number types (integers, floats, half floats):
        // `N` bytes each, all initialised, no padding; `u8` needs no alignment; the slice
        // covers exactly the memory of `xs`, which outlives it. In memory they already are
        // the little-endian bytes safetensors stores.
        let bytes = unsafe {
            std::slice::from_raw_parts(xs.as_ptr().cast::<u8>(), std::mem::size_of_val(xs))
        };
        return w
            .write_all(bytes)
            .map_err(|e| Error::io("writing tensor data", e));
    }
    const CHUNK: usize = 1 << 16;
    let mut buf = Vec::with_capacity(CHUNK * N);
    for chunk in xs.chunks(CHUNK) {
        buf.clear();
        for &x in chunk {
            buf.extend_from_slice(&to_bytes(x));
        }
        w.write_all(&buf)
            .map_err(|e| Error::io("writing tensor data", e))?;
    }
    Ok(())
}

fn write_tensor_bytes<W: Write>(w: &mut W, t: &Tensor) -> Result<()> {
    let t = match t.device() {
        Device::Cpu => t.clone(),
        _ => t.to_device(&Device::Cpu)?,
    };
    let t = if t.is_contiguous() {
        t
    } else {
        t.contiguous()?
    };
    let (storage, layout) = t.storage_and_layout();
    let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
        Error::Usage("a tensor stayed non-contiguous after `contiguous()`".into())
    })?;
    let Storage::Cpu(cpu) = &*storage else {
        return Err(Error::Usage(
            "a tensor copied to the CPU has no CPU storage".into(),
        ));
    };
    match cpu {
        CpuStorage::U8(v) => w
            .write_all(&v[start..end])
            .map_err(|e| Error::io("writing tensor data", e)),
        CpuStorage::U32(v) => put(w, &v[start..end], u32::to_le_bytes),
        CpuStorage::I16(v) => put(w, &v[start..end], i16::to_le_bytes),
        CpuStorage::I32(v) => put(w, &v[start..end], i32::to_le_bytes),
        CpuStorage::I64(v) => put(w, &v[start..end], i64::to_le_bytes),
        CpuStorage::BF16(v) => put(w, &v[start..end], |x| x.to_bits().to_le_bytes()),
        CpuStorage::F16(v) => put(w, &v[start..end], |x| x.to_bits().to_le_bytes()),
        CpuStorage::F32(v) => put(w, &v[start..end], f32::to_le_bytes),
        CpuStorage::F64(v) => put(w, &v[start..end], f64::to_le_bytes),
        CpuStorage::F8E4M3(v) => put(w, &v[start..end], |x| [x.to_bits()]),
        _ => Err(Error::Usage(format!(
            "tensors of dtype {:?} cannot be saved yet: convert them to f32 first",
            t.dtype()
        ))),
    }
}

fn entry_field<'a>(path: &Path, name: &str, v: &'a Value, key: &str) -> Result<&'a Value> {
    v.get(key)
        .ok_or_else(|| bad(path, format!("header entry `{name}` has no `{key}`")))
}

fn as_usizes(path: &Path, name: &str, v: &Value) -> Result<Vec<usize>> {
    let arr = v
        .as_array()
        .ok_or_else(|| bad(path, format!("header entry `{name}` is malformed")))?;
    arr.iter()
        .map(|x| {
            x.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| {
                    bad(
                        path,
                        format!("header entry `{name}` has a size that is not a non-negative integer this machine can address"),
                    )
                })
        })
        .collect()
}

/// Bytes a tensor of `shape` and `dtype` occupies, or `None` when that overflows.
fn checked_bytes(shape: &[usize], dtype: DType) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))?
        .checked_mul(dtype.size_in_bytes())
}

/// Parses and validates a header: known dtypes, sizes that match shapes, and byte ranges that
/// tile the data section exactly (which also catches truncated files).
pub(crate) fn parse_header(path: &Path, text: &[u8], data_len: u64) -> Result<Header> {
    let value: Value = serde_json::from_slice(text).map_err(|e| {
        bad(
            path,
            format!("the safetensors header is not valid JSON ({e})"),
        )
    })?;
    let Value::Object(map) = value else {
        return Err(bad(path, "the safetensors header is not a JSON object"));
    };
    let mut metadata = BTreeMap::new();
    let mut tensors = Vec::new();
    for (name, v) in &map {
        if name == "__metadata__" {
            let obj = v
                .as_object()
                .ok_or_else(|| bad(path, "`__metadata__` is not a JSON object"))?;
            for (k, s) in obj {
                let s = s
                    .as_str()
                    .ok_or_else(|| bad(path, "metadata values must be strings"))?;
                metadata.insert(k.clone(), s.to_string());
            }
            continue;
        }
        let dtype_text = entry_field(path, name, v, "dtype")?.as_str().unwrap_or("?");
        let dtype = dtype_from_name(dtype_text).ok_or_else(|| {
            bad(
                path,
                format!("tensor `{name}` has dtype {dtype_text}, which ivme cannot read"),
            )
        })?;
        let shape = as_usizes(path, name, entry_field(path, name, v, "shape")?)?;
        let offsets = as_usizes(path, name, entry_field(path, name, v, "data_offsets")?)?;
        let [start, end] = offsets[..] else {
            return Err(bad(path, format!("tensor `{name}` needs two data offsets")));
        };
        let want = checked_bytes(&shape, dtype).ok_or_else(|| {
            bad(
                path,
                format!("tensor `{name}` has shape {shape:?}, whose size overflows (crafted or corrupt header)"),
            )
        })?;
        if end < start || end - start != want {
            return Err(bad(
                path,
                format!("tensor `{name}` spans {start}..{end} but its shape needs {want} bytes"),
            ));
        }
        tensors.push(TensorInfo {
            name: name.clone(),
            dtype,
            shape,
            start,
            end,
        });
    }
    tensors.sort_by_key(|t| (t.start, t.end));
    let mut at = 0usize;
    for t in &tensors {
        if t.start != at {
            return Err(bad(
                path,
                format!(
                    "tensor `{}` does not start where the previous one ends",
                    t.name
                ),
            ));
        }
        at = t.end;
    }
    if u64::try_from(at).ok() != Some(data_len) {
        return Err(bad(
            path,
            format!("the header describes {at} data bytes but the file holds {data_len} (truncated or padded file)"),
        ));
    }
    Ok(Header { tensors, metadata })
}

pub(super) fn header_len(path: &Path, prefix: &[u8], file_len: u64) -> Result<u64> {
    let n = u64::from_le_bytes(prefix.try_into().map_err(|_| bad(path, "file too short"))?);
    if n > MAX_HEADER || n.saturating_add(8) > file_len {
        return Err(bad(
            path,
            format!("header length {n} does not fit a {file_len}-byte file"),
        ));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(entry: Value) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({ "t": entry })).unwrap()
    }

    #[test]
    fn crafted_headers_are_errors_not_panics() {
        let p = Path::new("crafted.safetensors");
        let huge = usize::MAX as u64;
        for (entry, data_len, says) in [
            // The shape's product overflows usize.
            (
                serde_json::json!({"dtype": "F32", "shape": [1u64 << 40, 1u64 << 40], "data_offsets": [0, 16]}),
                16,
                "overflows",
            ),
            (
                serde_json::json!({"dtype": "F32", "shape": [huge, 2], "data_offsets": [0, 8]}),
                8,
                "overflows",
            ),
            // The product fits but times the element size does not.
            (
                serde_json::json!({"dtype": "F64", "shape": [huge / 4], "data_offsets": [0, 8]}),
                8,
                "overflows",
            ),
            // Offsets beyond any real file, reversed or not matching the shape.
            (
                serde_json::json!({"dtype": "U8", "shape": [4], "data_offsets": [huge - 4, huge]}),
                4,
                "does not start",
            ),
            (
                serde_json::json!({"dtype": "U8", "shape": [4], "data_offsets": [8, 4]}),
                4,
                "spans",
            ),
            (
                serde_json::json!({"dtype": "U8", "shape": [4], "data_offsets": [0, huge]}),
                4,
                "spans",
            ),
            (
                serde_json::json!({"dtype": "U8", "shape": [-1], "data_offsets": [0, 4]}),
                4,
                "non-negative",
            ),
            (
                serde_json::json!({"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}),
                1 << 40,
                "truncated",
            ),
        ] {
            let err = parse_header(p, &header(entry.clone()), data_len)
                .unwrap_err()
                .to_string();
            assert!(err.contains(says), "{entry}: {err}");
        }
        // A header length past the end of the file or absurdly large is refused up front.
        for n in [u64::MAX, u64::MAX - 7, MAX_HEADER + 1, 100] {
            let err = header_len(p, &n.to_le_bytes(), 64).unwrap_err().to_string();
            assert!(err.contains("does not fit"), "{n}: {err}");
        }
    }
}
