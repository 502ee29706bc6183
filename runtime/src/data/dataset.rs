//! What a data loader reads from: the `Dataset` trait and a ready-made dataset over tensors.

use candle_core::{Device, Tensor};

use super::DataFile;
use crate::{Error, Result};

/// A finite, indexable collection of samples that knows how to turn some of them into a batch.
///
/// Implement [`get`](Dataset::get) and [`collate`](Dataset::collate); override
/// [`get_batch`](Dataset::get_batch) when the whole batch can be built at once more cheaply
/// than sample by sample (as [`TensorDataset`] does).
pub trait Dataset {
    /// One sample, as `get` returns it.
    type Item;
    /// A batch of samples on a device, as the loader yields it.
    type Batch;

    /// Returns the number of samples.
    fn len(&self) -> usize;

    /// Returns true when there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Returns sample `index` (`index < len()`).
    fn get(&self, index: usize) -> Result<Self::Item>;

    /// Fingerprints the files the samples are read from, in order (none for data in memory,
    /// the default). A prepared loader's position is saved with them, and a resume refuses a
    /// checkpoint whose files differ from these, naming the file: the saved position would
    /// read other samples.
    fn files(&self) -> Result<Vec<DataFile>> {
        Ok(Vec::new())
    }

    /// Combines samples, in the given order, into one batch placed on `device`.
    fn collate(&self, items: Vec<Self::Item>, device: &Device) -> Result<Self::Batch>;

    /// Returns the batch of the samples at `indices`, in that order, placed on `device`.
    ///
    /// The default fetches each sample with `get` and hands them to `collate`.
    fn get_batch(&self, indices: &[usize], device: &Device) -> Result<Self::Batch> {
        let items = indices
            .iter()
            .map(|&i| self.get(i))
            .collect::<Result<Vec<_>>>()?;
        self.collate(items, device)
    }
}

/// The shapes a [`TensorDataset`] can hold: one tensor, a pair, a triple or a `Vec` of tensors,
/// all indexed along their first dimension. Samples and batches have the same shape as the
/// value itself, so `TensorDataset<(Tensor, Tensor)>` yields `(Tensor, Tensor)` batches.
pub trait TensorColumns: Sized {
    /// Returns the tensors, in order.
    fn columns(&self) -> Vec<&Tensor>;

    /// Rebuilds the value from tensors produced column by column, in the same order.
    fn from_columns(columns: Vec<Tensor>) -> Result<Self>;
}

impl TensorColumns for Tensor {
    fn columns(&self) -> Vec<&Tensor> {
        vec![self]
    }

    fn from_columns(columns: Vec<Tensor>) -> Result<Self> {
        let [a] = exact::<1>(columns)?;
        Ok(a)
    }
}

impl TensorColumns for (Tensor, Tensor) {
    fn columns(&self) -> Vec<&Tensor> {
        vec![&self.0, &self.1]
    }

    fn from_columns(columns: Vec<Tensor>) -> Result<Self> {
        let [a, b] = exact::<2>(columns)?;
        Ok((a, b))
    }
}

impl TensorColumns for (Tensor, Tensor, Tensor) {
    fn columns(&self) -> Vec<&Tensor> {
        vec![&self.0, &self.1, &self.2]
    }

    fn from_columns(columns: Vec<Tensor>) -> Result<Self> {
        let [a, b, c] = exact::<3>(columns)?;
        Ok((a, b, c))
    }
}

impl TensorColumns for Vec<Tensor> {
    fn columns(&self) -> Vec<&Tensor> {
        self.iter().collect()
    }

    fn from_columns(columns: Vec<Tensor>) -> Result<Self> {
        Ok(columns)
    }
}

/// Turns a column list back into a fixed-size group; a mismatch is an ivme bug, not the user's.
fn exact<const N: usize>(columns: Vec<Tensor>) -> Result<[Tensor; N]> {
    let got = columns.len();
    columns.try_into().map_err(|_| {
        Error::Usage(format!(
            "internal: expected {N} tensor columns, got {got}; please report this ivme bug"
        ))
    })
}

/// A dataset of tensors sharing their first dimension: sample `i` is row `i` of each tensor.
///
/// Batches are gathered with one copy per tensor, then moved to the loader's device. When the
/// indices are one contiguous ascending run (an unshuffled loader) and the tensors already live
/// on the loader's device, the batch is a view of the dataset's storage and nothing is copied.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use ivme::data::{Dataset, TensorDataset};
///
/// let x = Tensor::arange(0f32, 12., &Device::Cpu)?.reshape((6, 2))?;
/// let y = Tensor::arange(0u32, 6, &Device::Cpu)?;
/// let data = TensorDataset::new((x, y))?;
/// let (xb, yb) = data.get_batch(&[4, 1], &Device::Cpu)?;
/// assert_eq!(xb.to_vec2::<f32>()?, [[8., 9.], [2., 3.]]);
/// assert_eq!(yb.to_vec1::<u32>()?, [4, 1]);
/// # Ok::<(), ivme::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct TensorDataset<T> {
    tensors: T,
    len: usize,
}

