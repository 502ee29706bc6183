//! Scaled dot-product attention with a backward that recomputes the probabilities.
//!
//! On the CPU [`attention`] is one custom op. Its forward goes over blocks of query rows (in
//! parallel over batch, head and block): the block's scores `scale · q·kᵀ` (only for the keys
//! the causal and window limits leave it), the softcap, the masks and the softmax, one pass per
//! row, then `probs · v`. The graph keeps `q`, `k`, `v` and the output, never the probabilities:
//! the backward recomputes them block by block and forms `dV = Pᵀ·dO`, `dP = dO·Vᵀ`,
//! `dS = P ∘ (dP − rowsum(P ∘ dP))` (through the softcap's `1 − tanh²`), `dQ = scale · dS·K` and
//! `dK = scale · dSᵀ·Q` (`rowsum(P ∘ dP)` is `rowsum(dO ∘ O)` recomputed in f32). Elsewhere the
//! same maths is composed of candle ops ([`attention_composed`]), which record their backward.

mod cpu;
mod exp;
mod layout;
mod matrix;

use std::sync::Arc;

use candle_core::{
    CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor, D,
};

use self::cpu::{Geometry, MaskRows, Plan, View};
use self::layout::swap_heads_and_time_into;
use self::matrix::Kernel;
use super::elem;

const OP: &str = "attention";

/// How [`attention`] masks and scales its scores.
#[derive(Debug, Clone, Default)]
pub struct Attention {
    /// Multiplies `q·kᵀ`; `None` is `1/sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// Each query sees only keys at its own position or before (aligned to the end when the
    /// keys are more than the queries).
    pub causal: bool,
    /// Each query sees at most this many keys back, itself included (Mistral's sliding window).
    /// Implies `causal`.
    pub sliding_window: Option<usize>,
    /// `softcap * tanh(scores / softcap)` before the mask (Gemma 2).
    pub softcap: Option<f32>,
    /// Added to the scores, broadcastable to `(b, h_q, t_q, t_k)`; `-inf` masks. A constant: it
    /// gets no gradient.
    pub mask: Option<Tensor>,
}

impl Attention {
    /// Causal attention with the default scale and no other mask.
    pub fn causal() -> Self {
        Self {
            causal: true,
            ..Self::default()
        }
    }

    /// Sets the factor of `q·kᵀ`.
    pub fn with_scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Limits each query to the `window` keys ending at its own position (causal).
    pub fn with_sliding_window(mut self, window: usize) -> Self {
        self.sliding_window = Some(window);
        self
    }

    /// Caps the scores softly at `±cap` (`cap * tanh(scores / cap)`).
    pub fn with_softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }

    /// Adds `mask` (broadcastable to `(b, h_q, t_q, t_k)`, `-inf` to mask) to the scores.
    pub fn with_mask(mut self, mask: Tensor) -> Self {
        self.mask = Some(mask);
        self
    }
}

/// Attention of `q` `(b, h_q, t_q, d)` over `k` `(b, h_kv, t_k, d)` and `v` `(b, h_kv, t_k, d_v)`.
///
/// Returns `softmax(mask(softcap(scale · q·kᵀ))) · v`, `(b, h_q, t_q, d_v)`, in the inputs'
/// dtype (f32, bf16 or f16; the arithmetic is f32). `h_q` must be a multiple of `h_kv`: query
/// head `i` uses kv head `i / (h_q / h_kv)` (grouped-query attention). A query that sees no key
/// gets zeros. The gradients of `q`, `k` and `v` are recorded (not second derivatives); on the
/// CPU the backward recomputes the probabilities instead of keeping them.
///
/// ```
/// use candle_core::{Device, Var};
/// use ivme::nn::{attention, Attention};
/// # fn main() -> candle_core::Result<()> {
/// let dev = Device::Cpu;
/// let q = Var::randn(0f32, 1., (1, 4, 6, 8), &dev)?; // 4 query heads
/// let k = Var::randn(0f32, 1., (1, 2, 6, 8), &dev)?; // 2 kv heads
/// let v = Var::randn(0f32, 1., (1, 2, 6, 8), &dev)?;
/// let out = attention(&q, &k, &v, &Attention::causal())?;
/// assert_eq!(out.dims(), &[1, 4, 6, 8]);
/// let grads = out.sqr()?.sum_all()?.backward()?;
/// assert_eq!(grads.get(&k).unwrap().dims(), &[1, 2, 6, 8]);
/// # Ok(())
/// # }
/// ```
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: &Attention) -> Result<Tensor> {
    let s = check(q, k, v, opts)?;
    if !q.device().is_cpu() || s.is_empty() {
        return composed(q, k, v, opts, &s);
    }
    let op = AttentionOp {
        plan: Arc::new(plan(s, opts)?),
        bthd: false,
    };
    q.apply_op3(k, v, op)
}

