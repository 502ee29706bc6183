//! Under fp16, a batch that never went through an autocast scope stops at the first layer with
//! an error that says so (its own process: the precision a built Accelerator sets is global).

use candle_core::{DType, Module, Tensor};
use candle_nn::VarMap;

#[test]
fn an_uncast_batch_is_named_as_the_cause() {
    let acc = ivme::Accelerator::builder()
        .cpu(true)
        .precision(ivme::Precision::Fp16)
        .build()
        .unwrap();
    let varmap = VarMap::new();
    let layer = candle_nn::linear(4, 2, acc.var_builder(&varmap, DType::F32)).unwrap();
    let batch = Tensor::ones((3, 4), DType::F32, acc.device()).unwrap();
    let err = ivme::Error::from(layer.forward(&batch).unwrap_err()).to_string();
    assert!(err.contains("got an f32 input and F16 weights"), "{err}");
    assert!(err.contains("was never cast"), "{err}");
    assert!(err.contains("ac.input(&x)"), "{err}");
    // Through the scope the same call works.
    let out = acc
        .autocast(|ac| layer.forward(&ac.input(&batch)?))
        .unwrap();
    assert_eq!(out.dtype(), DType::F32);
}
