//! `ivme::nn::attention_bthd` (q, k, v and the output in the projections' `(b, t, heads, d)`
//! layout) against the composed attention on the same tensors transposed: values and the
//! gradients of q, k and v, over grouped queries, causal and sliding windows, soft-capping, an
//! additive mask, more keys than queries, strided inputs (the slices of one fused qkv
//! projection), and bf16/f16 against f32.

use candle_core::{DType, Device, Result, Tensor, Var};
use ivme::nn::{attention_bthd, attention_composed, Attention};

#[path = "nn_support/mod.rs"]
mod nn_support;
use nn_support::{assert_close, tensor};

/// The composed attention on `(b, t, heads, d)` tensors: transposed in, transposed out.
fn composed_bthd(q: &Tensor, k: &Tensor, v: &Tensor, opts: &Attention) -> Result<Tensor> {
    let t = |x: &Tensor| x.transpose(1, 2);
    attention_composed(&t(q)?, &t(k)?, &t(v)?, opts)?.transpose(1, 2)
}

type AttnFn = fn(&Tensor, &Tensor, &Tensor, &Attention) -> Result<Tensor>;

/// The output and the gradients of `Σ out ∘ w` for q, k and v, each `(b, t, heads, d)`;
/// `fused` makes the three from one `(b, t, (hq + 2 hkv) · d)` variable, as a fused qkv
/// projection does (strided rows), else each is a variable of its own.
fn run(
    f: AttnFn,
    [b, hq, hkv, tq, tk, d]: [usize; 6],
    fused: bool,
    dtype: DType,
    opts: &Attention,
) -> Result<(Tensor, Vec<Tensor>)> {
    let var = |shape: &[usize], seed| Var::from_tensor(&tensor(shape, seed)?.to_dtype(dtype)?);
    let (vars, q, k, v) = if fused {
        assert_eq!(tq, tk);
        let all = var(&[b, tq, (hq + 2 * hkv) * d], 1)?;
        let q = all.narrow(2, 0, hq * d)?.reshape((b, tq, hq, d))?;
        let k = all.narrow(2, hq * d, hkv * d)?.reshape((b, tq, hkv, d))?;
        let v = all.narrow(2, (hq + hkv) * d, hkv * d)?;
        let v = v.reshape((b, tq, hkv, d))?;
        (vec![all], q, k, v)
    } else {
        let (q, k, v) = (
            var(&[b, tq, hq, d], 1)?,
            var(&[b, tk, hkv, d], 2)?,
            var(&[b, tk, hkv, d], 3)?,
        );
        let ts = [q.as_tensor(), k.as_tensor(), v.as_tensor()].map(Tensor::clone);
        let [qt, kt, vt] = ts;
        (vec![q, k, v], qt, kt, vt)
    };
    let out = f(&q, &k, &v, opts)?;
    let w = tensor(out.dims(), 9)?;
    let grads = (out.to_dtype(DType::F32)? * w)?.sum_all()?.backward()?;
    let grads = vars
        .iter()
        .map(|v| grads.get(v).cloned().expect("a gradient"))
        .collect();
    Ok((out, grads))
}

fn check(name: &str, dims: [usize; 6], fused: bool, opts: &Attention) -> Result<()> {
    let (out, grads) = run(attention_bthd, dims, fused, DType::F32, opts)?;
    let (want, want_grads) = run(composed_bthd, dims, fused, DType::F32, opts)?;
    let [b, hq, _, tq, _, d] = dims;
    assert_eq!(out.dims(), [b, tq, hq, d], "{name}");
    assert!(
        out.is_contiguous(),
        "{name}: the output is dense in its own layout"
    );
    assert_close(&out, &want, 1e-5, &format!("{name}: output"))?;
    for (i, (g, w)) in grads.iter().zip(&want_grads).enumerate() {
        assert_eq!(g.dims(), w.dims());
        assert_close(g, w, 1e-5, &format!("{name}: gradient {i}"))?;
    }
    Ok(())
}

#[test]
fn matches_composed_attention_transposed() -> Result<()> {
    let mask = {
        // Key 2 of sample 1 is padding.
        let mut m = vec![0f32; 2 * 7];
        m[7 + 2] = f32::NEG_INFINITY;
        Tensor::from_vec(m, (2, 1, 1, 7), &Device::Cpu)?
    };
    let cases: Vec<(&str, [usize; 6], bool, Attention)> = vec![
        ("plain", [2, 3, 3, 5, 5, 4], false, Attention::default()),
        (
            "causal, grouped",
            [2, 4, 2, 7, 7, 8],
            false,
            Attention::causal(),
        ),
        (
            "fused qkv, causal, grouped",
            [2, 4, 2, 7, 7, 8],
            true,
            Attention::causal(),
        ),
        ("more keys", [1, 2, 1, 3, 6, 5], false, Attention::causal()),
        (
            "sliding window, softcap",
            [1, 2, 2, 9, 9, 4],
            false,
            Attention::causal()
                .with_sliding_window(3)
                .with_softcap(2.5)
                .with_scale(0.3),
        ),
        (
            "padding mask",
            [2, 2, 1, 7, 7, 4],
            true,
            Attention::causal().with_mask(mask),
        ),
    ];
    for (name, dims, fused, opts) in &cases {
        check(name, *dims, *fused, opts)?;
    }
    Ok(())
}

#[test]
fn half_precision_is_close_to_f32() -> Result<()> {
    let dims = [2, 4, 2, 9, 9, 8];
    for dtype in [DType::BF16, DType::F16] {
        for fused in [false, true] {
            let opts = Attention::causal();
            let (out, grads) = run(attention_bthd, dims, fused, dtype, &opts)?;
            assert_eq!(out.dtype(), dtype);
            let (want, want_grads) = run(composed_bthd, dims, fused, dtype, &opts)?;
            let tol = if dtype == DType::BF16 { 2e-2 } else { 4e-3 };
            let what = format!("{dtype:?} fused {fused}");
            assert_close(&out, &want, tol, &format!("{what}: output"))?;
            for (i, (g, w)) in grads.iter().zip(&want_grads).enumerate() {
                assert_close(g, w, tol, &format!("{what}: gradient {i}"))?;
            }
        }
    }
    Ok(())
}

#[test]
fn bad_shapes_are_clear_errors() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::zeros((1, 4, 3, 8), DType::F32, &dev)?;
    let k = Tensor::zeros((1, 4, 2, 8), DType::F32, &dev)?;
    let err = attention_bthd(&q, &k, &k, &Attention::causal()).unwrap_err();
    assert!(err.to_string().contains("multiple"), "{err}");
    let flat = Tensor::zeros((4, 3, 8), DType::F32, &dev)?;
    let err = attention_bthd(&flat, &k, &k, &Attention::causal()).unwrap_err();
    assert!(
        err.to_string().contains("(batch, seq, heads, head_dim)"),
        "{err}"
    );
    Ok(())
}