/// [`attention`] over tensors in the projections' own layout: `q` `(b, t_q, h_q, d)`, `k`
/// `(b, t_k, h_kv, d)`, `v` `(b, t_k, h_kv, d_v)`; returns `(b, t_q, h_q, d_v)`, which a
/// reshape to `(b, t_q, h_q · d_v)` turns into the output projection's input without a copy.
///
/// The values and gradients are those of `attention` on the inputs transposed to
/// `(b, heads, t, d)`, transposed back. On the CPU no transposed view enters candle's graph:
/// the op reads its inputs through their strides and writes its output and its inputs'
/// gradients in this layout (candle's backward of a transposed view adds the gradient
/// through a strided, unvectorised pass, and a reshape of the transposed output copies it).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use ivme::nn::{attention, attention_bthd, Attention};
/// # fn main() -> candle_core::Result<()> {
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1., (1, 6, 4, 8), &dev)?; // (b, t, heads, d)
/// let k = Tensor::randn(0f32, 1., (1, 6, 2, 8), &dev)?;
/// let v = Tensor::randn(0f32, 1., (1, 6, 2, 8), &dev)?;
/// let y = attention_bthd(&q, &k, &v, &Attention::causal())?;
/// let t = |x: &Tensor| x.transpose(1, 2);
/// let want = attention(&t(&q)?, &t(&k)?, &t(&v)?, &Attention::causal())?.transpose(1, 2)?;
/// let diff = (y - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-6);
/// # Ok(())
/// # }
/// ```
pub fn attention_bthd(q: &Tensor, k: &Tensor, v: &Tensor, opts: &Attention) -> Result<Tensor> {
    for (x, name) in [(q, "q"), (k, "k"), (v, "v")] {
        if x.rank() != 4 {
            candle_core::bail!(
                "ivme::nn::attention_bthd: {name} must be 4-d (batch, seq, heads, head_dim), got {:?}",
                x.dims()
            )
        }
    }
    let t = |x: &Tensor| x.transpose(1, 2);
    let s = check(&t(q)?, &t(k)?, &t(v)?, opts)?;
    if !q.device().is_cpu() || s.is_empty() {
        return composed(&t(q)?, &t(k)?, &t(v)?, opts, &s)?.transpose(1, 2);
    }
    let op = AttentionOp {
        plan: Arc::new(plan(s, opts)?),
        bthd: true,
    };
    q.apply_op3(k, v, op)
}

/// The CPU kernels' plan of one call: the checked shapes, the scale, and the mask as rows.
fn plan(s: Shapes, opts: &Attention) -> Result<Plan> {
    let mask = match &opts.mask {
        None => None,
        Some(m) => {
            let mut dims = [1usize; 4];
            dims[4 - m.rank()..].copy_from_slice(m.dims());
            let data = m.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
            let data = data.flatten_all()?.to_vec1::<f32>()?;
            Some(MaskRows { data, dims })
        }
    };
    let plan = Plan {
        b: s.b,
        hq: s.hq,
        hkv: s.hkv,
        d: s.d,
        dv: s.dv,
        geo: s.geo,
        scale: s.scale,
        softcap: opts.softcap,
        mask,
    };
    Ok(plan)
}

/// [`attention`] composed of differentiable candle ops (its form on devices other than the
/// CPU, and the reference of the tests).
#[doc(hidden)]
pub fn attention_composed(q: &Tensor, k: &Tensor, v: &Tensor, opts: &Attention) -> Result<Tensor> {
    let s = check(q, k, v, opts)?;
    composed(q, k, v, opts, &s)
}

