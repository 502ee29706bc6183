//! Autocast scopes: a region of code that computes in the configured low precision.
//!
//! candle has no global dispatch to hook, so a scope is explicit about its edges: the inputs
//! it is handed are cast to the compute dtype by [`Autocast::input`], and whatever the scope
//! returns comes back in f32 ([`AutocastOutput`]). The model's own weights are already in the
//! compute dtype (see [`Accelerator::param_dtype`](crate::Accelerator::param_dtype)), so every
//! matmul inside runs in the low precision while the loss outside stays in f32.

use candle_core::{DType, Result, Tensor};

/// The handle a scope's closure receives: casts inputs to the scope's dtype.
#[derive(Debug, Clone, Copy)]
pub struct Autocast {
    dtype: Option<DType>,
}

impl Autocast {
    /// A scope that casts floating-point inputs to `dtype`; `None` casts nothing.
    pub fn new(dtype: Option<DType>) -> Self {
        Autocast { dtype }
    }

    /// The dtype this scope computes in, or `None` when it leaves tensors as they are.
    pub fn dtype(&self) -> Option<DType> {
        self.dtype
    }

    /// Returns `t` in the scope's compute dtype when it is a float tensor; other tensors
    /// (indices, masks) pass through untouched.
    pub fn input(&self, t: &Tensor) -> Result<Tensor> {
        match self.dtype {
            Some(d) if t.dtype().is_float() && t.dtype() != d => t.to_dtype(d),
            _ => Ok(t.clone()),
        }
    }

    /// Runs `f` inside this scope and returns its result in full precision.
    pub fn run<T: AutocastOutput>(&self, f: impl FnOnce(&Autocast) -> Result<T>) -> Result<T> {
        f(self)?.into_full_precision()
    }
}

/// A value an autocast scope can return: its float tensors are cast back to f32.
pub trait AutocastOutput: Sized {
    /// Casts every low-precision float tensor in `self` to f32.
    fn into_full_precision(self) -> Result<Self>;
}

impl AutocastOutput for Tensor {
    fn into_full_precision(self) -> Result<Self> {
        match self.dtype() {
            DType::F16 | DType::BF16 => self.to_dtype(DType::F32),
            _ => Ok(self),
        }
    }
}

impl AutocastOutput for () {
    fn into_full_precision(self) -> Result<Self> {
        Ok(())
    }
}

impl<T: AutocastOutput> AutocastOutput for Vec<T> {
    fn into_full_precision(self) -> Result<Self> {
        self.into_iter().map(T::into_full_precision).collect()
    }
}

impl<T: AutocastOutput> AutocastOutput for Option<T> {
    fn into_full_precision(self) -> Result<Self> {
        self.map(T::into_full_precision).transpose()
    }
}

macro_rules! tuple_output {
    ($($name:ident),+) => {
        impl<$($name: AutocastOutput),+> AutocastOutput for ($($name,)+) {
            #[allow(non_snake_case)]
            fn into_full_precision(self) -> Result<Self> {
                let ($($name,)+) = self;
                Ok(($($name.into_full_precision()?,)+))
            }
        }
    };
}
tuple_output!(A);
tuple_output!(A, B);
tuple_output!(A, B, C);
tuple_output!(A, B, C, D);

macro_rules! scalar_output {
    ($($t:ty),+) => {$(
        impl AutocastOutput for $t {
            fn into_full_precision(self) -> Result<Self> { Ok(self) }
        }
    )+};
}
scalar_output!(f32, f64, usize, u32, i64, bool);

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn inputs_are_cast_and_outputs_come_back_in_f32() -> Result<()> {
        let x = Tensor::new(&[1.5f32, -2.0], &Device::Cpu)?;
        let idx = Tensor::new(&[1u32, 0], &Device::Cpu)?;
        let ac = Autocast::new(Some(DType::F16));
        let (y, i) = ac.run(|ac| {
            let x = ac.input(&x)?;
            assert_eq!(x.dtype(), DType::F16);
            let i = ac.input(&idx)?;
            assert_eq!(i.dtype(), DType::U32);
            Ok(((x * 2.0)?, i))
        })?;
        assert_eq!(y.dtype(), DType::F32);
        assert_eq!(y.to_vec1::<f32>()?, vec![3.0, -4.0]);
        assert_eq!(i.dtype(), DType::U32);
        Ok(())
    }

    #[test]
    fn a_scope_without_dtype_changes_nothing() -> Result<()> {
        let x = Tensor::new(&[1.0f32], &Device::Cpu)?;
        let ac = Autocast::new(None);
        let y = ac.input(&x)?;
        assert_eq!(y.id(), x.id(), "an uncast input must be the same tensor");
        Ok(())
    }
}
