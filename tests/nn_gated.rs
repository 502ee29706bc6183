//! `ivme::nn::gated`: `act(gate) · up` equal to candle's `silu`/`gelu` times `up` forward and
//! (through autograd) backward, to finite differences, on strided halves of one fused
//! projection as on contiguous inputs, and in bf16/f16 close to f32's.

use candle_core::{DType, Device, Result, Tensor, Var};
use ivme::nn::{gated, gated_composed, GateAct};

#[path = "nn_support/mod.rs"]
mod nn_support;
use nn_support::{assert_close, tensor};

const ACTS: [GateAct; 2] = [GateAct::Silu, GateAct::GeluTanh];
/// Odd widths and row counts, a single row, and a 3-d batch.
const SHAPES: &[&[usize]] = &[&[1, 7], &[3, 13], &[37, 129], &[2, 3, 16], &[5]];

/// How an input is laid out.
#[derive(Debug, Clone, Copy)]
enum Make {
    Plain,
    /// Gate and up the two halves of one `(.., 2w)` tensor, as a fused `gate_up` projection
    /// gives them: rows strided by `2w`.
    FusedHalves,
    /// Transposed: no evenly strided rows (copied first).
    Transposed,
}

/// Gate and up variables and the inputs made of them.
fn inputs(shape: &[usize], make: Make, dtype: DType) -> Result<(Vec<Var>, Tensor, Tensor)> {
    let n = shape.len();
    let var = |shape: &[usize], seed| Var::from_tensor(&tensor(shape, seed)?.to_dtype(dtype)?);
    Ok(match make {
        Make::Plain => {
            let (g, u) = (var(shape, 1)?, var(shape, 2)?);
            let (gt, ut) = (g.as_tensor().clone(), u.as_tensor().clone());
            (vec![g, u], gt, ut)
        }
        Make::FusedHalves => {
            let mut wide = shape.to_vec();
            wide[n - 1] *= 2;
            let w = shape[n - 1];
            let both = var(&wide, 3)?;
            let g = both.narrow(n - 1, 0, w)?;
            let u = both.narrow(n - 1, w, w)?;
            assert!(!g.is_contiguous() || shape.len() == 1 || shape[..n - 1] == [1]);
            (vec![both], g, u)
        }
        Make::Transposed => {
            let mut base = shape.to_vec();
            base.swap(0, n - 1);
            let (g, u) = (var(&base, 4)?, var(&base, 5)?);
            let (gt, ut) = (g.transpose(0, n - 1)?, u.transpose(0, n - 1)?);
            (vec![g, u], gt, ut)
        }
    })
}

/// The output and the gradients of `Σ out · w` for each variable, through `op`.
fn run(
    op: fn(&Tensor, &Tensor, GateAct) -> Result<Tensor>,
    act: GateAct,
    shape: &[usize],
    make: Make,
    dtype: DType,
) -> Result<(Tensor, Vec<Tensor>)> {
    let (vars, g, u) = inputs(shape, make, dtype)?;
    let y = op(&g, &u, act)?;
    let w = tensor(shape, 20)?.to_dtype(dtype)?;
    let grads = (y.to_dtype(DType::F32)? * w.to_dtype(DType::F32)?)?
        .sum_all()?
        .backward()?;
    let grads = vars
        .iter()
        .map(|v| grads.get(v).cloned().expect("a gradient for every input"))
        .collect();
    Ok((y, grads))
}

