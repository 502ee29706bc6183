//! `ivme::nn::linear`: `x · Wᵀ + b` equal to candle-nn's `Linear` forward and (through
//! autograd) backward on 1-, 2-, 3- and 4-d inputs, contiguous or not, to finite differences,
//! and in bf16/f16 close to f32's. Through an Accelerator's backward, a weight's gradient is
//! written in f32 straight from the products: a bf16 weight's is the f32 sum of its uses in one
//! backward (other ops' included), rounded once; a checkpointed segment's is added as candle
//! adds bf16 gradients.

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use ivme::nn::{linear, linear_composed};

#[path = "nn_support/mod.rs"]
mod nn_support;
use nn_support::{assert_close, tensor};

/// `(x's shape, out)`: odd sizes, a single row, a vector, a 4-d batch.
const CASES: &[(&[usize], usize)] = &[
    (&[7], 3),
    (&[1, 13], 5),
    (&[37, 129], 31),
    (&[2, 3, 16], 9),
    (&[2, 2, 3, 8], 4),
];

#[derive(Debug, Clone, Copy)]
enum Make {
    Plain,
    /// A narrow of a wider last dimension: rows strided wider than they are.
    Narrowed,
    /// The first and last dimensions swapped: not evenly strided rows.
    Transposed,
}

fn input(shape: &[usize], make: Make, dtype: DType) -> Result<(Var, Tensor)> {
    let n = shape.len();
    let mut base = shape.to_vec();
    match make {
        Make::Plain => {}
        Make::Narrowed => base[n - 1] += 5,
        Make::Transposed => base.swap(0, n - 1),
    }
    let v = Var::from_tensor(&tensor(&base, 1)?.to_dtype(dtype)?)?;
    let x = match make {
        Make::Plain => v.as_tensor().clone(),
        Make::Narrowed => v.narrow(n - 1, 2, shape[n - 1])?,
        Make::Transposed => v.transpose(0, n - 1)?,
    };
    assert_eq!(x.dims(), shape);
    Ok((v, x))
}

type Op = fn(&Tensor, &Tensor, Option<&Tensor>) -> Result<Tensor>;

/// The output and the gradients of `Σ y · m` for x's variable, the weight and the bias.
fn run(
    op: Op,
    shape: &[usize],
    out: usize,
    make: Make,
    bias: bool,
    dtype: DType,
) -> Result<(Tensor, Vec<Tensor>)> {
    let (xv, x) = input(shape, make, dtype)?;
    let k = shape[shape.len() - 1];
    let w = Var::from_tensor(&tensor(&[out, k], 2)?.to_dtype(dtype)?)?;
    let b = Var::from_tensor(&tensor(&[out], 3)?.to_dtype(dtype)?)?;
    let y = op(&x, w.as_tensor(), bias.then_some(b.as_tensor()))?;
    let m = tensor(y.dims(), 4)?;
    let g = (y.to_dtype(DType::F32)? * m)?.sum_all()?.backward()?;
    let mut grads = vec![
        g.get(&xv).cloned().expect("dx"),
        g.get(&w).cloned().expect("dW"),
    ];
    if bias {
        grads.push(g.get(&b).cloned().expect("db"));
    }
    Ok((y, grads))
}

#[test]
fn values_and_grads_match_candle_nns_linear() -> Result<()> {
    for &(shape, out) in CASES {
        for make in [Make::Plain, Make::Narrowed, Make::Transposed] {
            if shape.len() == 1 && matches!(make, Make::Transposed) {
                continue;
            }
            for bias in [false, true] {
                let what = format!("{shape:?} → {out} {make:?} bias {bias}");
                let (y, g) = run(linear, shape, out, make, bias, DType::F32)?;
                let (y0, g0) = run(linear_composed, shape, out, make, bias, DType::F32)?;
                assert_eq!(y.dims(), y0.dims(), "{what}");
                assert_close(&y, &y0, 1e-6, &format!("{what}: value"))?;
                for (i, (a, b)) in g.iter().zip(&g0).enumerate() {
                    assert_eq!(a.dims(), b.dims(), "{what}: gradient {i}");
                    assert_close(a, b, 1e-6, &format!("{what}: gradient {i}"))?;
                }
            }
        }
    }
    // The composed reference is candle-nn's own layer.
    let x = tensor(&[3, 4, 6], 9)?;
    let (w, b) = (tensor(&[5, 6], 10)?, tensor(&[5], 11)?);
    let want = candle_nn::Linear::new(w.clone(), Some(b.clone())).forward(&x)?;
    assert_close(&linear(&x, &w, Some(&b))?, &want, 1e-6, "candle-nn")?;
    Ok(())
}

