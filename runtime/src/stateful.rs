//! [`Stateful`]: anything whose state is saved and restored with the training state, and
//! [`Shared`], the handle through which the Accelerator and the user's loop both reach it.

use crate::error::{Error, Result};
use candle_core::Tensor;
use std::sync::{Arc, Mutex, MutexGuard};

/// A state as tensors (saved as safetensors) plus everything else as JSON.
#[derive(Debug, Clone, Default)]
pub struct StateDict {
    /// Named tensors.
    pub tensors: Vec<(String, Tensor)>,
    /// Everything that is not a tensor.
    pub json: serde_json::Value,
}

impl StateDict {
    /// A state holding only JSON.
    pub fn json(json: serde_json::Value) -> Self {
        StateDict {
            tensors: Vec::new(),
            json,
        }
    }

    /// The tensor called `name`, or an error naming it.
    pub fn tensor(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
            .ok_or_else(|| {
                Error::Usage(format!(
                    "the saved state has no tensor `{name}`; was it saved by this program?"
                ))
            })
    }
}

/// An object whose state [`Accelerator::save_state`](crate::Accelerator::save_state) saves
/// and [`Accelerator::load_state`](crate::Accelerator::load_state) restores.
///
/// ```
/// use ivme::stateful::{StateDict, Stateful};
/// struct Counter(u64);
/// impl Stateful for Counter {
///     fn state_dict(&self) -> ivme::Result<StateDict> {
///         Ok(StateDict::json(serde_json::json!({ "n": self.0 })))
///     }
///     fn load_state_dict(&mut self, state: &StateDict) -> ivme::Result<()> {
///         self.0 = state.json["n"].as_u64().unwrap_or(0);
///         Ok(())
///     }
/// }
/// ```
pub trait Stateful: Send {
    /// The current state.
    fn state_dict(&self) -> Result<StateDict>;
    /// Restores a state produced by [`state_dict`](Self::state_dict).
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()>;
}

/// A value shared between the user's code and the Accelerator (for checkpointing).
#[derive(Debug, Default)]
pub struct Shared<T: ?Sized>(Arc<Mutex<T>>);

impl<T: ?Sized> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Shared(self.0.clone())
    }
}

impl<T> Shared<T> {
    /// Wraps `value`.
    pub fn new(value: T) -> Self {
        Shared(Arc::new(Mutex::new(value)))
    }
}

impl<T: ?Sized> Shared<T> {
    /// Locks the value for use. A panic elsewhere while it was locked does not make it
    /// unusable: the value is whatever that code left.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<T: Stateful> Stateful for Shared<T> {
    fn state_dict(&self) -> Result<StateDict> {
        self.lock().state_dict()
    }
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.lock().load_state_dict(state)
    }
}
