//! Gathering and reducing metrics across processes from the Accelerator.

use crate::accelerator::Accelerator;
use crate::comm::ReduceOp;
use crate::error::{Error, Result};
use crate::observe::metrics::at_least_1d;
use crate::observe::metrics::decode_object;
use crate::observe::metrics::encode_object;
use crate::observe::metrics::filled;
use crate::observe::metrics::split_padded;
use crate::observe::metrics::split_range;
use crate::observe::metrics::Header;
use candle_core::DType;
use candle_core::Tensor;
use serde::de::DeserializeOwned;
use serde::Serialize;

impl Accelerator {
    /// Every rank's header, in rank order.
    fn exchange_headers(&self, t: &Tensor, drop: usize) -> Result<Vec<Header>> {
        let mine = serde_json::to_vec(&Header::of(t, drop))?;
        self.comm()
            .all_gather_bytes(&mine)?
            .iter()
            .map(|b| Ok(serde_json::from_slice::<Header>(b)?))
            .collect()
    }

    /// Fails on every rank when any two ranks' tensors differ in shape or dtype.
    fn check_same_shape(&self, what: &str, t: &Tensor) -> Result<()> {
        let headers = self.exchange_headers(t, 0)?;
        if let Some((r, h)) = headers.iter().enumerate().find(|(_, h)| **h != headers[0]) {
            return Err(Error::Comm(format!(
                "{what}: rank 0 has shape {} but rank {r} has shape {}; every rank must pass a \
                 tensor of the same shape and dtype",
                headers[0].describe(),
                h.describe()
            )));
        }
        Ok(())
    }

    /// Concatenates every rank's tensor along the first dimension, in rank order; the first
    /// dimension may differ between ranks, the others and the dtype must agree.
    ///
    /// A scalar counts as one row. Every rank gets the whole result.
    pub fn gather(&self, t: &Tensor) -> Result<Tensor> {
        self.gather_dropping("gather", t, 0)
    }