#[test]
fn grads_match_finite_differences() -> Result<()> {
    let (n, k, o) = (4, 5, 3);
    let h = 1e-2f32;
    let (x0, w0) = (tensor(&[n, k], 1)?, tensor(&[o, k], 2)?);
    let m = tensor(&[n, o], 4)?;
    let (x, w) = (Var::from_tensor(&x0)?, Var::from_tensor(&w0)?);
    let g = (linear(x.as_tensor(), w.as_tensor(), None)? * &m)?
        .sum_all()?
        .backward()?;
    let loss = |x: &Tensor, w: &Tensor| -> Result<f64> {
        Ok((linear(x, w, None)? * &m)?.sum_all()?.to_scalar::<f32>()? as f64)
    };
    for (i, (var, base)) in [(&x, &x0), (&w, &w0)].into_iter().enumerate() {
        let flat = base.flatten_all()?.to_vec1::<f32>()?;
        let mut numeric = vec![0f32; flat.len()];
        for (j, num) in numeric.iter_mut().enumerate() {
            let at = |delta: f32| -> Result<f64> {
                let mut v = flat.clone();
                v[j] += delta;
                let t = Tensor::from_vec(v, base.shape(), &Device::Cpu)?;
                if i == 0 {
                    loss(&t, &w0)
                } else {
                    loss(&x0, &t)
                }
            };
            *num = ((at(h)? - at(-h)?) / (2. * h as f64)) as f32;
        }
        let numeric = Tensor::from_vec(numeric, base.shape(), &Device::Cpu)?;
        assert_close(
            g.get(var).expect("grad"),
            &numeric,
            2e-3,
            &format!("input {i}"),
        )?;
    }
    Ok(())
}

#[test]
fn half_precision_is_close_to_f32() -> Result<()> {
    for dtype in [DType::BF16, DType::F16] {
        for make in [Make::Plain, Make::Narrowed] {
            let what = format!("{dtype:?} {make:?}");
            let (y, g) = run(linear, &[2, 19, 40], 23, make, true, dtype)?;
            assert_eq!(y.dtype(), dtype);
            // candle's own product on the same rounded inputs.
            let (y0, g0) = run(linear_composed, &[2, 19, 40], 23, make, true, dtype)?;
            let tol = if dtype == DType::BF16 { 1e-2 } else { 2e-3 };
            assert_close(&y, &y0, tol, &format!("{what}: value"))?;
            for (i, (a, b)) in g.iter().zip(&g0).enumerate() {
                assert_eq!(a.dtype(), dtype);
                assert_close(a, b, tol, &format!("{what}: gradient {i}"))?;
            }
        }
    }
    Ok(())
}

#[test]
fn empty_sizes_give_empty_or_zero_results() -> Result<()> {
    let dev = Device::Cpu;
    let x = Var::zeros((3, 0), DType::F32, &dev)?;
    let w = Var::zeros((2, 0), DType::F32, &dev)?;
    let y = linear(x.as_tensor(), w.as_tensor(), None)?;
    assert_eq!(y.to_vec2::<f32>()?, [[0f32; 2]; 3]);
    let rows = Tensor::zeros((0, 4), DType::F32, &dev)?;
    let y = linear(&rows, &Tensor::ones((2, 4), DType::F32, &dev)?, None)?;
    assert_eq!(y.dims(), [0, 2]);
    Ok(())
}

