//! Loading a checked model file straight into the variables it restores.
//!
//! The check before a load streams such a file through a small buffer (its size and checksum
//! against the manifest, its names, dtypes and shapes against the model) and keeps nothing.
//! Once every rank's check passed, [`load_into`] reads each tensor's bytes from the file into
//! the variable's own buffer: no staging copy of the weights, no fresh memory to fault in (on
//! a 2-core VM, fresh memory was most of what a load cost). The bytes are checksummed again as
//! they arrive, so a file that changed between the check and the load is reported, not
//! silently half-applied.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::{CpuStorage, InplaceOp1, Layout, Var};

use super::format::{Header, TensorInfo};
use super::read::{bytes_of, into_tensor, open_with_header, readers, zeroed, PIECE};
use crate::error::{CheckpointErrorKind, Error, Result};

/// A model file checked to hold exactly a model's variables, to be read into them.
#[derive(Debug, Clone)]
pub(crate) struct DirectFile {
    pub(crate) path: PathBuf,
    /// Its size and checksum, from the manifest.
    pub(crate) expect: (u64, u32),
    /// The tensor each variable is loaded from, in the model's variable order.
    pub(crate) names: Vec<String>,
}

/// The name, dtype and shape of each tensor of a file.
pub(crate) type Listed = [(String, candle_core::DType, Vec<usize>)];

/// Whether a file listing `listed` holds exactly the variables `vars` named `names` (the same
/// names, dtypes and shapes, nothing else), so it can be read straight into them.
pub(crate) fn fits(listed: &Listed, names: &[String], vars: &[Var]) -> bool {
    listed.len() == names.len()
        && names.iter().zip(vars).all(|(name, v)| {
            listed
                .iter()
                .any(|(n, d, s)| n == name && *d == v.dtype() && s.as_slice() == v.dims())
        })
}

fn changed(path: &Path, why: impl std::fmt::Display) -> Error {
    Error::checkpoint(
        path,
        CheckpointErrorKind::Failed,
        format!(
            "changed between the check and the load ({why}): the model's weights are partly \
             loaded; load the checkpoint again"
        ),
    )
}

/// Reads one tensor's bytes into the buffer of the variable it is applied to, when that buffer
/// is exactly the tensor (contiguous, from its start, same dtype and size).
struct Fill<'a> {
    file: &'a std::fs::File,
    path: &'a Path,
    /// Where the tensor's bytes start in the file.
    at: u64,
    info: &'a TensorInfo,
    hasher: &'a Mutex<crc32fast::Hasher>,
    /// Whether the bytes went in (false: the buffer did not fit; nothing was read).
    filled: Mutex<bool>,
}

impl InplaceOp1 for Fill<'_> {
    fn name(&self) -> &'static str {
        "ivme-load-into-variable"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        // The caller checked the variable's dtype and shape; its buffer may still be a larger
        // one it shares with others.
        let bytes = bytes_of(storage);
        let fits = layout.is_contiguous()
            && layout.start_offset() == 0
            && bytes.len() == self.info.end - self.info.start;
        if !fits {
            return Ok(());
        }
        read_pieces(self.file, self.path, self.at, bytes, self.hasher)
            .map_err(candle_core::Error::wrap)?;
        if cfg!(target_endian = "big") {
            let size = self.info.dtype.size_in_bytes();
            bytes.chunks_exact_mut(size).for_each(|x| x.reverse());
        }
        *self.filled.lock().unwrap_or_else(|p| p.into_inner()) = true;
        Ok(())
    }
}

/// Reads `bytes.len()` bytes at `at` into `bytes`, a piece at a time, feeding each to `hasher`.
fn read_pieces(
    file: &std::fs::File,
    path: &Path,
    mut at: u64,
    bytes: &mut [u8],
    hasher: &Mutex<crc32fast::Hasher>,
) -> Result<()> {
    let mut h = hasher.lock().unwrap_or_else(|p| p.into_inner());
    for piece in bytes.chunks_mut(PIECE) {
        file.read_exact_at(piece, at)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        h.update(piece);
        at += piece.len() as u64;
    }
    Ok(())
}

