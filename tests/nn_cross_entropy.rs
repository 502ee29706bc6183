//! `ivme::nn::cross_entropy` against its composed form (log-softmax, gather, mask, mean of
//! candle ops, autograd's backward), with ignored rows, odd sizes and 16-bit logits.

use candle_core::{DType, Device, Tensor, Var};
use ivme::nn::{cross_entropy, cross_entropy_composed};

fn pattern(shape: (usize, usize), seed: f64) -> Tensor {
    let n = shape.0 * shape.1;
    let v: Vec<f32> = (0..n)
        .map(|i| ((i as f64 * 0.917 + seed).sin() * 3.0) as f32)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn labels(n: usize, classes: usize, ignored_every: usize) -> Tensor {
    let v: Vec<i64> = (0..n)
        .map(|i| {
            if ignored_every > 0 && i % ignored_every == 0 {
                -100
            } else {
                ((i * 7 + 3) % classes) as i64
            }
        })
        .collect();
    Tensor::from_vec(v, n, &Device::Cpu).unwrap()
}

fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// The loss and the logits' gradient, fused and composed, for logits in `dtype`.
fn both(n: usize, c: usize, ignored_every: usize, dtype: DType) -> [(Tensor, Tensor); 2] {
    let y = labels(n, c, ignored_every);
    let run = |composed: bool| {
        let x = Var::from_tensor(&pattern((n, c), 0.3).to_dtype(dtype).unwrap()).unwrap();
        let loss = if composed {
            cross_entropy_composed(&x, &y, -100).unwrap()
        } else {
            cross_entropy(&x, &y, -100).unwrap()
        };
        // A factor other than 1 reaches the backward, as a scaled loss's does.
        let grads = (&loss * 3.0).unwrap().backward().unwrap();
        (
            loss,
            grads.get(&x).expect("a gradient for the logits").clone(),
        )
    };
    [run(false), run(true)]
}

#[test]
fn loss_and_gradient_equal_the_composed_form() {
    for (n, c, every) in [
        (1, 2, 0),
        (37, 13, 0),
        (64, 129, 5),
        (130, 1000, 3),
        (5, 7, 1),
    ] {
        let [(l, g), (lc, gc)] = both(n, c, every, DType::F32);
        let dl = max_abs(&l, &lc);
        let dg = max_abs(&g, &gc);
        assert!(
            dl < 1e-5,
            "({n}, {c}), every {every} ignored: loss differs by {dl}"
        );
        assert!(
            dg < 1e-6,
            "({n}, {c}), every {every} ignored: gradient differs by {dg}"
        );
    }
}

#[test]
fn every_row_ignored_is_a_zero_loss_with_zero_gradients() {
    let [(l, g), _] = both(5, 7, 1, DType::F32);
    assert_eq!(l.to_scalar::<f32>().unwrap(), 0.0);
    assert_eq!(max_abs(&g, &g.zeros_like().unwrap()), 0.0);
}

#[test]
fn half_precision_logits_are_close_to_f32() {
    let [(l32, g32), _] = both(64, 129, 5, DType::F32);
    for dtype in [DType::BF16, DType::F16] {
        let [(l, g), (lc, gc)] = both(64, 129, 5, dtype);
        assert_eq!(g.dtype(), dtype, "the gradient has the logits' dtype");
        // The fused op reads the rounded logits as the composed form does (both in f32).
        assert!(max_abs(&l, &lc) < 1e-5, "{dtype:?}: loss against composed");
        assert!(
            max_abs(&g, &gc) < 1e-3,
            "{dtype:?}: gradient against composed"
        );
        assert!(max_abs(&l, &l32) < 2e-2, "{dtype:?}: loss against f32");
        assert!(max_abs(&g, &g32) < 2e-3, "{dtype:?}: gradient against f32");
    }
}

#[test]
fn a_label_outside_the_classes_is_refused_naming_its_row() {
    let x = pattern((3, 4), 0.0);
    let y = Tensor::new(&[1i64, 4, 0], &Device::Cpu).unwrap();
    let err = cross_entropy(&x, &y, -100).unwrap_err().to_string();
    assert!(
        err.contains("label 4 at row 1") && err.contains("0..4"),
        "{err}"
    );
    let short = Tensor::new(&[1i64, 2], &Device::Cpu).unwrap();
    let err = cross_entropy(&x, &short, -100).unwrap_err().to_string();
    assert!(err.contains("2 labels for 3 rows"), "{err}");
}