#[test]
fn bad_inputs_are_clear_errors() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 3), DType::F32, &dev)?;
    let err = linear(&x, &Tensor::zeros((4, 5), DType::F32, &dev)?, None).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("[2, 3]") && msg.contains("[4, 5]"), "{msg}");
    let w = Tensor::zeros((4, 3), DType::F32, &dev)?;
    let err = linear(&x, &w, Some(&Tensor::zeros(3, DType::F32, &dev)?)).unwrap_err();
    assert!(err.to_string().contains("bias has shape [3]"), "{err}");
    let err = linear(&x, &w.to_dtype(DType::BF16)?, None).unwrap_err();
    assert!(err.to_string().contains("share a dtype"), "{err}");
    let err = linear(&x, &Tensor::zeros(3, DType::F32, &dev)?, None).unwrap_err();
    assert!(err.to_string().contains("(out, in)"), "{err}");
    Ok(())
}

/// Whole numbers in [-16, 16]: their products and sums here are exact in f32 and often need
/// rounding in bf16 (which holds every whole number only up to 256).
fn whole(shape: &[usize], seed: u64) -> Result<Tensor> {
    (tensor(shape, seed)? * 8.0)?.round()?.to_dtype(DType::BF16)
}

/// The gradient of a bf16 weight `w` (5 × 33) that an Accelerator's backward gives, in f32,
/// and what it must be, from the same values in exact f32 arithmetic. The loss uses `w` in a
/// plain candle product `w · c` and in a linear layer; in a second linear layer too, or, when
/// `checkpointed`, the first inside a checkpointed segment (whose gradient a backward of its
/// own gives, rounded, then added to the bf16 one of `w · c` as candle adds bf16 gradients).
fn sink_case(checkpointed: bool) -> ivme::Result<(Tensor, Tensor)> {
    let dev = Device::Cpu;
    let mut acc = ivme::Accelerator::builder()
        .cpu(true)
        .precision(ivme::Precision::Bf16)
        .grad_accum(2)
        .activation_checkpointing(checkpointed)
        .build()?;
    let varmap = candle_nn::VarMap::new();
    varmap.get((5, 33), "w", candle_nn::Init::Const(0.), DType::BF16, &dev)?;
    let varmap = acc.prepare(varmap)?;
    let w: Var = varmap.data().lock().unwrap()["w"].clone();
    w.set(&whole(&[5, 33], 20)?)?;
    let (x1, x2, c) = (
        whole(&[37, 33], 21)?,
        whole(&[2, 9, 33], 22)?,
        whole(&[5, 33], 23)?,
    );
    let (m1, m2) = (whole(&[37, 5], 24)?, whole(&[2, 9, 5], 25)?);
    let first = if checkpointed {
        let w = w.as_tensor().clone();
        ivme::activations::checkpoint(&x1, move |x| linear(x, &w, None))?
    } else {
        linear(&x1, &w, None)?
    };
    let mut loss = ((first * &m1)?.sum_all()? + (w.as_tensor() * &c)?.sum_all()?)?;
    if !checkpointed {
        loss = (loss + (linear(&x2, &w, None)? * &m2)?.sum_all()?)?;
    }
    acc.backward(&loss)?;
    // The first of the window's two micro-batches: its gradient, as half the window's mean.
    let got = (acc.accumulated_gradient(&w)?.expect("a gradient") * 2.0)?;
    let f = |t: &Tensor| t.to_dtype(DType::F32);
    let round = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
    let dw1 = f(&m1)?.t()?.matmul(&f(&x1)?)?;
    let want = if checkpointed {
        round(&(round(&dw1)? + f(&c)?)?)?
    } else {
        let dw2 = f(&m2)?
            .reshape((18, 5))?
            .t()?
            .matmul(&f(&x2)?.reshape((18, 33))?)?;
        round(&((dw1 + dw2)? + f(&c)?)?)?
    };
    Ok((got, want))
}

#[test]
fn an_accelerators_backward_rounds_a_bf16_weights_gradient_once() -> ivme::Result<()> {
    for checkpointed in [false, true] {
        let (got, want) = sink_case(checkpointed)?;
        let (got, want) = (got.flatten_all()?, want.flatten_all()?);
        let (got, want) = (got.to_vec1::<f32>()?, want.to_vec1::<f32>()?);
        let off = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        assert_eq!(
            off, 0,
            "checkpointed {checkpointed}: {off} of 165 elements differ"
        );
        // The case needs rounding: some sums lie above 256.
        assert!(
            want.iter().any(|w| w.abs() > 256.),
            "checkpointed {checkpointed}"
        );
    }
    Ok(())
}
