//! Reading safetensors files at disk speed: each tensor's bytes go straight from the file into
//! the typed buffer the tensor will own (no intermediate copy), and a checksum is taken over
//! those same bytes as they arrive, so a checked file is read exactly once.
//!
//! [`read_checked`] reads a whole file for a load that applies nothing until every file
//! verified: a large file is read in byte ranges by a few threads at once (positioned reads on
//! one descriptor, each range checksummed on its own and the sums combined in file order).
//! [`read_tensors`] streams a file one tensor at a time, keeping memory near one tensor.

use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::Path;

use candle_core::{CpuStorage, DType, Device, Tensor, WithDType};

use super::format::{bad, header_len, parse_header, Header, TensorInfo};
use super::fsio::open_regular;
use crate::error::{Error, Result};

/// Below this many data bytes a file is read by one thread: it takes a few milliseconds at
/// most, against tens of microseconds to start a thread (two readers measured 1.1-1.9x faster
/// than one on 100 MB and 1 GB files on a 2-core machine; smaller files were not measured).
const PARALLEL_MIN: usize = 16 << 20;
/// Largest piece one positioned read asks for: ranges balance across threads even when one
/// tensor dominates the file, and the checksum reads each piece back from the cache the read
/// left it in.
pub(super) const PIECE: usize = 1 << 20;

fn io_reading(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::io(format!("reading {}", path.display()), e)
}

/// The bytes of a slice of plain numbers, to read into.
fn as_bytes_mut<T: WithDType>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: `T` is one of candle's plain number types (integers, floats, half and 8-bit
    // floats): no padding, and every bit pattern is a valid value, so any bytes written through
    // this view leave valid elements. The view covers exactly the memory of `v` and borrows it.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// A zeroed buffer for `len` bytes of `dtype` (`len` a multiple of the element size, as
/// [`parse_header`] checks). For the primitive types a large zeroed buffer comes from the
/// allocator untouched, so the read is the first to write it.
pub(super) fn zeroed(path: &Path, dtype: DType, len: usize) -> Result<CpuStorage> {
    let n = len / dtype.size_in_bytes();
    // `from_f64(0.0)` lets each variant name its own element type.
    Ok(match dtype {
        DType::U8 => CpuStorage::U8(vec![0; n]),
        DType::U32 => CpuStorage::U32(vec![0; n]),
        DType::I16 => CpuStorage::I16(vec![0; n]),
        DType::I32 => CpuStorage::I32(vec![0; n]),
        DType::I64 => CpuStorage::I64(vec![0; n]),
        DType::BF16 => CpuStorage::BF16(vec![WithDType::from_f64(0.0); n]),
        DType::F16 => CpuStorage::F16(vec![WithDType::from_f64(0.0); n]),
        DType::F32 => CpuStorage::F32(vec![0.0; n]),
        DType::F64 => CpuStorage::F64(vec![0.0; n]),
        DType::F8E4M3 => CpuStorage::F8E4M3(vec![WithDType::from_f64(0.0); n]),
        other => {
            return Err(bad(
                path,
                format!("holds dtype {other:?}, which ivme cannot read"),
            ))
        }
    })
}

pub(super) fn bytes_of(s: &mut CpuStorage) -> &mut [u8] {
    match s {
        CpuStorage::U8(v) => v,
        CpuStorage::U32(v) => as_bytes_mut(v),
        CpuStorage::I16(v) => as_bytes_mut(v),
        CpuStorage::I32(v) => as_bytes_mut(v),
        CpuStorage::I64(v) => as_bytes_mut(v),
        CpuStorage::BF16(v) => as_bytes_mut(v),
        CpuStorage::F16(v) => as_bytes_mut(v),
        CpuStorage::F32(v) => as_bytes_mut(v),
        CpuStorage::F64(v) => as_bytes_mut(v),
        CpuStorage::F8E4M3(v) => as_bytes_mut(v),
        // `zeroed` makes no other kind.
        _ => &mut [],
    }
}