#[test]
fn values_and_grads_match_candles_ops() -> Result<()> {
    for act in ACTS {
        for shape in SHAPES {
            let makes: &[Make] = if shape.len() == 1 {
                &[Make::Plain, Make::FusedHalves]
            } else {
                &[Make::Plain, Make::FusedHalves, Make::Transposed]
            };
            for &make in makes {
                let what = format!("{act:?} {shape:?} {make:?}");
                let (y, g) = run(gated, act, shape, make, DType::F32)?;
                let (y0, g0) = run(gated_composed, act, shape, make, DType::F32)?;
                assert_eq!(y.dims(), *shape);
                assert!(y.is_contiguous());
                assert_close(&y, &y0, 1e-6, &format!("{what}: value"))?;
                for (i, (a, b)) in g.iter().zip(&g0).enumerate() {
                    assert_close(a, b, 1e-6, &format!("{what}: gradient {i}"))?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn grads_match_finite_differences() -> Result<()> {
    // f64 sums of an f32 op: a central difference with h = 1e-2 is good to ~1e-3.
    let shape = [3, 5];
    let h = 1e-2f32;
    for act in ACTS {
        let (gv, uv) = (tensor(&shape, 1)?, tensor(&shape, 2)?);
        let w = tensor(&shape, 20)?;
        let (g, u) = (Var::from_tensor(&gv)?, Var::from_tensor(&uv)?);
        let grads = (gated(g.as_tensor(), u.as_tensor(), act)? * &w)?
            .sum_all()?
            .backward()?;
        let loss = |g: &Tensor, u: &Tensor| -> Result<f64> {
            Ok((gated(g, u, act)? * &w)?.sum_all()?.to_scalar::<f32>()? as f64)
        };
        for (k, var) in [&g, &u].into_iter().enumerate() {
            let base = [&gv, &uv][k].flatten_all()?.to_vec1::<f32>()?;
            let mut numeric = vec![0f32; base.len()];
            for (j, num) in numeric.iter_mut().enumerate() {
                let at = |delta: f32| -> Result<f64> {
                    let mut v = base.clone();
                    v[j] += delta;
                    let t = Tensor::from_vec(v, &shape, &Device::Cpu)?;
                    if k == 0 {
                        loss(&t, &uv)
                    } else {
                        loss(&gv, &t)
                    }
                };
                *num = ((at(h)? - at(-h)?) / (2. * h as f64)) as f32;
            }
            let numeric = Tensor::from_vec(numeric, &shape, &Device::Cpu)?;
            let analytic = grads.get(var).expect("gradient");
            assert_close(analytic, &numeric, 2e-3, &format!("{act:?} input {k}"))?;
        }
    }
    Ok(())
}

#[test]
fn half_precision_is_close_to_f32() -> Result<()> {
    for act in ACTS {
        for dtype in [DType::BF16, DType::F16] {
            for make in [Make::Plain, Make::FusedHalves] {
                let shape = [37, 129];
                let what = format!("{act:?} {dtype:?} {make:?}");
                let (y, g) = run(gated, act, &shape, make, dtype)?;
                assert_eq!(y.dtype(), dtype);
                // The composed ops on the same rounded inputs, in f32.
                let (vars, gt, ut) = inputs(&shape, make, dtype)?;
                drop(vars);
                let f = |t: &Tensor| t.to_dtype(DType::F32);
                let exact = gated_composed(&f(&gt)?, &f(&ut)?, act)?;
                let tol = if dtype == DType::BF16 { 1e-2 } else { 2e-3 };
                assert_close(&y, &exact, tol, &format!("{what}: value"))?;
                let (_, g32) = run(gated_composed, act, &shape, make, dtype)?;
                for (i, (a, b)) in g.iter().zip(&g32).enumerate() {
                    assert_close(a, b, tol, &format!("{what}: gradient {i}"))?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn nan_and_large_inputs_are_not_hidden() -> Result<()> {
    let g = Tensor::new(&[f32::NAN, 100., -100., 0.], &Device::Cpu)?;
    let u = Tensor::new(&[1f32, 1., 1., f32::NAN], &Device::Cpu)?;
    for act in ACTS {
        let y = gated(&g, &u, act)?.to_vec1::<f32>()?;
        assert!(
            y[0].is_nan() && y[3].is_nan(),
            "{act:?}: NaN must propagate, got {y:?}"
        );
        assert!(
            (y[1] - 100.).abs() < 1e-4,
            "{act:?}: act(100) = 100, got {}",
            y[1]
        );
        assert!(y[2].abs() < 1e-6, "{act:?}: act(-100) = 0, got {}", y[2]);
    }
    Ok(())
}

#[test]
fn bad_inputs_are_clear_errors() -> Result<()> {
    let dev = Device::Cpu;
    let a = Tensor::zeros((2, 3), DType::F32, &dev)?;
    let err = gated(&a, &Tensor::zeros((3, 2), DType::F32, &dev)?, GateAct::Silu).unwrap_err();
    assert!(
        err.to_string().contains("[2, 3]") && err.to_string().contains("[3, 2]"),
        "{err}"
    );
    let err = gated(&a, &a.to_dtype(DType::F16)?, GateAct::Silu).unwrap_err();
    assert!(err.to_string().contains("same dtype"), "{err}");
    let ints = Tensor::zeros((2, 3), DType::U32, &dev)?;
    let err = gated(&ints, &ints, GateAct::Silu).unwrap_err();
    assert!(err.to_string().contains("f32, bf16 or f16"), "{err}");
    Ok(())
}
