//! `ivme::nn::attention` (a fused CPU op whose backward recomputes the probabilities) against
//! its composed form, whose gradients come from candle's autograd: values and the gradients of
//! `q`, `k` and `v` over the options and shapes a transformer uses, a finite-difference check,
//! bf16 and f16 against f32, and the errors.

use candle_core::{DType, Device, Result, Tensor, Var};
use ivme::nn::{attention, attention_composed, Attention};

/// Deterministic values in [-1, 1).
fn rand(shape: &[usize], seed: u64) -> Tensor {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let n = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

type AttnFn = fn(&Tensor, &Tensor, &Tensor, &Attention) -> Result<Tensor>;
type Prep<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor, Tensor)>;

/// The output and the gradients of the three base tensors of `loss = Σ out ∘ w`, where
/// `prep` makes q, k, v from the bases.
fn run(
    f: AttnFn,
    bases: &[Tensor; 3],
    prep: Prep,
    opts: &Attention,
    seed: u64,
) -> Result<(Tensor, [Tensor; 3])> {
    let vars = bases
        .iter()
        .map(Var::from_tensor)
        .collect::<Result<Vec<_>>>()?;
    let (q, k, v) = prep(
        vars[0].as_tensor(),
        vars[1].as_tensor(),
        vars[2].as_tensor(),
    )?;
    let out = f(&q, &k, &v, opts)?;
    let w = rand(out.dims(), seed).to_dtype(out.dtype())?;
    let grads = (&out * &w)?.sum_all()?.backward()?;
    let g = |i: usize| grads.get(&vars[i]).cloned().expect("a gradient");
    Ok((out, [g(0), g(1), g(2)]))
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let a = a
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let b = b
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    a.iter()
        .zip(&b)
        .map(|(x, y)| {
            assert!(
                x.is_finite() && y.is_finite(),
                "non-finite value: {x} vs {y}"
            );
            (x - y).abs()
        })
        .fold(0., f32::max)
}

fn no_prep(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    Ok((q.clone(), k.clone(), v.clone()))
}

/// Checks the fused op against the composed one, f32, within 1e-5.
fn check_with(name: &str, bases: [Tensor; 3], prep: Prep, opts: &Attention) {
    let (out, grads) = run(attention, &bases, prep, opts, 7).unwrap();
    let (want, want_grads) = run(attention_composed, &bases, prep, opts, 7).unwrap();
    let diff = max_diff(&out, &want);
    assert!(diff < 1e-5, "{name}: output differs by {diff}");
    for (i, (g, w)) in grads.iter().zip(&want_grads).enumerate() {
        let diff = max_diff(g, w);
        assert!(
            diff < 1e-5,
            "{name}: gradient of {} differs by {diff}",
            ["q", "k", "v"][i]
        );
    }
}

/// `check_with` on fresh q `(b, hq, tq, d)`, k `(b, hkv, tk, d)`, v `(b, hkv, tk, dv)`.
fn check(name: &str, [b, hq, hkv, tq, tk, d, dv]: [usize; 7], opts: &Attention) {
    let bases = [
        rand(&[b, hq, tq, d], 1),
        rand(&[b, hkv, tk, d], 2),
        rand(&[b, hkv, tk, dv], 3),
    ];
    check_with(name, bases, &no_prep, opts);
}

#[test]
fn matches_composed_plain_and_causal() {
    check("plain", [2, 3, 3, 9, 9, 8, 8], &Attention::default());
    check("causal", [2, 3, 3, 9, 9, 8, 8], &Attention::causal());
    check(
        "scaled",
        [1, 2, 2, 6, 6, 4, 4],
        &Attention::causal().with_scale(2.5),
    );
}

#[test]
fn matches_composed_grouped_query() {
    check(
        "gqa 4/2 causal",
        [2, 4, 2, 8, 8, 6, 6],
        &Attention::causal(),
    );
    check("gqa 4/2", [2, 4, 2, 8, 8, 6, 6], &Attention::default());
    // One kv head, one batch: the backward splits the group's query heads between threads.
    check(
        "mqa 4/1 causal",
        [1, 4, 1, 8, 8, 6, 6],
        &Attention::causal(),
    );
    check("mqa 4/1", [2, 4, 1, 5, 8, 6, 6], &Attention::default());
}