/// Turns a filled buffer (little-endian bytes, as stored) into a CPU tensor that owns it.
pub(super) fn into_tensor(mut s: CpuStorage, info: &TensorInfo) -> Result<Tensor> {
    if cfg!(target_endian = "big") {
        let size = info.dtype.size_in_bytes();
        bytes_of(&mut s)
            .chunks_exact_mut(size)
            .for_each(|x| x.reverse());
    }
    let shape = info.shape.clone();
    let cpu = &Device::Cpu;
    Ok(match s {
        CpuStorage::U8(v) => Tensor::from_vec(v, shape, cpu)?,
        CpuStorage::U32(v) => Tensor::from_vec(v, shape, cpu)?,
        CpuStorage::I16(v) => Tensor::from_vec(v, shape, cpu)?,
        CpuStorage::I32(v) => Tensor::from_vec(v, shape, cpu)?,
        CpuStorage::I64(v) => Tensor::from_vec(v, shape, cpu)?,
        CpuStorage::BF16(v) => Tensor::from_vec(v, shape, cpu)?,
        CpuStorage::F16(v) => Tensor::from_vec(v, shape, cpu)?,
        CpuStorage::F32(v) => Tensor::from_vec(v, shape, cpu)?,
        CpuStorage::F64(v) => Tensor::from_vec(v, shape, cpu)?,
        CpuStorage::F8E4M3(v) => Tensor::from_vec(v, shape, cpu)?,
        _ => return Err(Error::Usage("a staging buffer of an unknown dtype".into())),
    })
}

/// Opens `path` (see [`open_regular`]), checks its length against `expect`, and reads and
/// parses its header. Returns the file, the header, where the data starts and the checksum of
/// everything before it.
pub(super) fn open_with_header(
    path: &Path,
    follow_links: bool,
    expect: Option<(u64, u32)>,
) -> Result<(std::fs::File, Header, u64, crc32fast::Hasher)> {
    let io = io_reading(path);
    let mut f = open_regular(path, follow_links)?;
    let file_len = f.metadata().map_err(&io)?.len();
    if let Some((size, _)) = expect {
        if size != file_len {
            return Err(bad(
                path,
                format!(
                    "is {file_len} bytes but the manifest says {size} (truncated or overwritten)"
                ),
            ));
        }
    }
    let mut hasher = crc32fast::Hasher::new();
    let mut prefix = [0u8; 8];
    f.read_exact(&mut prefix)
        .map_err(|_| bad(path, "file too short to be safetensors (truncated?)"))?;
    hasher.update(&prefix);
    let n = header_len(path, &prefix, file_len)?;
    let mut text = vec![0u8; n as usize];
    f.read_exact(&mut text).map_err(&io)?;
    hasher.update(&text);
    // A damaged header can fail to parse; with a checksum to compare, call it what it is.
    let header = match parse_header(path, &text, file_len - 8 - n) {
        Err(e) if expect.is_some_and(|(_, crc)| hasher.clone().finalize() != crc) => {
            return Err(bad(
                path,
                format!("checksum does not match the manifest (corrupt file: {e})"),
            ));
        }
        other => other?,
    };
    Ok((f, header, 8 + n, hasher))
}

fn mismatch(path: &Path) -> Error {
    bad(path, "checksum does not match the manifest (corrupt file)")
}

/// Reads a safetensors file front to back, one tensor at a time, handing each tensor that
/// `want` accepts to `take` (built on `device`).
///
/// Memory stays near the largest tensor. With `expect = Some((size, crc))` the whole file is
/// checksummed on the way and a mismatch is an error after the last tensor, so a caller that
/// collects the tensors returns nothing from a damaged file. Only a regular file is read (a
/// FIFO or device is an error, never a blocking read); `follow_links` says whether a symbolic
/// link to one is accepted.
pub(crate) fn read_tensors(
    path: &Path,
    follow_links: bool,
    expect: Option<(u64, u32)>,
    device: &Device,
    want: impl Fn(&TensorInfo) -> bool,
    mut take: impl FnMut(&TensorInfo, Tensor) -> Result<()>,
) -> Result<Header> {
    let io = io_reading(path);
    let (mut f, header, _, mut hasher) = open_with_header(path, follow_links, expect)?;
    let mut skipped = Vec::new();
    for info in &header.tensors {
        let len = info.end - info.start;
        if want(info) {
            let mut s = zeroed(path, info.dtype, len)?;
            let bytes = bytes_of(&mut s);
            f.read_exact(bytes).map_err(&io)?;
            hasher.update(bytes);
            let t = into_tensor(s, info)?;
            take(
                info,
                if device.is_cpu() {
                    t
                } else {
                    t.to_device(device)?
                },
            )?;
        } else if expect.is_some() {
            // Checked through one small buffer that stays in cache, whatever the tensor's size.
            skipped.resize(PIECE.min(len), 0);
            let mut left = len;
            while left > 0 {
                let piece = &mut skipped[..PIECE.min(left)];
                f.read_exact(piece).map_err(&io)?;
                hasher.update(piece);
                left -= piece.len();
            }
        } else {
            // Nothing to check and nothing to keep: leave those bytes on disk.
            f.seek(SeekFrom::Current(len as i64)).map_err(&io)?;
        }
    }
    if let Some((_, crc)) = expect {
        if hasher.finalize() != crc {
            return Err(mismatch(path));
        }
    }
    Ok(header)
}

