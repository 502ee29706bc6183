//! Memory: what the training state this process holds weighs, and finding a batch size that
//! fits in device memory by halving it after out-of-memory errors.

use crate::{Error, Result};

/// Bytes of training state this process holds, counted from the tensors ivme keeps
/// ([`Accelerator::held_bytes`](crate::Accelerator::held_bytes)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldBytes {
    /// The weights the models compute with (low precision under bf16/fp16).
    pub weights: usize,
    /// f32 master weights kept apart from them: under bf16/fp16 (under sharding, this
    /// process's slice). f32 weights are their own masters (under sharding, with an optimizer
    /// other than ivme's, the parts of variables that a slice boundary cuts are copied).
    pub masters: usize,
    /// Gradients held between backward calls: the window's running sums and the persistent
    /// sync buffers.
    pub gradients: usize,
    /// The prepared optimizers' state (moments, momentum buffers).
    pub optimizer: usize,
}

impl HeldBytes {
    /// The sum of all four.
    pub fn total(&self) -> usize {
        self.weights + self.masters + self.gradients + self.optimizer
    }
}

pub(crate) fn bytes(t: &candle_core::Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// Runs `f(batch_size)` from `start`, halving the batch size after every out-of-memory error
/// until `f` succeeds; returns its result.
///
/// Any other error is returned at once. If even batch size 1 runs out of memory, the error
/// says so and carries the last out-of-memory message. Whatever `f` allocated is freed when
/// its values drop, so build the model, optimizer and loader *inside* `f`.
///
/// Each process searches on its own. With several processes, make `f` free of collectives
/// (e.g. a trial forward and backward on a single rank's data), or ranks that fail at
/// different sizes would wait for each other forever.
///
/// ```
/// use ivme::memory::find_executable_batch_size;
/// // Pretend only batches of up to 24 samples fit.
/// let used = find_executable_batch_size(128, |bs| {
///     if bs > 24 {
///         Err(ivme::Error::Usage("CUDA_ERROR_OUT_OF_MEMORY: out of memory".into()))
///     } else {
///         Ok(bs)
///     }
/// })?;
/// assert_eq!(used, 16);
/// # Ok::<(), ivme::Error>(())
/// ```
pub fn find_executable_batch_size<T>(
    start: usize,
    mut f: impl FnMut(usize) -> Result<T>,
) -> Result<T> {
    if start == 0 {
        return Err(Error::config(
            "batch_size",
            0,
            "start find_executable_batch_size from a batch size of at least 1",
        ));
    }
    let mut batch_size = start;
    loop {
        match f(batch_size) {
            Ok(v) => return Ok(v),
            Err(e) if !is_out_of_memory(&e) => return Err(e),
            Err(e) if batch_size == 1 => {
                return Err(Error::Usage(format!(
                    "even batch size 1 does not fit in memory (started from {start}; last \
                     error: {e}); use a smaller model, lower precision (bf16/fp16), a device \
                     with more memory, or free memory held outside the closure"
                )))
            }
            Err(_) => batch_size /= 2,
        }
    }
}

/// Whether `e` reports that the device ran out of memory: candle's CUDA and Metal allocation
/// failures, and any ivme error whose message says "out of memory".
pub fn is_out_of_memory(e: &Error) -> bool {
    let msg = match e {
        // Walk candle's wrappers (context, backtraces), whose Display may hide the cause.
        Error::Candle(inner) => format!("{inner} {inner:?}"),
        other => other.to_string(),
    };
    let msg = msg.to_ascii_lowercase();
    ["out of memory", "out_of_memory", "outofmemory"]
        .iter()
        .any(|needle| msg.contains(needle))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oom() -> Error {
        Error::Candle(candle_core::Error::Msg(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
        ))
    }

    #[test]
    fn halves_until_the_closure_fits() {
        for (start, limit, expected) in [(64, 10, 8), (100, 30, 25), (7, 7, 7), (9, 1, 1)] {
            let mut tried = Vec::new();
            let got = find_executable_batch_size(start, |bs| {
                tried.push(bs);
                if bs > limit {
                    Err(oom())
                } else {
                    Ok(bs)
                }
            })
            .unwrap();
            assert_eq!(got, expected, "start {start} limit {limit}");
            // Every try before the last halves the one before it.
            assert!(tried.windows(2).all(|w| w[1] == w[0] / 2), "{tried:?}");
        }
    }

    #[test]
    fn other_errors_propagate_at_once() {
        let mut calls = 0;
        let e = find_executable_batch_size(64, |_| -> Result<()> {
            calls += 1;
            Err(Error::Usage("shape mismatch".into()))
        })
        .unwrap_err();
        assert_eq!(calls, 1);
        assert_eq!(e.to_string(), "shape mismatch");
    }

    #[test]
    fn batch_size_one_failing_is_a_clear_error() {
        let mut tried = Vec::new();
        let e = find_executable_batch_size(5, |bs| -> Result<()> {
            tried.push(bs);
            Err(Error::Usage("allocation: out of memory".into()))
        })
        .unwrap_err();
        assert_eq!(tried, [5, 2, 1]);
        let msg = e.to_string();
        assert!(msg.contains("even batch size 1 does not fit"), "{msg}");
        assert!(msg.contains("out of memory"), "{msg}");
    }

    #[test]
    fn a_zero_start_is_refused() {
        let e = find_executable_batch_size(0, |_| Ok(())).unwrap_err();
        assert!(e.to_string().contains("batch_size"), "{e}");
    }

    #[test]
    fn recognises_out_of_memory_messages() {
        assert!(is_out_of_memory(&oom()));
        let wrapped = Error::Candle(
            candle_core::Error::Msg("CUDA_ERROR_OUT_OF_MEMORY".into()).context("matmul"),
        );
        assert!(is_out_of_memory(&wrapped));
        assert!(!is_out_of_memory(&Error::Usage("bad shape".into())));
    }
}