/// A stretch of the data section: its offset, its length, and the tensor and variable it goes
/// into (none for bytes no tensor claims, which are only checksummed).
type Part<'a> = (usize, usize, Option<(&'a TensorInfo, &'a Var)>);

/// One thread's share of the file: consecutive tensors (and any bytes between them), in file
/// order, with the variable each goes into.
struct Run<'a> {
    parts: Vec<Part<'a>>,
    hasher: Mutex<crc32fast::Hasher>,
}

/// Reads the file `file` describes into `vars` (its variables, in the order of `file.names`),
/// after a check that passed: each tensor straight into its variable's buffer where that is a
/// plain CPU buffer of the same dtype and size, and through a buffer of its own otherwise (on
/// another device, say). The whole file is checksummed again on the way; a mismatch, a changed
/// header or a read error is an error saying the weights are partly loaded.
pub(crate) fn load_into(file: &DirectFile, vars: &[Var]) -> Result<()> {
    let path = file.path.as_path();
    let (f, header, data_start, head_sum) =
        open_with_header(path, false, Some(file.expect)).map_err(|e| changed(path, e))?;
    let data_len = (file.expect.0 - data_start) as usize;
    let order = in_file_order(path, &header, file, vars)?;
    // Parts in file order, gaps included, so the checksum covers every byte.
    let mut parts = Vec::with_capacity(order.len() + 1);
    let mut at = 0usize;
    for (info, var) in order {
        if info.start > at {
            parts.push((at, info.start - at, None));
        }
        parts.push((info.start, info.end - info.start, Some((info, var))));
        at = info.end;
    }
    if data_len > at {
        parts.push((at, data_len - at, None));
    }
    // Contiguous runs of about equal size, one per reader, so the sums combine in file order.
    let n = readers(data_len).max(1);
    let mut runs: Vec<Run> = Vec::with_capacity(n);
    let mut run = Vec::new();
    let mut filled = 0usize;
    for part in parts {
        filled += part.1;
        run.push(part);
        if filled * n >= data_len * (runs.len() + 1) && runs.len() + 1 < n {
            runs.push(Run {
                parts: std::mem::take(&mut run),
                hasher: Mutex::new(crc32fast::Hasher::new()),
            });
        }
    }
    runs.push(Run {
        parts: run,
        hasher: Mutex::new(crc32fast::Hasher::new()),
    });
    let read_run = |run: &Run| -> Result<()> {
        for &(start, len, target) in &run.parts {
            let at = data_start + start as u64;
            match target {
                Some((info, var)) => read_tensor(&f, path, at, info, var, &run.hasher)?,
                None => read_pieces(&f, path, at, &mut vec![0u8; len], &run.hasher)?,
            }
        }
        Ok(())
    };
    let results: Vec<Result<()>> = if runs.len() == 1 {
        runs.iter().map(read_run).collect()
    } else {
        std::thread::scope(|scope| {
            let (first, others) = runs.split_first().expect("at least one run");
            let handles: Vec<_> = others
                .iter()
                .map(|r| scope.spawn(move || read_run(r)))
                .collect();
            let mut results = vec![read_run(first)];
            for h in handles {
                results.push(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
            }
            results
        })
    };
    for r in results {
        r.map_err(|e| changed(path, e))?;
    }
    let mut sum = head_sum;
    for run in runs {
        sum.combine(&run.hasher.into_inner().unwrap_or_else(|p| p.into_inner()));
    }
    if sum.finalize() != file.expect.1 {
        return Err(changed(path, "its checksum no longer matches the manifest"));
    }
    Ok(())
}

/// Each tensor of `header` with the variable it goes into, in file order; the file must still
/// hold exactly the checked names, dtypes and shapes.
fn in_file_order<'a>(
    path: &Path,
    header: &'a Header,
    file: &DirectFile,
    vars: &'a [Var],
) -> Result<Vec<(&'a TensorInfo, &'a Var)>> {
    if header.tensors.len() != file.names.len() || vars.len() != file.names.len() {
        return Err(changed(path, "it holds other tensors"));
    }
    let mut order = Vec::with_capacity(vars.len());
    for info in &header.tensors {
        let Some(j) = file.names.iter().position(|n| *n == info.name) else {
            return Err(changed(path, format!("it holds `{}`", info.name)));
        };
        let v = &vars[j];
        if info.dtype != v.dtype() || info.shape != v.dims() {
            return Err(changed(
                path,
                format!("`{}` has another dtype or shape", info.name),
            ));
        }
        order.push((info, v));
    }
    order.sort_by_key(|(info, _)| info.start);
    Ok(order)
}