/// Reads only the header of a safetensors file (a regular file, or a link to one), leaving its
/// data on disk.
pub(crate) fn read_header(path: &Path) -> Result<Header> {
    open_with_header(path, true, None).map(|(_, h, _, _)| h)
}

/// The header of a safetensors file (a regular file, or a link to one) and where its data
/// starts, for [`read_one`].
pub(crate) fn read_header_at(path: &Path) -> Result<(Header, u64)> {
    open_with_header(path, true, None).map(|(_, h, start, _)| (h, start))
}

/// Reads the one tensor `info` of `file` (whose data starts at `data_start`) with a positioned
/// read into a buffer of its own, on the CPU: no mapping of the file stays resident.
pub(crate) fn read_one(
    file: &std::fs::File,
    path: &Path,
    data_start: u64,
    info: &TensorInfo,
) -> Result<Tensor> {
    let mut s = zeroed(path, info.dtype, info.end - info.start)?;
    file.read_exact_at(bytes_of(&mut s), data_start + info.start as u64)
        .map_err(io_reading(path))?;
    into_tensor(s, info)
}

/// How many threads read `bytes` of tensor data.
pub(super) fn readers(bytes: usize) -> usize {
    if bytes < PARALLEL_MIN {
        return 1;
    }
    std::thread::available_parallelism().map_or(1, |n| n.get().min(4))
}

/// Reads a checkpoint file (a regular file, never through a link) exactly once: its size and
/// checksum must match `expect`, and every tensor comes back on the CPU, in file order, in a
/// buffer the bytes were read straight into. Nothing is returned from a file that does not
/// match, so a caller can check every file before it applies any.
pub(crate) fn read_checked(path: &Path, expect: (u64, u32)) -> Result<(Header, Vec<Tensor>)> {
    read_checked_by(path, expect, None)
}

