//! `ivme::nn::{rope, rope_i, rope_thd}`: the values of candle-nn's inference ops, and gradients
//! equal to those of the same maths composed of candle ops (autograd), to finite differences,
//! and in bf16/f16 close to f32's; the tables get no gradient.

use candle_core::{DType, Device, Result, Tensor, Var, D};

#[path = "nn_support/mod.rs"]
mod nn_support;
use nn_support::{assert_close, tensor};

type Op = fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>;

/// `(b, h, t, d)` (for `rope_thd` read `(b, t, h, d)`): odd head counts and lengths, d/2 odd.
const SHAPES: &[[usize; 4]] = &[[1, 1, 1, 2], [2, 3, 7, 14], [1, 1, 37, 130]];

/// Whether the op's position axis is 1 (`(b, t, h, d)`) rather than 2.
fn thd(name: &str) -> bool {
    name == "rope_thd"
}

/// `cos`/`sin` tables of `len` positions for `d`: `(len, d/2)`, or `(b, len, d/2)` when
/// `batched` (each batch element shifted by a few positions).
fn tables(b: usize, len: usize, d: usize, batched: bool) -> Result<(Tensor, Tensor)> {
    let half = d / 2;
    let bs = if batched { b } else { 1 };
    let mut angles = Vec::with_capacity(bs * len * half);
    for bi in 0..bs {
        for p in 0..len {
            for i in 0..half {
                let freq = 10000f32.powf(-(i as f32) / half as f32);
                angles.push((p + 3 * bi) as f32 * freq + 0.1);
            }
        }
    }
    let shape: Vec<usize> = if batched {
        vec![b, len, half]
    } else {
        vec![len, half]
    };
    let cos = angles.iter().map(|a| a.cos()).collect();
    let sin = angles.iter().map(|a| a.sin()).collect();
    Ok((
        Tensor::from_vec(cos, shape.as_slice(), &Device::Cpu)?,
        Tensor::from_vec(sin, shape.as_slice(), &Device::Cpu)?,
    ))
}

/// The slow forms: the same maths composed of candle ops in f32, differentiated by autograd.
fn rope_slow(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, _, t, d) = x.dims4()?;
    let half = d / 2;
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let table = |cs: &Tensor| -> Result<Tensor> {
        let cs = cs
            .detach()
            .narrow(cs.rank() - 2, 0, t)?
            .to_dtype(DType::F32)?;
        cs.reshape((if cs.rank() == 3 { b } else { 1 }, 1, t, half))
    };
    let (c, s) = (table(cos)?, table(sin)?);
    let (x1, x2) = (
        x.narrow(D::Minus1, 0, half)?,
        x.narrow(D::Minus1, half, half)?,
    );
    let y1 = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
    let y2 = (x1.broadcast_mul(&s)? + x2.broadcast_mul(&c)?)?;
    Tensor::cat(&[y1, y2], D::Minus1)?.to_dtype(dtype)
}

fn rope_i_slow(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    // Interleaved pairs are half-split pairs after moving the odd elements to the back.
    let (b, h, t, d) = x.dims4()?;
    let split = x
        .reshape((b, h, t, d / 2, 2))?
        .transpose(3, 4)?
        .reshape((b, h, t, d))?;
    let y = rope_slow(&split, cos, sin)?;
    y.reshape((b, h, t, 2, d / 2))?
        .transpose(3, 4)?
        .reshape((b, h, t, d))
}

fn rope_thd_slow(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rope_slow(&x.transpose(1, 2)?, cos, sin)?.transpose(1, 2)
}

const OPS: &[(&str, Op, Op, Op)] = &[
    (
        "rope",
        ivme::nn::rope,
        rope_slow,
        candle_nn::rotary_emb::rope,
    ),
    (
        "rope_i",
        ivme::nn::rope_i,
        rope_i_slow,
        candle_nn::rotary_emb::rope_i,
    ),
    (
        "rope_thd",
        ivme::nn::rope_thd,
        rope_thd_slow,
        candle_nn::rotary_emb::rope_thd,
    ),
];

/// The position count of an input of `shape` for the op `name`.
fn seq_len(name: &str, shape: &[usize; 4]) -> usize {
    if thd(name) {
        shape[1]
    } else {
        shape[2]
    }
}

/// A variable and the input of `shape` made from it: plain, with its two middle axes
/// transposed, or narrowed along the last.
fn inputs(shape: &[usize; 4], dtype: DType) -> Result<Vec<(Var, Tensor)>> {
    let [b, n1, n2, d] = *shape;
    let plain = Var::from_tensor(&tensor(shape, 1)?.to_dtype(dtype)?)?;
    let swapped = Var::from_tensor(&tensor(&[b, n2, n1, d], 2)?.to_dtype(dtype)?)?;
    let wide = Var::from_tensor(&tensor(&[b, n1, n2, d + 4], 3)?.to_dtype(dtype)?)?;
    let (x1, x2) = (swapped.transpose(1, 2)?, wide.narrow(3, 2, d)?);
    Ok(vec![
        (plain.clone(), plain.as_tensor().clone()),
        (swapped, x1),
        (wide, x2),
    ])
}

/// The gradient of `Σ op(x, cos, sin) · w` for `x`'s variable; checks that tables given as
/// variables get none.
fn grad(op: Op, xv: &Var, x: &Tensor, cos: &Tensor, sin: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (cv, sv) = (Var::from_tensor(cos)?, Var::from_tensor(sin)?);
    let g = (op(x, &cv, &sv)? * w)?.sum_all()?.backward()?;
    assert!(
        g.get(&cv).is_none() && g.get(&sv).is_none(),
        "a table got a gradient"
    );
    Ok(g.get(xv).cloned().expect("no gradient for x"))
}

