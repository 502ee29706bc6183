//! The softmax's row passes: the max of a row, then `exp(x - max)` in place with its sum.
//!
//! `exp` is computed inline, not by libm: `2^n · e^r` with `x = n·ln 2 + r`, `|r| <= ln 2 / 2`,
//! and `e^r` from its Taylor series to `r^7` (relative error below 1e-7). On x86-64 CPUs with
//! AVX2 and FMA eight lanes go at once; elsewhere (and for a row's last few elements) the same
//! maths runs one element at a time.

const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// Adding then subtracting 1.5·2^23 rounds to the nearest integer (for |x| < 2^22).
const ROUND: f32 = 12_582_912.;
/// Below this `exp` is subnormal in f32: such a probability is taken as 0.
const LOW: f32 = -87.;
const C7: f32 = 1. / 5040.;
const C6: f32 = 1. / 720.;
const C5: f32 = 1. / 120.;
const C4: f32 = 1. / 24.;
const C3: f32 = 1. / 6.;

/// The largest element (`-inf` for an empty row or one of `-inf`s; NaNs are skipped).
pub(super) fn max(row: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: the CPU has AVX2 and FMA, the features `x86::max` is compiled for.
        return unsafe { x86::max(row) };
    }
    max_scalar(row)
}

/// Replaces each `x` of `row` (all `<= max`) by `exp(x - max)` and returns their sum.
pub(super) fn exp_sum(row: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: the CPU has AVX2 and FMA, the features `x86::exp_sum` is compiled for.
        return unsafe { x86::exp_sum(row, max) };
    }
    let mut sum = 0.;
    for x in row {
        *x = exp_neg(*x - max);
        sum += *x;
    }
    sum
}

/// `exp(x)` for `x <= 0`: 0 below -87 and for -inf; a NaN stays NaN.
#[inline(always)]
fn exp_neg(x: f32) -> f32 {
    let c = x.max(LOW);
    let t = c * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = (c - n * LN2_HI) - n * LN2_LO;
    let p = ((((((C7 * r + C6) * r + C5) * r + C4) * r + C3) * r + 0.5) * r + 1.) * r + 1.;
    // `n`, an integer in [-126, 0], is the low bits of `t`'s mantissa; 2^n's exponent is n + 127.
    let n = t.to_bits().wrapping_sub(ROUND.to_bits());
    let scaled = p * f32::from_bits(n.wrapping_add(127) << 23);
    if x < LOW {
        0.
    } else if x >= LOW {
        scaled
    } else {
        x
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::*;

    pub(super) fn available() -> bool {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }

    /// The eight lanes.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn lanes(v: __m256) -> [f32; 8] {
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), v);
        out
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn max(row: &[f32]) -> f32 {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut chunks = row.chunks_exact(8);
        for c in &mut chunks {
            // SAFETY: `c` holds 8 f32s; max_ps keeps `m` where the loaded lane is NaN.
            m = _mm256_max_ps(_mm256_loadu_ps(c.as_ptr()), m);
        }
        let tail = max_scalar(chunks.remainder());
        lanes(m)
            .iter()
            .fold(tail, |m, &x| if x > m { x } else { m })
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sum(row: &mut [f32], max: f32) -> f32 {
        let mx = _mm256_set1_ps(max);
        let mut acc = _mm256_setzero_ps();
        let mut chunks = row.chunks_exact_mut(8);
        for c in &mut chunks {
            // SAFETY: `c` holds 8 f32s.
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mx));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
        let mut sum = lanes(acc).iter().sum::<f32>();
        for x in chunks.into_remainder() {
            *x = exp_neg(*x - max);
            sum += *x;
        }
        sum
    }

    /// [`exp_neg`] on eight lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp8(x: __m256) -> __m256 {
        let low = _mm256_set1_ps(LOW);
        let round = _mm256_set1_ps(ROUND);
        let c = _mm256_max_ps(x, low);
        let t = _mm256_fmadd_ps(c, _mm256_set1_ps(std::f32::consts::LOG2_E), round);
        let n = _mm256_sub_ps(t, round);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), c);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        // Written out: at opt-level 1 a loop over the coefficients would stay a loop.
        let p = _mm256_fmadd_ps(_mm256_set1_ps(C7), r, _mm256_set1_ps(C6));
        let p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C5));
        let p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C4));
        let p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C3));
        let p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
        let p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.));
        let p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.));
        let n = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(round));
        let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(n, _mm256_set1_epi32(127)));
        let e = _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
        // 0 below LOW (and for -inf); a NaN lane passes through.
        let low = _mm256_cmp_ps::<_CMP_LT_OQ>(x, low);
        let e = _mm256_andnot_ps(low, e);
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        _mm256_blendv_ps(e, x, nan)
    }
}

/// The largest element, one at a time.
fn max_scalar(row: &[f32]) -> f32 {
    row.iter()
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
}
