//! Misuse of the runtime is an error that names the cause and the fix, never a silent wrong run.

use candle_core::{DType, Device, Tensor};
use candle_nn::{linear, Optimizer, VarBuilder, VarMap};
use ivme::optim::{AdamW, ParamsAdamW};
use ivme::{Accelerator, Precision};

fn acc(b: ivme::AcceleratorBuilder) -> Accelerator {
    b.cpu(true).build().unwrap()
}

fn model(acc: &Accelerator) -> VarMap {
    let vm = VarMap::new();
    linear(
        3,
        2,
        VarBuilder::from_varmap(&vm, acc.param_dtype(DType::F32), acc.device()),
    )
    .unwrap();
    vm
}

#[test]
fn bad_builder_settings_are_refused_with_the_fix() {
    let e = Accelerator::builder()
        .grad_accum(0)
        .build()
        .unwrap_err()
        .to_string();
    assert!(e.contains("grad_accum") && e.contains("1"), "{e}");
    let e = Accelerator::builder()
        .clip_grad_norm(1.0)
        .clip_grad_value(1.0)
        .build()
        .unwrap_err()
        .to_string();
    assert!(e.contains("choose one"), "{e}");
    let e = Accelerator::builder()
        .clip_grad_norm(-1.0)
        .build()
        .unwrap_err()
        .to_string();
    assert!(e.contains("positive"), "{e}");
    let e = "fp8".parse::<Precision>().unwrap_err().to_string();
    assert!(e.contains("no, fp16, bf16"), "{e}");
}

#[test]
fn preparing_a_varmap_twice_is_an_error() {
    let mut a = acc(Accelerator::builder());
    let vm = model(&a);
    let vm = a.prepare(vm).unwrap();
    let e = a.prepare(vm).err().expect("must fail").to_string();
    assert!(e.contains("already prepared"), "{e}");
}

#[test]
fn an_optimizer_over_unprepared_variables_is_an_error() {
    let mut a = acc(Accelerator::builder());
    let vm = model(&a);
    let opt = AdamW::new(vm.all_vars(), ParamsAdamW::default()).unwrap();
    let e = a.prepare(opt).unwrap_err().to_string();
    assert!(e.contains("prepare the VarMap"), "{e}");
}

#[test]
fn f32_weights_under_mixed_precision_are_refused_not_silently_trained_in_f32() {
    let mut a = acc(Accelerator::builder().precision(Precision::Bf16));
    let vm = VarMap::new();
    linear(3, 2, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu)).unwrap();
    let e = a.prepare(vm).err().expect("must fail").to_string();
    assert!(e.contains("param_dtype"), "{e}");
}

#[test]
fn accumulating_without_a_prepared_model_is_an_error() {
    let mut a = acc(Accelerator::builder().grad_accum(2));
    let vm = model(&a);
    let x = Tensor::ones((1, 3), DType::F32, &Device::Cpu).unwrap();
    let w = vm.all_vars()[0].as_tensor().clone();
    let loss = x
        .broadcast_mul(&w.sum_keepdim(0).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    let e = a.backward(&loss).unwrap_err().to_string();
    assert!(e.contains("prepare"), "{e}");
}

#[test]
fn an_empty_varmap_cannot_be_prepared() {
    let mut a = acc(Accelerator::builder());
    let e = a
        .prepare(VarMap::new())
        .err()
        .expect("must fail")
        .to_string();
    assert!(e.contains("build the model"), "{e}");
}
