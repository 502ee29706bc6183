//! A dataset for the step-time and profile tests: batches of ones, each taking a set time to
//! build, so the time waiting for data is known.

use crate::data::Dataset;
use candle_core::{DType, Device, Tensor};
use std::time::Duration;

/// `len` samples of 3 ones; collating a batch sleeps `ms` milliseconds.
pub(crate) struct Slow {
    pub(crate) len: usize,
    pub(crate) ms: u64,
}

impl Dataset for Slow {
    type Item = ();
    type Batch = Tensor;
    fn len(&self) -> usize {
        self.len
    }
    fn get(&self, _: usize) -> crate::Result<()> {
        Ok(())
    }
    fn collate(&self, items: Vec<()>, device: &Device) -> crate::Result<Tensor> {
        std::thread::sleep(Duration::from_millis(self.ms));
        Ok(Tensor::ones((items.len(), 3), DType::F32, device)?)
    }
}
