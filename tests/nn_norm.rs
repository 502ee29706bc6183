//! `ivme::nn::{rms_norm, layer_norm}`: the values of candle-nn's inference ops, and gradients
//! equal to those of the same maths composed of candle ops (autograd), to finite differences,
//! and in bf16/f16 close to f32's.

use candle_core::{DType, Device, Result, Tensor, Var, D};

const EPS: f32 = 1e-5;
/// Shapes with odd last dims and row counts.
const SHAPES: &[&[usize]] = &[&[1, 7], &[3, 13], &[37, 129], &[2, 3, 16]];

#[path = "nn_support/mod.rs"]
mod nn_support;
use nn_support::{assert_close, tensor};

type Op = fn(&Tensor, &[Tensor]) -> Result<Tensor>;

fn rms_fused(x: &Tensor, p: &[Tensor]) -> Result<Tensor> {
    ivme::nn::rms_norm(x, &p[0], EPS)
}

fn ln_fused(x: &Tensor, p: &[Tensor]) -> Result<Tensor> {
    ivme::nn::layer_norm(x, &p[0], p.get(1), EPS)
}

/// The slow forms' arithmetic: f64 for f64 inputs, else f32.
fn work(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The slow forms: the same maths composed of candle ops in f32, differentiated by autograd.
fn rms_slow(x: &Tensor, p: &[Tensor]) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(work(dtype))?;
    let norm = (x.sqr()?.mean_keepdim(D::Minus1)? + EPS as f64)?.sqrt()?;
    x.broadcast_div(&norm)?
        .broadcast_mul(&p[0].to_dtype(work(dtype))?)?
        .to_dtype(dtype)
}

fn ln_slow(x: &Tensor, p: &[Tensor]) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(work(dtype))?;
    let x = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let norm = (x.sqr()?.mean_keepdim(D::Minus1)? + EPS as f64)?.sqrt()?;
    let y = x
        .broadcast_div(&norm)?
        .broadcast_mul(&p[0].to_dtype(work(dtype))?)?;
    let y = match p.get(1) {
        Some(beta) => y.broadcast_add(&beta.to_dtype(work(dtype))?)?,
        None => y,
    };
    y.to_dtype(dtype)
}

#[derive(Debug, Clone, Copy)]
enum Make {
    Plain,
    Transposed,
    Narrowed,
}

/// A variable and the input of `shape` made from it (non-contiguous unless `Plain`).
fn input(shape: &[usize], make: Make, seed: u64, dtype: DType) -> Result<(Var, Tensor)> {
    let n = shape.len();
    let mut base = shape.to_vec();
    match make {
        Make::Plain => {}
        Make::Transposed => base.swap(0, n - 1),
        Make::Narrowed => base[n - 1] += 3,
    }
    let v = Var::from_tensor(&tensor(&base, seed)?.to_dtype(dtype)?)?;
    let x = match make {
        Make::Plain => v.as_tensor().clone(),
        Make::Transposed => v.transpose(0, n - 1)?,
        Make::Narrowed => v.narrow(n - 1, 1, shape[n - 1])?,
    };
    assert_eq!(x.dims(), shape);
    Ok((v, x))
}

/// The gradients of `Σ op(x, params) · w` for `x`'s variable and each parameter.
fn grads(op: Op, xv: &Var, x: &Tensor, params: &[Var], w: &Tensor) -> Result<Vec<Tensor>> {
    let p: Vec<Tensor> = params.iter().map(|v| v.as_tensor().clone()).collect();
    let g = (op(x, &p)? * w)?.sum_all()?.backward()?;
    let mut out = vec![g.get(xv).cloned().expect("no gradient for x")];
    for v in params {
        out.push(g.get(v).cloned().expect("no gradient for a weight"));
    }
    Ok(out)
}

/// The fused op's and the slow form's gradients for one case, in `dtype`.
fn both_grads(
    fused: Op,
    slow: Op,
    n_params: usize,
    shape: &[usize],
    make: Make,
    dtype: DType,
) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
    let d = shape[shape.len() - 1];
    let (xv, x) = input(shape, make, 1, dtype)?;
    let params = (0..n_params)
        .map(|i| Var::from_tensor(&tensor(&[d], 10 + i as u64)?.to_dtype(dtype)?))
        .collect::<Result<Vec<_>>>()?;
    let w = tensor(shape, 20)?.to_dtype(dtype)?;
    Ok((
        grads(fused, &xv, &x, &params, &w)?,
        grads(slow, &xv, &x, &params, &w)?,
    ))
}

const OPS: &[(&str, Op, Op, usize)] = &[
    ("rms_norm", rms_fused, rms_slow, 1),
    ("layer_norm", ln_fused, ln_slow, 2),
    ("layer_norm without beta", ln_fused, ln_slow, 1),
];

