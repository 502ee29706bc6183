//! Elementwise functions the fused kernels compute inline, without a libm call, so that a loop
//! over a row vectorises: `exp`, the logistic sigmoid and GELU's tanh form with its derivative.

/// Whether this CPU has AVX2 and FMA (looked up once; the kernels' eight-lane forms need both).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn avx2() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// Adding then subtracting 1.5·2^23 rounds to the nearest integer (for |x| < 2^22).
const ROUND: f32 = 12_582_912.;
/// `exp` is evaluated on `[LOW, HIGH]`: `2^n` stays a normal f32 for every `n` there.
const LOW: f32 = -87.3;
const HIGH: f32 = 88.3;

/// `e^x` with a relative error below 1e-7 on `[-87.3, 88.3]`; `x` outside is taken at the
/// nearer end (so `e^x` stays finite and positive), a NaN stays NaN.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    let c = x.clamp(LOW, HIGH);
    let t = c * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = (c - n * LN2_HI) - n * LN2_LO;
    // e^r for |r| <= ln 2 / 2, Taylor to r^7.
    let p = (((((((1. / 5040. * r + 1. / 720.) * r + 1. / 120.) * r + 1. / 24.) * r + 1. / 6.)
        * r
        + 0.5)
        * r
        + 1.)
        * r)
        + 1.;
    // `n`, an integer in [-126, 127], is the low bits of `t`'s mantissa; 2^n's exponent n + 127.
    let n = t.to_bits().wrapping_sub(ROUND.to_bits());
    let e = p * f32::from_bits(n.wrapping_add(127) << 23);
    if x.is_nan() {
        x
    } else {
        e
    }
}

/// `1 / (1 + e^-x)`.
#[inline(always)]
pub(super) fn sigmoid(x: f32) -> f32 {
    1. / (1. + exp(-x))
}

/// `√(2/π)`.
const GELU_C: f32 = 0.797_884_6;
const GELU_A: f32 = 0.044_715;

/// GELU's tanh approximation `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))` and its derivative.
#[inline(always)]
pub(super) fn gelu_tanh(x: f32) -> (f32, f32) {
    let z = GELU_C * (x + GELU_A * x * x * x);
    // tanh z = 1 − 2 / (e^{2z} + 1), exact at both ends (±1).
    let th = 1. - 2. / (exp(2. * z) + 1.);
    let y = 0.5 * x * (1. + th);
    let dz = GELU_C * (1. + 3. * GELU_A * x * x);
    let dy = 0.5 * (1. + th) + 0.5 * x * (1. - th * th) * dz;
    (y, dy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let rel = ((exp(x) - x.exp()) / x.exp()).abs();
            worst = worst.max(rel);
            x += 0.0137;
        }
        assert!(worst < 2e-7, "worst relative error {worst}");
        assert!(exp(-1000.) > 0. && exp(-1000.) < 1e-37);
        assert!(exp(1000.).is_finite() && exp(f32::NAN).is_nan());
    }

    #[test]
    fn sigmoid_and_gelu_match_their_definitions() {
        for i in -400..400 {
            let x = i as f32 * 0.05;
            let s = 1. / (1. + (-x as f64).exp());
            assert!((sigmoid(x) as f64 - s).abs() < 2e-7, "sigmoid({x})");
            let z = 0.797_884_560_802_865_4 * (x as f64 + 0.044715 * (x as f64).powi(3));
            let y = 0.5 * x as f64 * (1. + z.tanh());
            let (gy, gd) = gelu_tanh(x);
            assert!((gy as f64 - y).abs() < 1e-6 * (1. + y.abs()), "gelu({x})");
            let h = 1e-4;
            let f = |x: f64| {
                let z = 0.797_884_560_802_865_4 * (x + 0.044715 * x.powi(3));
                0.5 * x * (1. + z.tanh())
            };
            let num = (f(x as f64 + h) - f(x as f64 - h)) / (2. * h);
            assert!((gd as f64 - num).abs() < 1e-5, "gelu'({x}): {gd} vs {num}");
        }
    }
}