fn composed(q: &Tensor, k: &Tensor, v: &Tensor, opts: &Attention, s: &Shapes) -> Result<Tensor> {
    let dtype = q.dtype();
    let f32 = |t: &Tensor| t.to_dtype(DType::F32)?.contiguous();
    let rep = s.hq / s.hkv;
    // Each kv head repeated for the query heads of its group.
    let repeat = |t: &Tensor| -> Result<Tensor> {
        let t = f32(t)?;
        if rep == 1 {
            return Ok(t);
        }
        let (b, h, n, e) = t.dims4()?;
        t.unsqueeze(2)?
            .broadcast_as((b, h, rep, n, e))?
            .reshape((b, h * rep, n, e))
    };
    let (q, k, v) = (f32(q)?, repeat(k)?, repeat(v)?);
    let mut scores = q.matmul(&k.t()?)?.affine(s.scale as f64, 0.)?;
    if let Some(cap) = opts.softcap {
        scores = ((scores / cap as f64)?.tanh()? * cap as f64)?;
    }
    if s.geo.causal {
        let (tq, tk) = (s.geo.tq, s.geo.tk);
        let mut m = vec![f32::NEG_INFINITY; tq * tk];
        for i in 0..tq {
            let (lo, hi) = s.geo.visible(i);
            m[i * tk + lo..i * tk + hi].fill(0.);
        }
        scores = scores.broadcast_add(&Tensor::from_vec(m, (tq, tk), q.device())?)?;
    }
    if let Some(m) = &opts.mask {
        let m = m.detach().to_device(q.device())?.to_dtype(DType::F32)?;
        scores = scores.broadcast_add(&m)?;
    }
    // Softmax over the keys, zeros for a row with every key masked (its max is -inf).
    let max = scores
        .max_keepdim(D::Minus1)?
        .detach()
        .clamp(f32::MIN, f32::MAX)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    let sum = (&sum + sum.eq(0f32)?.to_dtype(DType::F32)?)?;
    e.broadcast_div(&sum)?.matmul(&v)?.to_dtype(dtype)
}

/// The checked shapes of one call.
struct Shapes {
    b: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    dv: usize,
    geo: Geometry,
    scale: f32,
}

impl Shapes {
    fn is_empty(&self) -> bool {
        [
            self.b,
            self.hq,
            self.hkv,
            self.d,
            self.dv,
            self.geo.tq,
            self.geo.tk,
        ]
        .contains(&0)
    }
}

fn check(q: &Tensor, k: &Tensor, v: &Tensor, opts: &Attention) -> Result<Shapes> {
    use candle_core::bail;
    let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
    if qd.len() != 4 || kd.len() != 4 || vd.len() != 4 {
        bail!("ivme::nn::{OP}: q, k and v must be 4-d (batch, heads, seq, head_dim), got q {qd:?}, k {kd:?}, v {vd:?}")
    }
    let dtype = q.dtype();
    if k.dtype() != dtype || v.dtype() != dtype {
        bail!(
            "ivme::nn::{OP}: q, k and v must share a dtype, got {dtype:?}, {:?}, {:?}",
            k.dtype(),
            v.dtype()
        )
    }
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(elem::unsupported(OP, dtype));
    }
    if !q.device().same_device(k.device()) || !q.device().same_device(v.device()) {
        bail!(
            "ivme::nn::{OP}: q, k and v must be on one device, got {:?}, {:?}, {:?}",
            q.device(),
            k.device(),
            v.device()
        )
    }
    if kd[0] != qd[0] || vd[0] != qd[0] {
        bail!("ivme::nn::{OP}: q, k and v must have the same batch size, got q {qd:?}, k {kd:?}, v {vd:?}")
    }
    if kd[1] != vd[1] || kd[2] != vd[2] {
        bail!("ivme::nn::{OP}: k and v must have the same heads and length, got k {kd:?}, v {vd:?}")
    }
    if kd[3] != qd[3] {
        bail!("ivme::nn::{OP}: q and k must have the same head_dim, got q {qd:?}, k {kd:?}")
    }
    let (hq, hkv) = (qd[1], kd[1]);
    if hkv == 0 && hq != 0 || hkv != 0 && hq % hkv != 0 {
        bail!("ivme::nn::{OP}: the query heads ({hq}, q {qd:?}) must be a multiple of the key/value heads ({hkv}, k {kd:?})")
    }
    if opts.sliding_window == Some(0) {
        bail!("ivme::nn::{OP}: sliding_window must be at least 1")
    }
    if let Some(cap) = opts.softcap {
        if !(cap > 0. && cap.is_finite()) {
            bail!("ivme::nn::{OP}: softcap must be positive and finite, got {cap}")
        }
    }
    let scores = [qd[0], hq, qd[2], kd[2]];
    if let Some(m) = &opts.mask {
        let md = m.dims();
        let fits = md.len() <= 4
            && md
                .iter()
                .rev()
                .zip(scores.iter().rev())
                .all(|(&m, &s)| m == 1 || m == s);
        if !fits {
            bail!("ivme::nn::{OP}: mask of shape {md:?} does not broadcast to the scores' shape (b, h_q, t_q, t_k) = {scores:?}")
        }
    }
    Ok(Shapes {
        b: qd[0],
        hq,
        hkv,
        d: qd[3],
        dv: vd[3],
        geo: Geometry {
            tq: qd[2],
            tk: kd[2],
            causal: opts.causal || opts.sliding_window.is_some(),
            window: opts.sliding_window,
        },
        scale: opts.scale.unwrap_or(1. / (qd[3] as f32).sqrt()),
    })
}

