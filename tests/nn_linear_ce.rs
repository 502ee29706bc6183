//! `ivme::nn::linear_cross_entropy`: the head and the loss in chunks, equal in value and in
//! the gradients of `x` and `W` to `cross_entropy(linear(x, W))` (candle's autograd through
//! the two ops), with ignored rows, more rows than one chunk holds, strided `x`, bf16/f16, a
//! loss gradient other than 1, and clear errors.

use candle_core::{DType, Device, Result, Tensor, Var};
use ivme::nn::{cross_entropy, linear, linear_cross_entropy};

#[path = "nn_support/mod.rs"]
mod nn_support;
use nn_support::{assert_close, tensor};

const IGNORE: i64 = -100;

/// Labels for `n` rows of `classes`, every fifth ignored.
fn labels(n: usize, classes: usize) -> Tensor {
    let l: Vec<i64> = (0..n)
        .map(|i| {
            if i % 5 == 3 {
                IGNORE
            } else {
                ((i * 7919) % classes) as i64
            }
        })
        .collect();
    Tensor::from_vec(l, n, &Device::Cpu).unwrap()
}

/// The loss and the gradients of `factor · loss` for x's variable and W, through `fused` or
/// the two ops.
fn run(
    fused: bool,
    (n, k, c): (usize, usize, usize),
    strided: bool,
    dtype: DType,
    factor: f64,
) -> Result<(f32, Tensor, Tensor)> {
    let base = if strided { k + 3 } else { k };
    let xv = Var::from_tensor(&tensor(&[n, base], 1)?.to_dtype(dtype)?)?;
    let x = if strided {
        xv.narrow(1, 1, k)?
    } else {
        xv.as_tensor().clone()
    };
    let w = Var::from_tensor(&(tensor(&[c, k], 2)? * 0.5)?.to_dtype(dtype)?)?;
    let y = labels(n, c);
    let loss = if fused {
        linear_cross_entropy(&x, w.as_tensor(), &y, IGNORE)?
    } else {
        cross_entropy(&linear(&x, w.as_tensor(), None)?, &y, IGNORE)?
    };
    let g = (&loss * factor)?.backward()?;
    let gx = g.get(&xv).cloned().expect("dx");
    let gw = g.get(&w).cloned().expect("dW");
    Ok((loss.to_scalar::<f32>()?, gx, gw))
}

#[test]
fn matches_the_head_then_the_loss() -> Result<()> {
    // (rows, in, classes): one chunk; several (1 M logits a chunk: 5000 classes → 209 rows);
    // a single row; a class count of 1.
    for dims in [(9, 7, 11), (700, 16, 5000), (1, 4, 3), (6, 5, 1)] {
        for strided in [false, true] {
            for factor in [1.0, 0.25] {
                let what = format!("{dims:?} strided {strided} factor {factor}");
                let (l, gx, gw) = run(true, dims, strided, DType::F32, factor)?;
                let (l0, gx0, gw0) = run(false, dims, strided, DType::F32, factor)?;
                assert!(
                    (l - l0).abs() <= 1e-5 * l0.abs().max(1.),
                    "{what}: loss {l} vs {l0}"
                );
                assert_close(&gx, &gx0, 1e-5, &format!("{what}: dx"))?;
                assert_close(&gw, &gw0, 1e-5, &format!("{what}: dW"))?;
            }
        }
    }
    Ok(())
}

#[test]
fn half_precision_is_close_to_the_two_ops() -> Result<()> {
    for dtype in [DType::BF16, DType::F16] {
        let (l, gx, gw) = run(true, (300, 24, 4000), false, dtype, 1.0)?;
        let (l0, gx0, gw0) = run(false, (300, 24, 4000), false, dtype, 1.0)?;
        assert_eq!((gx.dtype(), gw.dtype()), (dtype, dtype));
        assert!((l - l0).abs() < 1e-2 * l0.abs(), "{dtype:?}: {l} vs {l0}");
        // The two ops round the logits and their gradient to 16 bits; the fused op keeps f32.
        assert_close(&gx, &gx0, 3e-2, &format!("{dtype:?}: dx"))?;
        assert_close(&gw, &gw0, 3e-2, &format!("{dtype:?}: dW"))?;
    }
    Ok(())
}