/// Reads one tensor into its variable: into the variable's buffer when it fits, else through
/// a buffer of its own and [`Var::set`].
fn read_tensor(
    f: &std::fs::File,
    path: &Path,
    at: u64,
    info: &TensorInfo,
    var: &Var,
    hasher: &Mutex<crc32fast::Hasher>,
) -> Result<()> {
    if var.device().is_cpu() {
        let fill = Fill {
            file: f,
            path,
            at,
            info,
            hasher,
            filled: Mutex::new(false),
        };
        var.as_tensor().inplace_op1(&fill)?;
        if *fill.filled.lock().unwrap_or_else(|p| p.into_inner()) {
            return Ok(());
        }
    }
    // On another device, or a buffer shared with other variables: read, then copy in.
    let mut s = zeroed(path, info.dtype, info.end - info.start)?;
    read_pieces(f, path, at, bytes_of(&mut s), hasher)?;
    let t = into_tensor(s, info)?;
    var.set(&t.to_device(var.device())?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::format::write_safetensors;
    use candle_core::{DType, Device, Tensor};

    fn write(path: &Path, tensors: &[(&str, &Tensor)]) -> (u64, u32) {
        let mut bytes = Vec::new();
        write_safetensors(&mut bytes, tensors, None).unwrap();
        std::fs::write(path, &bytes).unwrap();
        (bytes.len() as u64, crc32fast::hash(&bytes))
    }

    #[test]
    fn a_file_goes_into_its_variables_and_a_change_since_the_check_is_reported() {
        let dir = std::env::temp_dir().join(format!("ivme-direct-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.safetensors");
        let cpu = &Device::Cpu;
        let a = Tensor::arange(0f32, 6.0, cpu)
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        let b = Tensor::new(&[7f32, 8.0], cpu).unwrap();
        let h = Tensor::new(&[1f32, 2.0, 3.0], cpu)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap();
        // The file's order differs from the model's.
        let expect = write(&path, &[("h", &h), ("b", &b), ("a", &a)]);
        let vars = [
            Var::zeros((2, 3), DType::F32, cpu).unwrap(),
            Var::zeros(2, DType::F32, cpu).unwrap(),
            Var::zeros(3, DType::F16, cpu).unwrap(),
        ];
        let names: Vec<String> = ["a", "b", "h"].map(String::from).to_vec();
        let listed = [
            ("h".to_string(), DType::F16, vec![3]),
            ("b".to_string(), DType::F32, vec![2]),
            ("a".to_string(), DType::F32, vec![2, 3]),
        ];
        assert!(fits(&listed, &names, &vars));
        assert!(!fits(&listed[..2], &names, &vars), "a missing tensor");
        let mut wrong = listed.clone();
        wrong[1].2 = vec![1, 2];
        assert!(!fits(&wrong, &names, &vars), "another shape");
        let file = DirectFile {
            path: path.clone(),
            expect,
            names,
        };
        load_into(&file, &vars).unwrap();
        assert_eq!(
            vars[0].as_tensor().to_vec2::<f32>().unwrap(),
            [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        );
        assert_eq!(vars[1].as_tensor().to_vec1::<f32>().unwrap(), [7.0, 8.0]);
        let h_back = vars[2].as_tensor().to_dtype(DType::F32).unwrap();
        assert_eq!(h_back.to_vec1::<f32>().unwrap(), [1.0, 2.0, 3.0]);
        // The same size, one flipped byte: only the checksum can tell.
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let e = load_into(&file, &vars).unwrap_err().to_string();
        assert!(
            e.contains("changed between the check and the load") && e.contains("partly loaded"),
            "{e}"
        );
        // Another tensor in its place: refused before any byte is read.
        write(&path, &[("h", &h), ("b", &b), ("z", &a)]);
        let e = load_into(&file, &vars).unwrap_err().to_string();
        assert!(e.contains("changed between the check and the load"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