/// The CPU op: its forward and, through [`AttentionBwd`], its backward.
struct AttentionOp {
    plan: Arc<Plan>,
    /// The tensors are `(b, t, heads, d)` (else `(b, heads, t, d)`).
    bthd: bool,
}

impl AttentionOp {
    /// The kernels' `(b, heads, t, d)` dims of q, k, v and the output.
    fn dims(&self) -> [[usize; 4]; 4] {
        let p = &self.plan;
        let (tq, tk) = (p.geo.tq, p.geo.tk);
        [
            [p.b, p.hq, tq, p.d],
            [p.b, p.hkv, tk, p.d],
            [p.b, p.hkv, tk, p.dv],
            [p.b, p.hq, tq, p.dv],
        ]
    }
}

fn fwd<T: Kernel>(
    op: &AttentionOp,
    q: &[T],
    l1: &Layout,
    k: &[T],
    l2: &Layout,
    v: &[T],
    l3: &Layout,
) -> Result<Vec<T>> {
    let [dq, dk, dv, dout] = op.dims();
    let (l1, l2, l3) = (
        op.heads_first(l1)?,
        op.heads_first(l2)?,
        op.heads_first(l3)?,
    );
    let (q, k, v) = (
        View::new(q, &l1, dq, "q")?,
        View::new(k, &l2, dk, "k")?,
        View::new(v, &l3, dv, "v")?,
    );
    Ok(op.to_own_layout(cpu::forward(&op.plan, q, k, v), dout))
}

fn mismatch(s: &[&CpuStorage]) -> candle_core::Error {
    let dtypes: Vec<DType> = s.iter().map(|s| elem::dtype_of(s)).collect();
    match dtypes
        .iter()
        .find(|d| !matches!(d, DType::F32 | DType::BF16 | DType::F16))
    {
        Some(&d) => elem::unsupported(OP, d),
        None => candle_core::Error::Msg(format!("ivme::nn::{OP}: mixed dtypes {dtypes:?}")),
    }
}