    /// Gathers like [`gather`](Self::gather), then drops the rows that padded each rank's last
    /// batch, so every sample of the epoch counts exactly once.
    ///
    /// Call it on the outputs of the batch a prepared loader (or the macro's sharded batch
    /// loop) handed out last: the Accelerator knows how many of this rank's trailing rows
    /// were padding. For an unshuffled loader the result is in dataset order.
    ///
    /// ```no_run
    /// # fn demo(accelerator: &ivme::Accelerator,
    /// #         loader: &mut ivme::data::DataLoader<ivme::data::TensorDataset<candle_core::Tensor>>)
    /// #         -> ivme::Result<()> {
    /// let mut all = Vec::new();
    /// for batch in loader.iter() {
    ///     let predictions = batch?; // a model's outputs, one row per sample
    ///     all.push(accelerator.gather_for_metrics(&predictions)?);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn gather_for_metrics(&self, t: &Tensor) -> Result<Tensor> {
        self.gather_dropping(
            "gather_for_metrics",
            t,
            self.training.window().last_padding(),
        )
    }

    fn gather_dropping(&self, what: &str, t: &Tensor, drop: usize) -> Result<Tensor> {
        let t = at_least_1d(t)?;
        let headers = self.exchange_headers(&t, drop)?;
        check_headers(what, &headers)?;
        let max_rows = headers.iter().map(|h| h.dims[0]).max().unwrap_or(0);
        let rows = t.dims()[0];
        let mut tail = t.dims().to_vec();
        if max_rows == 0 {
            return Ok(t);
        }
        let padded = if rows < max_rows {
            tail[0] = max_rows - rows;
            let pad = Tensor::zeros(tail.as_slice(), t.dtype(), t.device())?;
            Tensor::cat(&[&t, &pad], 0)?
        } else {
            t
        };
        let all = self.comm().all_gather(&padded)?;
        let mut parts = Vec::with_capacity(headers.len());
        for (r, h) in headers.iter().enumerate() {
            let keep = h.dims[0] - h.drop;
            if keep > 0 {
                parts.push(all.narrow(0, r * max_rows, keep)?);
            }
        }
        if parts.is_empty() {
            return Ok(all.narrow(0, 0, 0)?);
        }
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// Combines `t` from every rank element-wise with `op`; every rank gets the result.
    pub fn reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.check_same_shape("reduce", t)?;
        self.comm().all_reduce(t, op)
    }

    /// Returns rank `from`'s tensor on every rank.
    ///
    /// Only rank `from`'s `t` is read; on the other ranks `t` just names the device the result
    /// goes to, so its shape and dtype do not matter.
    pub fn broadcast(&self, t: &Tensor, from: usize) -> Result<Tensor> {
        self.check_root("broadcast", from)?;
        let header = serde_json::to_vec(&Header::of(t, 0))?;
        let header = self.comm().broadcast_bytes(header, from)?;
        let header: Header = serde_json::from_slice(&header)?;
        let dtype: DType = header.dtype.parse().map_err(|e| {
            Error::Comm(format!(
                "broadcast: rank {from} sent an unknown dtype ({e})"
            ))
        })?;
        let local = if self.process_index() == from {
            t.clone()
        } else {
            Tensor::zeros(header.dims.as_slice(), dtype, t.device())?
        };
        self.comm().broadcast(&local, from)
    }

    /// Pads `t` along `dim` with `pad_value` to the largest size any rank has there, at the
    /// end (or at the start with `pad_first`), so the ranks' tensors can be gathered.
    pub fn pad_across_processes(
        &self,
        t: &Tensor,
        dim: usize,
        pad_value: f64,
        pad_first: bool,
    ) -> Result<Tensor> {
        let headers = self.exchange_headers(t, 0)?;
        let rank0 = &headers[0];
        if let Some((r, h)) = headers
            .iter()
            .enumerate()
            .find(|(_, h)| h.dims.len() != rank0.dims.len())
        {
            return Err(Error::Comm(format!(
                "pad_across_processes: rank 0 has shape {} but rank {r} has shape {}; every \
                 rank needs a tensor with the same number of dimensions",
                rank0.describe(),
                h.describe()
            )));
        }
        if dim >= rank0.dims.len() {
            return Err(Error::Usage(format!(
                "pad_across_processes: dimension {dim} does not exist in a tensor of shape {:?}; \
                 pass a dimension below {}",
                t.dims(),
                t.rank()
            )));
        }
        let max = headers.iter().map(|h| h.dims[dim]).max().unwrap_or(0);
        let size = t.dims()[dim];
        if size == max {
            return Ok(t.clone());
        }
        let mut pad_dims = t.dims().to_vec();
        pad_dims[dim] = max - size;
        let pad = filled(&pad_dims, pad_value, t.dtype(), t.device())?;
        let pieces = if pad_first { [&pad, t] } else { [t, &pad] };
        Ok(Tensor::cat(&pieces, dim)?)
    }

    /// Returns this rank's contiguous share of `items`; with an uneven split the first ranks
    /// get one item more (see [`split_range`]).
    pub fn split_between_processes<T: Clone>(&self, items: &[T]) -> Vec<T> {
        items[split_range(items.len(), self.process_index(), self.num_processes())].to_vec()
    }

    /// Like [`split_between_processes`](Self::split_between_processes), but every rank gets
    /// the same number of items: shorter shares repeat their last item (see [`split_padded`]).
    pub fn split_between_processes_padded<T: Clone>(&self, items: &[T]) -> Vec<T> {
        split_padded(items, self.process_index(), self.num_processes())
    }

    /// Returns every rank's `value`, in rank order, sent as JSON.
    pub fn gather_object<T: Serialize + DeserializeOwned>(&self, value: &T) -> Result<Vec<T>> {
        let payload = encode_object(Some(value));
        let all = self.comm().all_gather_bytes(&payload)?;
        all.iter()
            .enumerate()
            .map(|(r, bytes)| decode_object("gather_object", r, bytes))
            .collect()
    }

    /// Returns rank `from`'s value on every rank, sent as JSON.
    ///
    /// Rank `from` must pass `Some`; the other ranks' values are ignored, so they may pass
    /// `None` (`accelerator.is_main_process().then_some(&value)` reads well for `from = 0`).
    pub fn broadcast_object<T: Serialize + DeserializeOwned>(
        &self,
        value: Option<&T>,
        from: usize,
    ) -> Result<T> {
        self.check_root("broadcast_object", from)?;
        let payload = if self.process_index() == from {
            encode_object(value)
        } else {
            Vec::new()
        };
        let bytes = self.comm().broadcast_bytes(payload, from)?;
        decode_object("broadcast_object", from, &bytes)
    }

    fn check_root(&self, what: &str, from: usize) -> Result<()> {
        if from >= self.num_processes() {
            return Err(Error::Usage(format!(
                "{what}: rank {from} does not exist in a run of {} processes; pass a rank below \
                 {}",
                self.num_processes(),
                self.num_processes()
            )));
        }
        Ok(())
    }
}

/// Refuses a gather whose ranks' tensors differ in more than the first dimension, or whose
/// padded rows to drop exceed a rank's rows; `what` names the call.
fn check_headers(what: &str, headers: &[Header]) -> Result<()> {
    let first = &headers[0];
    for (r, h) in headers.iter().enumerate() {
        if h.dims.len() != first.dims.len()
            || h.dims[1..] != first.dims[1..]
            || h.dtype != first.dtype
        {
            return Err(Error::Comm(format!(
                "{what}: rank 0 has shape {} but rank {r} has shape {}; the ranks may differ \
                 only in the first dimension: give every rank the same trailing dimensions \
                 and dtype",
                first.describe(),
                h.describe()
            )));
        }
        if h.drop > h.dims[0] {
            return Err(Error::Usage(format!(
                "{what}: rank {r}'s loader padded its last batch with {} samples but the \
                 tensor has only {} rows; pass the outputs of the batch the loader yielded \
                 last, one row per sample",
                h.drop, h.dims[0]
            )));
        }
    }
    Ok(())
}
