//! Weight gradients written straight into f32 buffers during ivme's own backward.
//!
//! candle's backward gives every input of every node a zero-filled gradient and adds the
//! node's contribution into it: for a weight, a weight-sized allocation, zero fill and
//! addition per use and micro-batch, and under bf16/f16 the product's f32 result is first
//! rounded to 16 bits, added in 16 bits, and widened again where the window sums it. While
//! ivme runs a backward ([`backward`]), [`linear`](super::linear) instead writes the gradient
//! of a weight that is a variable on the CPU into an f32 buffer of that weight's own (the
//! first use's product straight into it, a later use's added by the product itself); the
//! buffers then go into the backward's gradient store as the weights' gradients, in the
//! weights' dtype: a 16-bit weight's is rounded once, as a gradient candle computes for it is
//! (and as PyTorch's autocast rounds a bf16 product's), so every result stays what it was. A
//! backward a user runs with candle's own `backward` gets every gradient as candle gives it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, TensorId};

/// A weight's f32 gradient, row-major in the weight's shape; empty until the weight's first
/// product in this backward writes all of it.
pub(super) type Buffer = Arc<Mutex<Vec<f32>>>;

/// The buffers of one backward, by weight.
type Buffers = HashMap<TensorId, (Tensor, Buffer)>;

thread_local! {
    /// The buffers of the backward ivme runs on this thread, while it runs.
    static OPEN: RefCell<Option<Buffers>> = const { RefCell::new(None) };
}

/// Puts back the buffers of an enclosing backward (none, but for a backward run from inside
/// an op) when this one returns or unwinds.
struct Reopen(Option<Option<Buffers>>);

impl Reopen {
    /// This backward's buffers, the enclosing ones put back.
    fn finish(mut self) -> Buffers {
        let outer = self.0.take().flatten();
        OPEN.with(|o| o.replace(outer)).unwrap_or_default()
    }
}

impl Drop for Reopen {
    fn drop(&mut self) {
        if let Some(outer) = self.0.take() {
            OPEN.with(|o| o.replace(outer));
        }
    }
}

/// candle's backward of `loss`, with the linear layers' weight gradients written into f32
/// buffers of their own and put in the returned store (see the module docs).
pub(crate) fn backward(loss: &Tensor) -> Result<GradStore> {
    let reopen = Reopen(Some(OPEN.with(|o| o.replace(Some(HashMap::new())))));
    let store = loss.backward();
    let buffers = reopen.finish();
    let mut store = store?;
    for (_, (weight, buffer)) in buffers {
        let data = std::mem::take(&mut *buffer.lock().unwrap_or_else(PoisonError::into_inner));
        if data.len() != weight.elem_count() {
            // The product that would have written it failed, and with it the backward.
            continue;
        }
        let grad = match store.remove(&weight) {
            // The weight was also used by other ops, whose gradient candle summed: the sum in
            // f32, rounded once.
            Some(other) => {
                let mine = Tensor::from_vec(data, weight.shape(), weight.device())?;
                (other.to_dtype(DType::F32)? + mine)?.to_dtype(weight.dtype())?
            }
            None => in_dtype(data, &weight)?,
        };
        store.insert(&weight, grad);
    }
    Ok(store)
}

/// f32 values as a tensor of `weight`'s shape and dtype (bf16 and f16 rounded as candle's
/// `to_dtype` rounds, in parallel).
fn in_dtype(data: Vec<f32>, weight: &Tensor) -> Result<Tensor> {
    fn narrow<T: Send>(data: &[f32], of: impl Fn(f32) -> T + Sync + Send) -> Vec<T> {
        use rayon::prelude::*;
        data.par_iter()
            .with_min_len(16_384)
            .map(|&x| of(x))
            .collect()
    }
    let (shape, device) = (weight.shape(), weight.device());
    match weight.dtype() {
        DType::F32 => Tensor::from_vec(data, shape, device),
        DType::BF16 => Tensor::from_vec(narrow(&data, half::bf16::from_f32), shape, device),
        DType::F16 => Tensor::from_vec(narrow(&data, half::f16::from_f32), shape, device),
        other => Tensor::from_vec(data, shape, device)?.to_dtype(other),
    }
}

/// The f32 buffer `weight`'s gradient goes to, when ivme runs the backward on this thread and
/// `weight` is a variable on the CPU; `None` otherwise (candle's store takes it).
pub(super) fn buffer_for(weight: &Tensor) -> Option<Buffer> {
    if !weight.is_variable() || !weight.device().is_cpu() {
        return None;
    }
    OPEN.with(|o| {
        let mut open = o.borrow_mut();
        let (_, buffer) = open
            .as_mut()?
            .entry(weight.id())
            .or_insert_with(|| (weight.clone(), Buffer::default()));
        Some(buffer.clone())
    })
}