#[test]
fn forward_matches_candle_nn() -> Result<()> {
    for &(name, fused, _, candle) in OPS {
        for shape in SHAPES {
            let t = seq_len(name, shape);
            let x = tensor(shape, 1)?;
            // 2-d tables longer than the sequence, and per-batch 3-d ones.
            for (len, batched) in [(t + 4, false), (t, true)] {
                let (cos, sin) = tables(shape[0], len, shape[3], batched)?;
                for dtype in [DType::F32, DType::BF16, DType::F16] {
                    let tol = if dtype == DType::F32 { 1e-6 } else { 1e-2 };
                    let (x, c, s) = (
                        x.to_dtype(dtype)?,
                        cos.to_dtype(dtype)?,
                        sin.to_dtype(dtype)?,
                    );
                    let y = fused(&x, &c, &s)?;
                    assert_eq!(y.dtype(), dtype);
                    let what = format!("{name} {shape:?} {dtype:?} batched {batched}");
                    assert_close(&y, &candle(&x, &c, &s)?, tol, &what)?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn grads_match_composed_ops() -> Result<()> {
    for &(name, fused, slow, _) in OPS {
        for shape in SHAPES {
            let t = seq_len(name, shape);
            let w = tensor(shape, 20)?;
            for batched in [false, true] {
                let (cos, sin) = tables(shape[0], t + 2, shape[3], batched)?;
                for (k, (xv, x)) in inputs(shape, DType::F32)?.iter().enumerate() {
                    let got = grad(fused, xv, x, &cos, &sin, &w)?;
                    let want = grad(slow, xv, x, &cos, &sin, &w)?;
                    let what = format!("{name} {shape:?} batched {batched} input {k}");
                    assert_close(&got, &want, 1e-6, &what)?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn grads_match_finite_differences() -> Result<()> {
    let shape = [1, 2, 3, 4];
    let h = 1e-2;
    let w = tensor(&shape, 20)?;
    for &(name, fused, _, _) in OPS {
        let (cos, sin) = tables(1, 3, 4, false)?;
        let xv = Var::from_tensor(&tensor(&shape, 1)?)?;
        let analytic = grad(fused, &xv, &xv.as_tensor().clone(), &cos, &sin, &w)?;
        let base = xv.flatten_all()?.to_vec1::<f32>()?;
        let loss = |j: usize, delta: f32| -> Result<f32> {
            let mut v = base.clone();
            v[j] += delta;
            let x = Tensor::from_vec(v, &shape, &Device::Cpu)?;
            (fused(&x, &cos, &sin)? * &w)?.sum_all()?.to_scalar::<f32>()
        };
        let numeric = (0..base.len())
            .map(|j| Ok((loss(j, h)? - loss(j, -h)?) / (2. * h)))
            .collect::<Result<Vec<f32>>>()?;
        let numeric = Tensor::from_vec(numeric, &shape, &Device::Cpu)?;
        assert_close(&analytic, &numeric, 1e-2, name)?;
    }
    Ok(())
}

#[test]
fn half_precision_grads_are_close_to_f32() -> Result<()> {
    for &(name, fused, _, _) in OPS {
        for dtype in [DType::BF16, DType::F16] {
            let shape = &[2, 3, 7, 14];
            let round = |t: Tensor| t.to_dtype(dtype)?.to_dtype(DType::F32);
            let (cos, sin) = tables(2, 9, 14, false)?;
            let (cos, sin) = (round(cos)?, round(sin)?);
            let x = Var::from_tensor(&round(tensor(shape, 1)?)?)?;
            let w = round(tensor(shape, 20)?)?;
            let full = grad(fused, &x, &x.as_tensor().clone(), &cos, &sin, &w)?;
            let xh = Var::from_tensor(&x.to_dtype(dtype)?)?;
            let (ch, sh, wh) = (
                cos.to_dtype(dtype)?,
                sin.to_dtype(dtype)?,
                w.to_dtype(dtype)?,
            );
            let half = grad(fused, &xh, &xh.as_tensor().clone(), &ch, &sh, &wh)?;
            assert_eq!(half.dtype(), dtype);
            assert_close(&half, &full, 2e-2, &format!("{name} {dtype:?}"))?;
        }
    }
    Ok(())
}

#[test]
fn bad_inputs_are_clear_errors() -> Result<()> {
    let x = tensor(&[1, 2, 5, 8], 1)?;
    let (cos, sin) = tables(1, 4, 8, false)?; // too few positions
    let e = ivme::nn::rope(&x, &cos, &sin).unwrap_err().to_string();
    assert!(e.contains("[4, 4]") && e.contains("[1, 2, 5, 8]"), "{e}");
    let (cos, sin) = tables(1, 5, 6, false)?; // wrong d/2
    let e = ivme::nn::rope_i(&x, &cos, &sin).unwrap_err().to_string();
    assert!(e.contains("rope_i") && e.contains("[5, 3]"), "{e}");
    let e = ivme::nn::rope_thd(&tensor(&[2, 8], 1)?, &cos, &sin)
        .unwrap_err()
        .to_string();
    assert!(e.contains("(b, t, h, d)"), "{e}");
    let (cos, sin) = tables(1, 5, 8, false)?;
    let e = ivme::nn::rope(&x.to_dtype(DType::F64)?, &cos, &sin)
        .unwrap_err()
        .to_string();
    assert!(e.contains("F64"), "{e}");
    let e = ivme::nn::rope(&x, &cos.to_dtype(DType::BF16)?, &sin)
        .unwrap_err()
        .to_string();
    assert!(e.contains("dtype"), "{e}");
    Ok(())
}