impl CustomOp3 for AttentionOp {
    fn name(&self) -> &'static str {
        "ivme-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        use CpuStorage::{BF16, F16, F32};
        let out = match (s1, s2, s3) {
            (F32(q), F32(k), F32(v)) => F32(fwd(self, q, l1, k, l2, v, l3)?),
            (BF16(q), BF16(k), BF16(v)) => BF16(fwd(self, q, l1, k, l2, v, l3)?),
            (F16(q), F16(k), F16(v)) => F16(fwd(self, q, l1, k, l2, v, l3)?),
            _ => return Err(mismatch(&[s1, s2, s3])),
        };
        Ok((out, self.out_shape()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let bwd = AttentionBwd {
            plan: self.plan.clone(),
            bthd: self.bthd,
            grad: grad.clone(),
        };
        // One storage holds the three gradients, each a view of it.
        let all = q.apply_op3_no_bwd(k, v, &bwd)?;
        let (nq, nk) = (q.elem_count(), k.elem_count());
        let dq = all.narrow(0, 0, nq)?.reshape(q.shape())?;
        let dk = all.narrow(0, nq, nk)?.reshape(k.shape())?;
        let dv = all.narrow(0, nq + nk, v.elem_count())?.reshape(v.shape())?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// The backward of [`AttentionOp`] as an op over `q`, `k`, `v` (read in place) holding the
/// output's gradient; its result is `dq`, `dk`, `dv` flattened one after the other.
struct AttentionBwd {
    plan: Arc<Plan>,
    bthd: bool,
    grad: Tensor,
}

fn bwd<T: Kernel>(
    op: &AttentionOp,
    (q, l1): (&[T], &Layout),
    (k, l2): (&[T], &Layout),
    (v, l3): (&[T], &Layout),
    (g, l4): (&[T], &Layout),
) -> Result<Vec<T>> {
    let [dq, dk, dv, dout] = op.dims();
    let (l1, l2, l3) = (
        op.heads_first(l1)?,
        op.heads_first(l2)?,
        op.heads_first(l3)?,
    );
    let l4 = op.heads_first(l4)?;
    let (q, k, v) = (
        View::new(q, &l1, dq, "q")?,
        View::new(k, &l2, dk, "k")?,
        View::new(v, &l3, dv, "v")?,
    );
    let g = View::new(g, &l4, dout, "the output's gradient")?;
    let n = |d: [usize; 4]| d.iter().product::<usize>();
    let mut all = vec![T::of(0.); n(dq) + n(dk) + n(dv)];
    let (gq, rest) = all.split_at_mut(n(dq));
    let (gk, gv) = rest.split_at_mut(n(dk));
    cpu::backward(&op.plan, [q, k, v, g], gq, gk, gv);
    if !op.bthd {
        return Ok(all);
    }
    // The three gradients in the op's own layout, each swapped straight into one buffer.
    let len = n(dq) + n(dk) + n(dv);
    let mut own = Vec::with_capacity(len);
    let spare = &mut own.spare_capacity_mut()[..len];
    let (sq, rest) = spare.split_at_mut(gq.len());
    let (sk, sv) = rest.split_at_mut(gk.len());
    swap_heads_and_time_into(sq, gq, dq);
    swap_heads_and_time_into(sk, gk, dk);
    swap_heads_and_time_into(sv, gv, dv);
    // SAFETY: the three swaps wrote every element of the three parts, which cover `all.len()`.
    unsafe { own.set_len(len) };
    Ok(own)
}

impl CustomOp3 for AttentionBwd {
    fn name(&self) -> &'static str {
        "ivme-attention-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        use CpuStorage::{BF16, F16, F32};
        let (gs, l4) = self.grad.storage_and_layout();
        let Storage::Cpu(g) = &*gs else {
            candle_core::bail!("ivme::nn::{OP}: the output's gradient is not on the CPU")
        };
        let op = AttentionOp {
            plan: self.plan.clone(),
            bthd: self.bthd,
        };
        let all = match (s1, s2, s3, g) {
            (F32(q), F32(k), F32(v), F32(g)) => F32(bwd(&op, (q, l1), (k, l2), (v, l3), (g, l4))?),
            (BF16(q), BF16(k), BF16(v), BF16(g)) => {
                BF16(bwd(&op, (q, l1), (k, l2), (v, l3), (g, l4))?)
            }
            (F16(q), F16(k), F16(v), F16(g)) => F16(bwd(&op, (q, l1), (k, l2), (v, l3), (g, l4))?),
            _ => return Err(mismatch(&[s1, s2, s3, g])),
        };
        let len = op.dims()[..3]
            .iter()
            .map(|d| d.iter().product::<usize>())
            .sum::<usize>();
        Ok((all, Shape::from(len)))
    }
}