#[test]
fn matches_composed_with_fewer_or_more_queries_than_keys() {
    check(
        "tq < tk causal",
        [2, 2, 2, 5, 11, 8, 8],
        &Attention::causal(),
    );
    check("tq < tk", [2, 2, 2, 5, 11, 8, 8], &Attention::default());
    check(
        "tq = 1 causal",
        [2, 4, 2, 1, 11, 8, 8],
        &Attention::causal(),
    );
    // More queries than keys: the first two rows see no key and give zeros.
    let opts = Attention::causal();
    check("tq > tk causal", [1, 2, 1, 6, 4, 8, 8], &opts);
    let out = attention(
        &rand(&[1, 2, 6, 8], 1),
        &rand(&[1, 1, 4, 8], 2),
        &rand(&[1, 1, 4, 8], 3),
        &opts,
    )
    .unwrap()
    .squeeze(0)
    .unwrap()
    .to_vec3::<f32>()
    .unwrap();
    for head in &out {
        assert!(
            head[..2].iter().flatten().all(|&x| x == 0.),
            "rows that see no key are zero"
        );
        assert!(head[2..].iter().flatten().any(|&x| x != 0.));
    }
}

#[test]
fn matches_composed_with_sliding_window() {
    check(
        "window 3",
        [2, 2, 2, 12, 12, 8, 8],
        &Attention::default().with_sliding_window(3),
    );
    check(
        "window 1",
        [1, 2, 2, 6, 6, 4, 4],
        &Attention::default().with_sliding_window(1),
    );
    check(
        "window 4, tq < tk",
        [2, 4, 2, 5, 11, 8, 8],
        &Attention::causal().with_sliding_window(4),
    );
    check(
        "window 40, 3 blocks",
        [1, 2, 1, 150, 150, 4, 3],
        &Attention::default().with_sliding_window(40),
    );
}

#[test]
fn matches_composed_with_softcap() {
    let opts = Attention::causal().with_scale(2.).with_softcap(1.5);
    check("softcap causal", [2, 2, 2, 9, 9, 8, 8], &opts);
    check(
        "softcap gqa",
        [2, 4, 1, 6, 10, 8, 8],
        &Attention::default().with_softcap(0.5),
    );
}

#[test]
fn matches_composed_with_additive_mask() {
    let (b, h, tq, tk) = (2, 4, 6, 9);
    // Random -inf entries and one fully masked row (batch 1, query 2).
    let mut m = rand(&[b, 1, tq, tk], 11)
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    for (i, x) in m.iter_mut().enumerate() {
        if *x > 0.4 || (i / (tq * tk) == 1 && i / tk % tq == 2) {
            *x = f32::NEG_INFINITY;
        }
    }
    let mask = Tensor::from_vec(m, (b, 1, tq, tk), &Device::Cpu).unwrap();
    let shape = [b, h, 2, tq, tk, 8, 8];
    check(
        "mask (b,1,tq,tk)",
        shape,
        &Attention::default().with_mask(mask.clone()),
    );
    check(
        "mask and causal",
        shape,
        &Attention::causal().with_mask(mask.clone()),
    );
    check(
        "mask and softcap",
        shape,
        &Attention::default()
            .with_softcap(1.)
            .with_mask(mask.clone()),
    );
    let q = rand(&[b, h, tq, 8], 1);
    let (k, v) = (rand(&[b, 2, tk, 8], 2), rand(&[b, 2, tk, 8], 3));
    let out = attention(&q, &k, &v, &Attention::default().with_mask(mask)).unwrap();
    let row = out
        .get(1)
        .unwrap()
        .narrow(1, 2, 1)
        .unwrap()
        .flatten_all()
        .unwrap();
    assert!(
        row.to_vec1::<f32>().unwrap().iter().all(|&x| x == 0.),
        "a fully masked row is zero"
    );
    // Other broadcasts: (tq, tk), (1, h, 1, tk) and (h, tq, 1), bf16.
    let m2 = (rand(&[tq, tk], 12) * 3.).unwrap();
    check("mask (tq,tk)", shape, &Attention::causal().with_mask(m2));
    let m3 = rand(&[1, h, 1, tk], 13);
    check(
        "mask (1,h,1,tk)",
        shape,
        &Attention::default().with_mask(m3),
    );
    let m4 = rand(&[h, tq, 1], 14).to_dtype(DType::BF16).unwrap();
    check(
        "mask (h,tq,1) bf16",
        shape,
        &Attention::default().with_mask(m4),
    );
}