impl<T: TensorColumns> TensorDataset<T> {
    /// Wraps `tensors`, checking that they all have the same first dimension.
    pub fn new(tensors: T) -> Result<Self> {
        let columns = tensors.columns();
        let Some(first) = columns.first() else {
            return Err(Error::Usage(
                "TensorDataset needs at least one tensor; pass the inputs (and targets)".into(),
            ));
        };
        let len = first_dim(first, 0)?;
        for (i, t) in columns.iter().enumerate().skip(1) {
            if first_dim(t, i)? != len {
                return Err(Error::Usage(format!(
                    "TensorDataset: tensor 0 has shape {:?} but tensor {i} has shape {:?}; \
                     every tensor needs the same first dimension (one row per sample)",
                    first.dims(),
                    t.dims()
                )));
            }
        }
        Ok(TensorDataset { tensors, len })
    }

    /// Returns the wrapped tensors.
    pub fn tensors(&self) -> &T {
        &self.tensors
    }

    /// Returns the wrapped tensors, consuming the dataset.
    pub fn into_tensors(self) -> T {
        self.tensors
    }

    /// Rejects an index past the end with a message naming both numbers.
    fn check_index(&self, index: usize) -> Result<()> {
        if index < self.len {
            return Ok(());
        }
        Err(Error::Usage(format!(
            "TensorDataset: sample index {index} is out of range for {} samples",
            self.len
        )))
    }
}

/// Returns the number of rows of tensor `i`, or an error for a scalar.
fn first_dim(t: &Tensor, i: usize) -> Result<usize> {
    match t.dims().first() {
        Some(&rows) => Ok(rows),
        None => Err(Error::Usage(format!(
            "TensorDataset: tensor {i} is a scalar; give every tensor a first dimension with one \
             row per sample (e.g. `t.reshape((n, 1))`)"
        ))),
    }
}

impl<T: TensorColumns> Dataset for TensorDataset<T> {
    type Item = T;
    type Batch = T;

    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, index: usize) -> Result<T> {
        self.check_index(index)?;
        let rows = self
            .tensors
            .columns()
            .into_iter()
            .map(|t| t.get(index))
            .collect::<candle_core::Result<Vec<_>>>()?;
        T::from_columns(rows)
    }

    fn collate(&self, items: Vec<T>, device: &Device) -> Result<T> {
        if items.is_empty() {
            return self.get_batch(&[], device);
        }
        let width = self.tensors.columns().len();
        let mut stacked = Vec::with_capacity(width);
        for c in 0..width {
            let rows: Vec<&Tensor> = items
                .iter()
                .filter_map(|item| item.columns().get(c).copied())
                .collect();
            if rows.len() != items.len() {
                return Err(Error::Usage(format!(
                    "TensorDataset::collate: every item needs {width} tensors, like the dataset"
                )));
            }
            stacked.push(Tensor::stack(&rows, 0)?.to_device(device)?);
        }
        T::from_columns(stacked)
    }

    fn get_batch(&self, indices: &[usize], device: &Device) -> Result<T> {
        let mut max = 0;
        for &i in indices {
            self.check_index(i)?;
            max = max.max(i);
        }
        let run_start = if indices.is_empty() {
            Some(0)
        } else {
            contiguous_run(indices)
        };
        // The index tensor is built once per device, not once per column.
        let mut index_cache: Option<(Device, Tensor)> = None;
        let mut out = Vec::new();
        for t in self.tensors.columns() {
            let gathered = match run_start {
                // Same device: the slice is a view, no copy at all. Elsewhere: `to_device`
                // copies a tensor's whole storage, so compact the slice first or the whole
                // dataset would cross the bus with every batch.
                Some(start) if t.device().same_device(device) => {
                    t.narrow(0, start, indices.len())?
                }
                Some(start) => t.narrow(0, start, indices.len())?.force_contiguous()?,
                None => {
                    let ix = match &index_cache {
                        Some((dev, ix)) if dev.same_device(t.device()) => ix.clone(),
                        _ => {
                            let ix = index_tensor(indices, max, t.device())?;
                            index_cache = Some((t.device().clone(), ix.clone()));
                            ix
                        }
                    };
                    t.index_select(&ix, 0)?
                }
            };
            out.push(gathered.to_device(device)?);
        }
        T::from_columns(out)
    }
}

/// Returns the first index when `indices` is `s, s+1, s+2, ...` (a slice needs no copy).
fn contiguous_run(indices: &[usize]) -> Option<usize> {
    let start = *indices.first()?;
    let ascending = indices
        .iter()
        .enumerate()
        .all(|(k, &i)| start.checked_add(k) == Some(i));
    ascending.then_some(start)
}

/// Builds the gather index on `device`, in u32 when the largest index fits.
fn index_tensor(indices: &[usize], max: usize, device: &Device) -> Result<Tensor> {
    let n = indices.len();
    let ix = if u32::try_from(max).is_ok() {
        let v: Vec<u32> = indices.iter().map(|&i| i as u32).collect();
        Tensor::from_vec(v, n, device)?
    } else {
        let v: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
        Tensor::from_vec(v, n, device)?
    };
    Ok(ix)
}