#[test]
fn every_row_ignored_is_a_zero_loss_and_zero_gradients() -> Result<()> {
    let x = Var::from_tensor(&tensor(&[4, 3], 1)?)?;
    let w = Var::from_tensor(&tensor(&[5, 3], 2)?)?;
    let y = Tensor::from_vec(vec![IGNORE; 4], 4, &Device::Cpu)?;
    let loss = linear_cross_entropy(x.as_tensor(), w.as_tensor(), &y, IGNORE)?;
    assert_eq!(loss.to_scalar::<f32>()?, 0.);
    let g = loss.backward()?;
    for t in [g.get(&x).unwrap(), g.get(&w).unwrap()] {
        assert_eq!(t.abs()?.max_all()?.to_scalar::<f32>()?, 0.);
    }
    Ok(())
}

#[test]
fn bad_inputs_are_clear_errors() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::zeros((3, 4), DType::F32, &dev)?;
    let w = Tensor::zeros((5, 4), DType::F32, &dev)?;
    let err = linear_cross_entropy(&x, &w, &Tensor::new(&[0i64, 5, 1], &dev)?, IGNORE).unwrap_err();
    assert!(err.to_string().contains("label 5 at row 1"), "{err}");
    let err = linear_cross_entropy(&x, &w, &Tensor::new(&[0i64, 1], &dev)?, IGNORE).unwrap_err();
    assert!(err.to_string().contains("2 labels for 3 rows"), "{err}");
    let w3 = Tensor::zeros((5, 3), DType::F32, &dev)?;
    let err =
        linear_cross_entropy(&x, &w3, &Tensor::new(&[0i64, 1, 2], &dev)?, IGNORE).unwrap_err();
    assert!(err.to_string().contains("input size 3"), "{err}");
    Ok(())
}

/// A tiny Llama: its loss through `head_loss` (the fused head and loss) equals the loss of its
/// logits, and so do the gradients of every weight; `causal_lm_loss` equals
/// `models::causal_lm_loss` of the logits.
#[test]
fn a_llamas_head_loss_is_the_loss_of_its_logits() -> Result<()> {
    use candle_nn::{VarBuilder, VarMap};
    use ivme::models::llama::{Flavor, Llama, LlamaConfig};
    use ivme::models::{causal_lm_loss, CausalLm, IGNORE_INDEX};
    let cfg = LlamaConfig {
        flavor: Flavor::Llama,
        vocab_size: 300,
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 16,
        tie_word_embeddings: false,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        sliding_window: None,
        fused: false,
    };
    let varmap = VarMap::new();
    let model = Llama::new(
        &cfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )?;
    let ids: Vec<u32> = (0..2 * 9).map(|i| (i * 37 % 300) as u32).collect();
    let ids = Tensor::from_vec(ids, (2, 9), &Device::Cpu)?;
    let mut labels: Vec<i64> = (0..2 * 9).map(|i| (i * 53 % 300) as i64).collect();
    labels[4] = IGNORE_INDEX;
    let labels = Tensor::from_vec(labels, (2, 9), &Device::Cpu)?;
    let vars = varmap.all_vars();
    let grads_of = |loss: &Tensor| -> Result<Vec<Tensor>> {
        let g = loss.backward()?;
        Ok(vars
            .iter()
            .map(|v| g.get(v).cloned().expect("every weight"))
            .collect())
    };
    let fused = model.head_loss(&model.hidden(&ids, None)?, &labels, IGNORE_INDEX)?;
    let logits = model.logits(&ids, None)?;
    let plain = cross_entropy(
        &logits.reshape((18, 300))?,
        &labels.flatten_all()?,
        IGNORE_INDEX,
    )?;
    let (a, b) = (fused.to_scalar::<f32>()?, plain.to_scalar::<f32>()?);
    assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    for (i, (g, g0)) in grads_of(&fused)?.iter().zip(grads_of(&plain)?).enumerate() {
        assert_close(g, &g0, 1e-5, &format!("variable {i}"))?;
    }
    let shifted = model.causal_lm_loss(&ids, None, &labels, IGNORE_INDEX)?;
    let want = causal_lm_loss(&logits, &labels, IGNORE_INDEX)?;
    let (a, b) = (shifted.to_scalar::<f32>()?, want.to_scalar::<f32>()?);
    assert!((a - b).abs() < 1e-5, "causal: {a} vs {b}");
    Ok(())
}