#[test]
fn matches_composed_on_odd_sizes() {
    check(
        "t 7, d 5, dv 3",
        [1, 3, 3, 7, 7, 5, 3],
        &Attention::default(),
    );
    check(
        "t 7, d 5, dv 3 causal",
        [2, 2, 1, 7, 7, 5, 3],
        &Attention::causal(),
    );
    check("dv > d", [1, 2, 2, 7, 5, 3, 9], &Attention::default());
    // More than two blocks of queries.
    check(
        "t 130 causal",
        [1, 2, 1, 130, 130, 4, 3],
        &Attention::causal(),
    );
    check(
        "t 130 non-causal",
        [1, 1, 1, 130, 67, 3, 2],
        &Attention::default(),
    );
}

#[test]
fn matches_composed_on_strided_inputs() {
    let (b, t, h, d) = (2, 7, 4, 6);
    // q and k as a transformer makes them: (b, t, h, d) transposed to (b, h, t, d);
    // v a narrowed slice of a wider tensor.
    let bases = [
        rand(&[b, t, h, d], 1),
        rand(&[b, t, 2, d], 2),
        rand(&[b, 2, t, d + 3], 3),
    ];
    let prep = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<(Tensor, Tensor, Tensor)> {
        Ok((q.transpose(1, 2)?, k.transpose(1, 2)?, v.narrow(3, 2, d)?))
    };
    assert!(!prep(&bases[0], &bases[1], &bases[2])
        .unwrap()
        .0
        .is_contiguous());
    check_with("strided", bases.clone(), &prep, &Attention::default());
    check_with(
        "strided causal",
        bases,
        &prep,
        &Attention::causal().with_softcap(2.),
    );
    // k and v with their last two dims swapped in memory (the head_dim is not unit-stride).
    let bases = [
        rand(&[1, 2, 6, 4], 1),
        rand(&[1, 1, 4, 6], 2),
        rand(&[1, 1, 3, 6], 3),
    ];
    let prep = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<(Tensor, Tensor, Tensor)> {
        Ok((q.clone(), k.transpose(2, 3)?, v.transpose(2, 3)?))
    };
    check_with("column-major k, v", bases, &prep, &Attention::causal());
    // A broadcast k (stride 0 over the heads).
    let bases = [
        rand(&[1, 2, 5, 4], 1),
        rand(&[1, 1, 5, 4], 2),
        rand(&[1, 2, 5, 4], 3),
    ];
    let prep = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<(Tensor, Tensor, Tensor)> {
        Ok((q.clone(), k.broadcast_as((1, 2, 5, 4))?, v.clone()))
    };
    check_with("broadcast k", bases, &prep, &Attention::causal());
}