#[test]
fn forward_matches_candle_nn() -> Result<()> {
    for shape in SHAPES {
        let d = shape[shape.len() - 1];
        let (x, alpha, beta) = (tensor(shape, 1)?, tensor(&[d], 2)?, tensor(&[d], 3)?);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let tol = if dtype == DType::F32 { 1e-6 } else { 1e-2 };
            let (x, a, b) = (
                x.to_dtype(dtype)?,
                alpha.to_dtype(dtype)?,
                beta.to_dtype(dtype)?,
            );
            let what = format!("{shape:?} {dtype:?}");
            if dtype != DType::F32 {
                // Also against f32 on the same (rounded) inputs.
                let f = |t: &Tensor| t.to_dtype(DType::F32);
                let y = ivme::nn::rms_norm(&x, &a, EPS)?;
                let exact = candle_nn::ops::rms_norm(&f(&x)?, &f(&a)?, EPS)?;
                assert_close(&y, &exact, 1e-2, &format!("rms_norm {what} vs f32"))?;
                let y = ivme::nn::layer_norm(&x, &a, Some(&b), EPS)?;
                let exact = candle_nn::ops::layer_norm(&f(&x)?, &f(&a)?, &f(&b)?, EPS)?;
                assert_close(&y, &exact, 1e-2, &format!("layer_norm {what} vs f32"))?;
            }
            let y = ivme::nn::rms_norm(&x, &a, EPS)?;
            assert_eq!(y.dtype(), dtype);
            let want = candle_nn::ops::rms_norm(&x, &a, EPS)?;
            assert_close(&y, &want, tol, &format!("rms_norm {what}"))?;
            let y = ivme::nn::layer_norm(&x, &a, Some(&b), EPS)?;
            let want = candle_nn::ops::layer_norm(&x, &a, &b, EPS)?;
            assert_close(&y, &want, tol, &format!("layer_norm {what}"))?;
            let y = ivme::nn::layer_norm(&x, &a, None, EPS)?;
            let want = candle_nn::ops::layer_norm(&x, &a, &b.zeros_like()?, EPS)?;
            assert_close(&y, &want, tol, &format!("layer_norm without beta {what}"))?;
        }
    }
    Ok(())
}

#[test]
fn grads_match_composed_ops() -> Result<()> {
    for &(name, fused, slow, n_params) in OPS {
        for shape in SHAPES {
            for make in [Make::Plain, Make::Transposed, Make::Narrowed] {
                let (got, want) = both_grads(fused, slow, n_params, shape, make, DType::F32)?;
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_close(g, w, 1e-6, &format!("{name} {shape:?} {make:?} grad {i}"))?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn grads_match_finite_differences() -> Result<()> {
    let shape = [2, 5];
    let h = 1e-2;
    for &(name, fused, _, n_params) in OPS {
        let (xv, x) = input(&shape, Make::Plain, 1, DType::F32)?;
        let params = (0..n_params)
            .map(|i| Var::from_tensor(&tensor(&[5], 10 + i as u64)?))
            .collect::<Result<Vec<_>>>()?;
        let w = tensor(&shape, 20)?;
        let analytic = grads(fused, &xv, &x, &params, &w)?;
        // Perturb each element of each input in turn.
        let mut inputs: Vec<Tensor> = std::iter::once(x.detach())
            .chain(params.iter().map(|v| v.as_tensor().detach()))
            .collect();
        for (k, analytic) in analytic.iter().enumerate() {
            let base = inputs[k].flatten_all()?.to_vec1::<f32>()?;
            let mut numeric = vec![0f32; base.len()];
            for (j, num) in numeric.iter_mut().enumerate() {
                let mut loss = |delta: f32| -> Result<f32> {
                    let mut v = base.clone();
                    v[j] += delta;
                    inputs[k] = Tensor::from_vec(v, inputs[k].shape(), &Device::Cpu)?;
                    let y = fused(&inputs[0], &inputs[1..])?;
                    (y * &w)?.sum_all()?.to_scalar::<f32>()
                };
                *num = (loss(h)? - loss(-h)?) / (2. * h);
            }
            inputs[k] = Tensor::from_vec(base, inputs[k].shape(), &Device::Cpu)?;
            let numeric = Tensor::from_vec(numeric, analytic.shape(), &Device::Cpu)?;
            assert_close(analytic, &numeric, 1e-2, &format!("{name} input {k}"))?;
        }
    }
    Ok(())
}

#[test]
fn half_precision_grads_are_close_to_f32() -> Result<()> {
    for &(name, fused, _, n_params) in OPS {
        for dtype in [DType::BF16, DType::F16] {
            for shape in [&[3usize, 13][..], &[37, 129]] {
                // The same (rounded) inputs in both dtypes: `input` rounds through `dtype`.
                let (half, _) = both_grads(fused, fused, n_params, shape, Make::Plain, dtype)?;
                let round = |t: Tensor| t.to_dtype(dtype)?.to_dtype(DType::F32);
                let d = shape[1];
                let x = Var::from_tensor(&round(tensor(shape, 1)?)?)?;
                let params = (0..n_params)
                    .map(|i| Var::from_tensor(&round(tensor(&[d], 10 + i as u64)?)?))
                    .collect::<Result<Vec<_>>>()?;
                let w = round(tensor(shape, 20)?)?;
                let full = grads(fused, &x, &x.as_tensor().clone(), &params, &w)?;
                for (i, (g, f)) in half.iter().zip(&full).enumerate() {
                    assert_eq!(g.dtype(), dtype);
                    assert_close(g, f, 2e-2, &format!("{name} {dtype:?} {shape:?} grad {i}"))?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn bad_inputs_are_clear_errors() -> Result<()> {
    let x = tensor(&[3, 7], 1)?;
    let e = ivme::nn::rms_norm(&x, &tensor(&[6], 2)?, EPS)
        .unwrap_err()
        .to_string();
    assert!(e.contains("[6]") && e.contains("[3, 7]"), "{e}");
    let e = ivme::nn::layer_norm(&x, &tensor(&[7], 2)?, Some(&tensor(&[8], 2)?), EPS)
        .unwrap_err()
        .to_string();
    assert!(e.contains("beta") && e.contains("[8]"), "{e}");
    let x64 = x.to_dtype(DType::F64)?;
    let a64 = tensor(&[7], 2)?.to_dtype(DType::F64)?;
    let e = ivme::nn::rms_norm(&x64, &a64, EPS).unwrap_err().to_string();
    assert!(e.contains("F64"), "{e}");
    let e = ivme::nn::layer_norm(&x, &a64, None, EPS)
        .unwrap_err()
        .to_string();
    assert!(e.contains("dtype"), "{e}");
    Ok(())
}
