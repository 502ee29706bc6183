//! [`Prepare`]: what [`Accelerator::prepare`](crate::Accelerator::prepare) does to each
//! kind of object. Tuples are prepared left to right and come back in the same order.
//!
//! | given | comes back | what happens |
//! |---|---|---|
//! | `VarMap` (the model's variables) | the same `VarMap` | rank 0's values broadcast to every rank; f32 masters made under mixed precision |
//! | [`AdamW`], [`Sgd`] | [`AcceleratedOptimizer`] | pointed at the masters; steps gated by accumulation and overflow |
//! | [`DataLoader`] | the same loader | sharded across processes, batches placed on the device, windows reported |
//! | [`LrScheduler`] | unchanged | already follows its optimizer's real steps |
//! | `&T` (anything by reference) | unchanged | nothing to prepare |
//!
//! Preparing an object twice is an error: a `VarMap` or loader at run time; an optimizer or
//! a loader can't be, since the prepared type is no longer [`Prepare`].

use crate::accelerator::Accelerator;
use crate::data::{DataLoader, Dataset, StepObserver};
use crate::error::Result;
use crate::optim::{AcceleratedOptimizer, AdamW, LrScheduler, Sgd};
use candle_nn::VarMap;
use std::sync::Arc;

/// An object [`Accelerator::prepare`](crate::Accelerator::prepare) knows how to get ready
/// for distributed training.
pub trait Prepare {
    /// What comes back.
    type Output;
    /// Prepares `self` against `accelerator`.
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Output>;
}

impl Prepare for VarMap {
    type Output = VarMap;
    fn prepare_with(self, accelerator: &mut Accelerator) -> Result<VarMap> {
        accelerator.register_model(&self)?;
        Ok(self)
    }
}

macro_rules! prepare_optimizer {
    ($($t:ty),+) => {$(
        impl Prepare for $t {
            type Output = AcceleratedOptimizer<$t>;
            fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Output> {
                accelerator.wrap_optimizer(self)
            }
        }
    )+};
}
prepare_optimizer!(AdamW, Sgd);

impl<D: Dataset> Prepare for DataLoader<D> {
    type Output = DataLoader<D>;
    fn prepare_with(mut self, accelerator: &mut Accelerator) -> Result<Self::Output> {
        let observer: Arc<dyn StepObserver> = accelerator.gradient_state();
        let files = self.dataset().files()?;
        let position = self.attach(
            accelerator.process_index(),
            accelerator.num_processes(),
            accelerator.device().clone(),
            Some(observer),
        )?;
        accelerator.data.add_loader(position, files);
        Ok(self)
    }
}

impl Prepare for LrScheduler {
    type Output = LrScheduler;
    fn prepare_with(self, _: &mut Accelerator) -> Result<Self::Output> {
        Ok(self)
    }
}

impl<T: ?Sized> Prepare for &T {
    type Output = Self;
    fn prepare_with(self, _: &mut Accelerator) -> Result<Self::Output> {
        Ok(self)
    }
}

macro_rules! prepare_tuple {
    ($($name:ident),+) => {
        impl<$($name: Prepare),+> Prepare for ($($name,)+) {
            type Output = ($($name::Output,)+);
            #[allow(non_snake_case)]
            fn prepare_with(self, accelerator: &mut Accelerator) -> Result<Self::Output> {
                let ($($name,)+) = self;
                Ok(($($name.prepare_with(accelerator)?,)+))
            }
        }
    };
}
prepare_tuple!(A);
prepare_tuple!(A, B);
prepare_tuple!(A, B, C);
prepare_tuple!(A, B, C, D);
prepare_tuple!(A, B, C, D, E);
prepare_tuple!(A, B, C, D, E, F);
prepare_tuple!(A, B, C, D, E, F, G);
prepare_tuple!(A, B, C, D, E, F, G, H);