#[test]
fn gradients_match_finite_differences() {
    let dims = [[1, 2, 3, 3], [1, 1, 4, 3], [1, 1, 4, 2]];
    let mask = Tensor::new(&[[0f32, f32::NEG_INFINITY, 0., 0.5]], &Device::Cpu).unwrap();
    let opts = Attention::causal()
        .with_scale(1.5)
        .with_softcap(1.)
        .with_mask(mask);
    let bases = [rand(&dims[0], 21), rand(&dims[1], 22), rand(&dims[2], 23)];
    let (out, grads) = run(attention, &bases, &no_prep, &opts, 5).unwrap();
    let w: Vec<f64> = rand(out.dims(), 5)
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|&x| x as f64)
        .collect();
    let loss = |t: &[Tensor]| -> f64 {
        let out = attention(&t[0], &t[1], &t[2], &opts).unwrap();
        let out = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        out.iter().zip(&w).map(|(&o, w)| o as f64 * w).sum()
    };
    let eps = 4e-3;
    for which in 0..3 {
        let base = bases[which]
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let analytic = grads[which]
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for i in 0..base.len() {
            let at = |delta: f32| {
                let mut x = base.clone();
                x[i] += delta;
                let mut t = bases.to_vec();
                t[which] = Tensor::from_vec(x, &dims[which], &Device::Cpu).unwrap();
                loss(&t)
            };
            let numeric = (at(eps) - at(-eps)) / (2. * eps as f64);
            let diff = (numeric - analytic[i] as f64).abs();
            assert!(
                diff < 1e-3,
                "{}[{i}]: numeric {numeric}, analytic {}",
                ["q", "k", "v"][which],
                analytic[i]
            );
        }
    }
    assert!(
        grads[2]
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            > 0.1
    );
}

#[test]
fn half_precision_is_close_to_f32() {
    let dims = [[2, 4, 9, 8], [2, 2, 9, 8], [2, 2, 9, 8]];
    let opts = Attention::causal().with_softcap(3.);
    for (dtype, tol) in [(DType::BF16, 2e-2f32), (DType::F16, 3e-3)] {
        let half = dims.map(|d| rand(&d, d[1] as u64).to_dtype(dtype).unwrap());
        // The reference sees the same (rounded) inputs in f32.
        let wide = half.clone().map(|t| t.to_dtype(DType::F32).unwrap());
        let (out, grads) = run(attention, &half, &no_prep, &opts, 9).unwrap();
        let (want, want_grads) = run(attention, &wide, &no_prep, &opts, 9).unwrap();
        assert_eq!(out.dtype(), dtype);
        let diff = max_diff(&out, &want);
        assert!(diff < tol, "{dtype:?}: output differs by {diff}");
        for (i, (g, w)) in grads.iter().zip(&want_grads).enumerate() {
            assert_eq!(g.dtype(), dtype);
            let scale = w
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                .max(1.);
            let diff = max_diff(g, w) / scale;
            assert!(
                diff < 2. * tol,
                "{dtype:?}: gradient {i} differs by {diff} (relative)"
            );
        }
    }
}

#[test]
fn half_precision_reads_strided_inputs() {
    // q transposed from (b, t, h, d), k with a non-unit head_dim stride: the widening gathers.
    let (b, t, h, d) = (2, 7, 4, 6);
    for (dtype, tol) in [(DType::BF16, 2e-2f32), (DType::F16, 3e-3)] {
        let q = rand(&[b, t, h, d], 1).to_dtype(dtype).unwrap();
        let k = rand(&[b, 2, d, t], 2).to_dtype(dtype).unwrap();
        let v = rand(&[b, 2, t, d], 3).to_dtype(dtype).unwrap();
        let (q, k) = (q.transpose(1, 2).unwrap(), k.transpose(2, 3).unwrap());
        let f32 = |x: &Tensor| x.to_dtype(DType::F32).unwrap();
        let opts = Attention::causal();
        let out = attention(&q, &k, &v, &opts).unwrap();
        let want = attention(&f32(&q), &f32(&k), &f32(&v), &opts).unwrap();
        let diff = max_diff(&out, &want);
        assert!(diff < tol, "{dtype:?}: output differs by {diff}");
    }
}