/// [`read_checked`] with `threads` readers, or as many as suit the file's size.
fn read_checked_by(
    path: &Path,
    expect: (u64, u32),
    threads: Option<usize>,
) -> Result<(Header, Vec<Tensor>)> {
    let (f, header, data_start, mut hasher) = open_with_header(path, false, Some(expect))?;
    let mut staging = header
        .tensors
        .iter()
        .map(|t| zeroed(path, t.dtype, t.end - t.start))
        .collect::<Result<Vec<_>>>()?;
    // The data section as pieces in file order: (offset in the file, where its bytes go).
    let mut pieces: Vec<(u64, &mut [u8])> = Vec::new();
    for (info, s) in header.tensors.iter().zip(staging.iter_mut()) {
        let mut at = data_start + info.start as u64;
        for piece in bytes_of(s).chunks_mut(PIECE) {
            let len = piece.len() as u64;
            pieces.push((at, piece));
            at += len;
        }
    }
    let total: usize = pieces.iter().map(|(_, p)| p.len()).sum();
    let n = threads.unwrap_or_else(|| readers(total)).max(1);
    // Contiguous runs of about equal size, one per thread, so the sums combine in file order.
    let mut runs: Vec<Vec<(u64, &mut [u8])>> = Vec::with_capacity(n);
    let mut run = Vec::new();
    let mut filled = 0usize;
    for (at, piece) in pieces {
        filled += piece.len();
        run.push((at, piece));
        if filled * n >= total * (runs.len() + 1) && runs.len() + 1 < n {
            runs.push(std::mem::take(&mut run));
        }
    }
    runs.push(run);
    let read_run = |run: Vec<(u64, &mut [u8])>| -> Result<crc32fast::Hasher> {
        let mut h = crc32fast::Hasher::new();
        for (at, piece) in run {
            f.read_exact_at(piece, at).map_err(io_reading(path))?;
            h.update(piece);
        }
        Ok(h)
    };
    let sums: Vec<Result<crc32fast::Hasher>> = if runs.len() == 1 {
        runs.into_iter().map(read_run).collect()
    } else {
        std::thread::scope(|scope| {
            let mut runs = runs.into_iter();
            let first = runs.next();
            let others: Vec<_> = runs.map(|r| scope.spawn(|| read_run(r))).collect();
            let mut sums = vec![first.map_or_else(|| Ok(crc32fast::Hasher::new()), read_run)];
            for h in others {
                sums.push(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
            }
            sums
        })
    };
    for sum in sums {
        hasher.combine(&sum?);
    }
    if hasher.finalize() != expect.1 {
        return Err(mismatch(path));
    }
    let tensors = staging
        .into_iter()
        .zip(&header.tensors)
        .map(|(s, info)| into_tensor(s, info))
        .collect::<Result<Vec<_>>>()?;
    Ok((header, tensors))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::format::write_safetensors;

    fn sample() -> Vec<(String, Tensor)> {
        let cpu = &Device::Cpu;
        let f = Tensor::arange(0f32, 600.0, cpu)
            .unwrap()
            .reshape((20, 30))
            .unwrap();
        vec![
            ("a".into(), f.clone()),
            ("b".into(), f.to_dtype(DType::F16).unwrap()),
            (
                "c".into(),
                f.to_dtype(DType::BF16).unwrap().narrow(0, 0, 3).unwrap(),
            ),
            ("d".into(), Tensor::arange(-5i64, 5, cpu).unwrap()),
            ("e".into(), Tensor::new(&[1u8, 2, 250], cpu).unwrap()),
            (
                "empty".into(),
                Tensor::zeros((0, 4), DType::F32, cpu).unwrap(),
            ),
            ("scalar".into(), Tensor::new(7.5f64, cpu).unwrap()),
            ("u".into(), Tensor::new(&[u32::MAX, 3], cpu).unwrap()),
        ]
    }

    fn bytes_of_tensor(t: &Tensor) -> Vec<u8> {
        let mut out = Vec::new();
        write_safetensors(&mut out, &[("x", t)], None).unwrap();
        out
    }

    fn write(path: &Path, tensors: &[(String, Tensor)]) -> (u64, u32) {
        let items: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let mut bytes = Vec::new();
        write_safetensors(&mut bytes, &items, None).unwrap();
        std::fs::write(path, &bytes).unwrap();
        (bytes.len() as u64, crc32fast::hash(&bytes))
    }

    #[test]
    fn every_thread_count_reads_the_same_tensors_and_checksum() {
        let dir = std::env::temp_dir().join(format!("ivme-read-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        let saved = sample();
        let expect = write(&path, &saved);
        for threads in 1..=5 {
            let (header, got) = read_checked_by(&path, expect, Some(threads)).unwrap();
            let names: Vec<&str> = header.tensors.iter().map(|t| t.name.as_str()).collect();
            assert_eq!(names, ["a", "b", "c", "d", "e", "empty", "scalar", "u"]);
            for ((name, want), got) in saved.iter().zip(&got) {
                assert_eq!(
                    (got.dtype(), got.dims()),
                    (want.dtype(), want.dims()),
                    "{name}"
                );
                assert_eq!(
                    bytes_of_tensor(got),
                    bytes_of_tensor(want),
                    "{threads}: {name}"
                );
            }
            // One flipped data byte, in whichever thread's range it falls, is caught.
            let mut bytes = std::fs::read(&path).unwrap();
            let at = bytes.len() - 1 - threads * 97;
            bytes[at] ^= 0x10;
            let flipped = dir.join("flipped.safetensors");
            std::fs::write(&flipped, &bytes).unwrap();
            let err = read_checked_by(&flipped, expect, Some(threads))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("checksum does not match the manifest (corrupt file)"),
                "{threads}: {err}"
            );
        }
        let err = read_checked(&path, (expect.0 + 1, expect.1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("truncated or overwritten"), "{err}");
        // The streaming reader returns the same tensors.
        let mut streamed = Vec::new();
        read_tensors(
            &path,
            false,
            Some(expect),
            &Device::Cpu,
            |_| true,
            |i, t| {
                streamed.push((i.name.clone(), t));
                Ok(())
            },
        )
        .unwrap();
        for ((_, a), (_, b)) in saved.iter().zip(&streamed) {
            assert_eq!(bytes_of_tensor(a), bytes_of_tensor(b));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
