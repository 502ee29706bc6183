//! `ivme::nn::softmax_last_dim`: the values of candle-nn's inference op, and gradients equal to
//! those of the same maths composed of candle ops (autograd), to finite differences, and in
//! bf16/f16 close to f32's.

use candle_core::{DType, Device, Result, Tensor, Var, D};

/// Shapes with odd last dims and row counts.
const SHAPES: &[&[usize]] = &[&[1, 7], &[3, 13], &[37, 129], &[2, 3, 16]];

#[path = "nn_support/mod.rs"]
mod nn_support;
use nn_support::{assert_close, tensor};

/// The slow form: the same maths composed of candle ops in f32, differentiated by autograd.
fn slow(x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let e = x
        .broadcast_sub(&x.max_keepdim(D::Minus1)?.detach())?
        .exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?.to_dtype(dtype)
}

/// `x` scaled so that the softmax is neither flat nor one-hot.
fn scaled(shape: &[usize], seed: u64) -> Result<Tensor> {
    tensor(shape, seed)? * 3.
}

/// A variable and the input of `shape` made from it: plain, transposed or narrowed.
fn inputs(shape: &[usize]) -> Result<Vec<(Var, Tensor)>> {
    let n = shape.len();
    let plain = Var::from_tensor(&scaled(shape, 1)?)?;
    let mut t = shape.to_vec();
    t.swap(0, n - 1);
    let transposed = Var::from_tensor(&scaled(&t, 2)?)?;
    let mut w = shape.to_vec();
    w[n - 1] += 3;
    let wide = Var::from_tensor(&scaled(&w, 3)?)?;
    let (x1, x2) = (
        transposed.transpose(0, n - 1)?,
        wide.narrow(n - 1, 1, shape[n - 1])?,
    );
    Ok(vec![
        (plain.clone(), plain.as_tensor().clone()),
        (transposed, x1),
        (wide, x2),
    ])
}

/// The gradient of `Σ f(x) · w` for `x`'s variable.
fn grad(f: fn(&Tensor) -> Result<Tensor>, xv: &Var, x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let g = (f(x)? * w)?.sum_all()?.backward()?;
    Ok(g.get(xv).cloned().expect("no gradient for x"))
}

#[test]
fn forward_matches_candle_nn() -> Result<()> {
    for shape in SHAPES {
        let x = scaled(shape, 1)?;
        let y = ivme::nn::softmax_last_dim(&x)?;
        let want = candle_nn::ops::softmax_last_dim(&x)?;
        assert_close(&y, &want, 1e-6, &format!("{shape:?}"))?;
        for dtype in [DType::BF16, DType::F16] {
            // Against f32 on the same (rounded) input, and loosely against candle-nn's, whose
            // arithmetic is in the half type.
            let x = x.to_dtype(dtype)?;
            let y = ivme::nn::softmax_last_dim(&x)?;
            assert_eq!(y.dtype(), dtype);
            let exact = candle_nn::ops::softmax_last_dim(&x.to_dtype(DType::F32)?)?;
            assert_close(&y, &exact, 1e-2, &format!("{shape:?} {dtype:?}"))?;
            let want = candle_nn::ops::softmax_last_dim(&x)?;
            assert_close(
                &y,
                &want,
                3e-2,
                &format!("{shape:?} {dtype:?} vs candle-nn"),
            )?;
        }
    }
    // Large values and masked (-inf) entries.
    let x = Tensor::new(&[[1000f32, 999., f32::NEG_INFINITY, 0.]], &Device::Cpu)?;
    let y = ivme::nn::softmax_last_dim(&x)?;
    assert_close(
        &y,
        &candle_nn::ops::softmax_last_dim(&x)?,
        1e-6,
        "large and masked",
    )?;
    Ok(())
}

#[test]
fn grads_match_composed_ops() -> Result<()> {
    for shape in SHAPES {
        let w = tensor(shape, 20)?;
        for (k, (xv, x)) in inputs(shape)?.iter().enumerate() {
            assert!(k == 0 || shape[0] == 1 || !x.is_contiguous());
            let got = grad(ivme::nn::softmax_last_dim, xv, x, &w)?;
            let want = grad(slow, xv, x, &w)?;
            assert_close(&got, &want, 1e-6, &format!("{shape:?} input {k}"))?;
        }
    }
    Ok(())
}

#[test]
fn grads_match_finite_differences() -> Result<()> {
    let shape = [3, 6];
    let h = 1e-2;
    let w = tensor(&shape, 20)?;
    let xv = Var::from_tensor(&tensor(&shape, 1)?)?;
    let analytic = grad(ivme::nn::softmax_last_dim, &xv, &xv.as_tensor().clone(), &w)?;
    let base = xv.flatten_all()?.to_vec1::<f32>()?;
    let loss = |j: usize, delta: f32| -> Result<f32> {
        let mut v = base.clone();
        v[j] += delta;
        let x = Tensor::from_vec(v, &shape, &Device::Cpu)?;
        (ivme::nn::softmax_last_dim(&x)? * &w)?
            .sum_all()?
            .to_scalar::<f32>()
    };
    let numeric = (0..base.len())
        .map(|j| Ok((loss(j, h)? - loss(j, -h)?) / (2. * h)))
        .collect::<Result<Vec<f32>>>()?;
    let numeric = Tensor::from_vec(numeric, &shape, &Device::Cpu)?;
    assert_close(&analytic, &numeric, 1e-2, "finite differences")
}

#[test]
fn half_precision_grads_are_close_to_f32() -> Result<()> {
    for dtype in [DType::BF16, DType::F16] {
        for shape in [&[3usize, 13][..], &[37, 129]] {
            let round = |t: Tensor| t.to_dtype(dtype)?.to_dtype(DType::F32);
            let x = round(scaled(shape, 1)?)?;
            let w = round(tensor(shape, 20)?)?;
            let xv = Var::from_tensor(&x)?;
            let full = grad(ivme::nn::softmax_last_dim, &xv, &xv.as_tensor().clone(), &w)?;
            let xh = Var::from_tensor(&x.to_dtype(dtype)?)?;
            let w = w.to_dtype(dtype)?;
            let half = grad(ivme::nn::softmax_last_dim, &xh, &xh.as_tensor().clone(), &w)?;
            assert_eq!(half.dtype(), dtype);
            assert_close(&half, &full, 2e-2, &format!("{dtype:?} {shape:?}"))?;
        }
    }
    Ok(())
}

#[test]
fn bad_inputs_are_clear_errors() -> Result<()> {
    let x = tensor(&[3, 7], 1)?.to_dtype(DType::F64)?;
    let e = ivme::nn::softmax_last_dim(&x).unwrap_err().to_string();
    assert!(e.contains("F64") && e.contains("softmax_last_dim"), "{e}");
    let e = ivme::nn::softmax_last_dim(&Tensor::new(1f32, &Device::Cpu)?)
        .unwrap_err()
        .to_string();
    assert!(e.contains("scalar"), "{e}");
    Ok(())
}