#[test]
fn errors_name_the_problem() {
    let t = |d: &[usize]| rand(d, 1);
    let err = |q: Tensor, k: Tensor, v: Tensor, opts: Attention| {
        attention(&q, &k, &v, &opts).unwrap_err().to_string()
    };
    let e = err(
        t(&[1, 2, 4, 8]),
        t(&[1, 2, 4, 6]),
        t(&[1, 2, 4, 6]),
        Attention::default(),
    );
    assert!(
        e.contains("head_dim") && e.contains("[1, 2, 4, 8]") && e.contains("[1, 2, 4, 6]"),
        "{e}"
    );
    let e = err(
        t(&[1, 3, 4, 8]),
        t(&[1, 2, 4, 8]),
        t(&[1, 2, 4, 8]),
        Attention::default(),
    );
    assert!(e.contains("multiple"), "{e}");
    let e = err(
        t(&[1, 2, 4, 8]),
        t(&[1, 2, 5, 8]),
        t(&[1, 2, 4, 8]),
        Attention::default(),
    );
    assert!(e.contains("k [1, 2, 5, 8], v [1, 2, 4, 8]"), "{e}");
    let e = err(
        t(&[2, 4, 8]),
        t(&[2, 4, 8]),
        t(&[2, 4, 8]),
        Attention::default(),
    );
    assert!(e.contains("4-d"), "{e}");
    let f64s = |d: &[usize]| t(d).to_dtype(DType::F64).unwrap();
    let e = err(
        f64s(&[1, 2, 4, 8]),
        f64s(&[1, 2, 4, 8]),
        f64s(&[1, 2, 4, 8]),
        Attention::default(),
    );
    assert!(e.contains("F64"), "{e}");
    let mask = Attention::default().with_mask(t(&[3, 4]));
    let e = err(t(&[1, 2, 4, 8]), t(&[1, 2, 4, 8]), t(&[1, 2, 4, 8]), mask);
    assert!(
        e.contains("[3, 4]") && e.contains("does not broadcast"),
        "{e}"
    );
}

/// The specification as plain loops (f64), for both forms: GQA, t_q < t_k, a window, softcap
/// and an additive mask.
#[test]
fn both_forms_match_plain_loops() {
    let (b, hq, hkv, tq, tk, d, dv, w, cap, scale) = (2, 4, 2, 5, 9, 3, 2, 3, 1.5f64, 0.8f64);
    let [q, k, v] =
        [[b, hq, tq, d], [b, hkv, tk, d], [b, hkv, tk, dv]].map(|s| rand(&s, s[3] as u64));
    let mask = (rand(&[hq, 1, tk], 31) * 2.).unwrap();
    let opts = Attention::default()
        .with_sliding_window(w)
        .with_softcap(cap as f32)
        .with_scale(scale as f32)
        .with_mask(mask.clone());
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (qf, kf, vf, mf) = (flat(&q), flat(&k), flat(&v), flat(&mask));
    let mut want = vec![0f64; b * hq * tq * dv];
    for bi in 0..b {
        for h in 0..hq {
            let g = h / (hq / hkv);
            for i in 0..tq {
                let last = i + tk - tq; // the query's own position among the keys
                let seen: Vec<usize> = (0..tk).filter(|&j| j <= last && j + w > last).collect();
                let score = |j: usize| {
                    let dot: f64 = (0..d)
                        .map(|e| {
                            qf[((bi * hq + h) * tq + i) * d + e] as f64
                                * kf[((bi * hkv + g) * tk + j) * d + e] as f64
                        })
                        .sum();
                    cap * (scale * dot / cap).tanh() + mf[h * tk + j] as f64
                };
                let max = seen.iter().map(|&j| score(j)).fold(f64::MIN, f64::max);
                let total: f64 = seen.iter().map(|&j| (score(j) - max).exp()).sum();
                for e in 0..dv {
                    want[((bi * hq + h) * tq + i) * dv + e] = seen
                        .iter()
                        .map(|&j| {
                            (score(j) - max).exp() / total
                                * vf[((bi * hkv + g) * tk + j) * dv + e] as f64
                        })
                        .sum();
                }
            }
        }
    }
    for f in [attention as AttnFn, attention_composed] {
        let got = flat(&f(&q, &k, &v, &opts).unwrap());
        let diff = got
            .iter()
            .zip(&want)
            .map(|(x, y)| (*x as f64 - y).abs())
            .fold(0., f64::max);
        assert!(diff < 1e-5, "differs from the loops by {diff}");
    }
}
