//! Vectorisable scalar math used by the kernels: an exp accurate to about 2 ulp that the
//! compiler can auto-vectorise (libm's `expf` is a call per element), and sums with eight
//! independent f64 lanes (a single accumulator serialises on the add latency).

/// The constants of [`exp`], shared with its explicit-SIMD row form so the two cannot drift.
mod exp_consts {
    /// Below this e^x is 0 in f32 (inputs are clamped here first).
    pub const LO: f32 = -104.0;
    /// Above this e^x is +∞ in f32.
    pub const HI: f32 = 88.722_84;
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    /// ln 2 split in two so that n·ln 2 is subtracted without losing bits.
    pub const LN2_HI: f32 = 0.693_359_4;
    pub const LN2_LO: f32 = -2.121_944_4e-4;
    /// 1.5·2²³: adding and subtracting it rounds to the nearest integer.
    pub const ROUND: f32 = 12_582_912.0;
    /// Cephes polynomial for (e^r − 1 − r)/r², highest degree first.
    pub const POLY: [f32; 6] = [
        1.987_569_1e-4,
        1.398_2e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ];
}

/// e^x with ~2 ulp error (Cephes polynomial, range reduction by ln 2); exact 0 below the f32
/// range, +∞ above it, NaN propagated.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    use exp_consts::*;
    let xc = x.clamp(LO, HI);
    // Round to nearest with the 1.5·2²³ trick: `f32::round` is a libm call without SSE4.1.
    let shifted = xc * LOG2E + ROUND;
    let n = shifted - ROUND;
    // The integer n from the same bits (a saturating `as` cast would block vectorisation).
    let n_int = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = POLY[1..].iter().fold(POLY[0], |p, &c| p * r + c);
    let y = p * r * r + r + 1.0;
    // 2ⁿ in two normal factors so that results near both ends of the range (including
    // subnormals) come out right.
    let n = n_int;
    let half = n >> 1;
    let s1 = f32::from_bits(((half + 127) as u32) << 23);
    let s2 = f32::from_bits(((n - half + 127) as u32) << 23);
    let v = y * s1 * s2;
    // Selects rather than a branch chain, so loops over rows vectorise.
    let v = if x < LO { 0.0 } else { v };
    let v = if x > HI { f32::INFINITY } else { v };
    if x.is_nan() {
        x
    } else {
        v
    }
}

/// `x[i] = e^(x[i] − shift)` over a row: [`exp`] in explicit AVX2/FMA when the CPU has them
/// (8 lanes, fused multiply-adds, constants kept in registers — the auto-vectorised [`exp`]
/// reloads its constants and cannot fuse, and SOFT_MAX spent half its time there), else the
/// scalar [`exp`] per element. The two agree to about 1 ulp (fused vs separate rounding).
pub fn exp_sub_row(x: &mut [f32], shift: f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::get().avx2_fma() {
        // SAFETY: AVX2 and FMA were detected at run time.
        unsafe { exp_sub_row_avx2(x, shift) };
        return;
    }
    x.iter_mut().for_each(|v| *v = exp(*v - shift));
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sub_row_avx2(x: &mut [f32], shift: f32) {
    use exp_consts::*;
    use std::arch::x86_64::*;
    let lo = _mm256_set1_ps(LO);
    let hi = _mm256_set1_ps(HI);
    let log2e = _mm256_set1_ps(LOG2E);
    let round = _mm256_set1_ps(ROUND);
    let round_bits = _mm256_set1_epi32(ROUND.to_bits() as i32);
    let ln2_hi = _mm256_set1_ps(LN2_HI);
    let ln2_lo = _mm256_set1_ps(LN2_LO);
    let c = POLY.map(|k| _mm256_set1_ps(k));
    let one = _mm256_set1_ps(1.0);
    let bias = _mm256_set1_epi32(127);
    let sh = _mm256_set1_ps(shift);
    let mut chunks = x.chunks_exact_mut(8);
    for chunk in &mut chunks {
        // SAFETY: the chunk holds 8 floats.
        let v = _mm256_sub_ps(unsafe { _mm256_loadu_ps(chunk.as_ptr()) }, sh);
        // max/min return their second operand for NaN: NaN lanes are fixed at the end.
        let xc = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
        let shifted = _mm256_fmadd_ps(xc, log2e, round);
        let n = _mm256_sub_ps(shifted, round);
        let n_int = _mm256_sub_epi32(_mm256_castps_si256(shifted), round_bits);
        let r = _mm256_fnmadd_ps(n, ln2_lo, _mm256_fnmadd_ps(n, ln2_hi, xc));
        let mut p = c[0];
        for &ck in &c[1..] {
            p = _mm256_fmadd_ps(p, r, ck);
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), one);
        // 2ⁿ as two normal factors (see `exp`).
        let half = _mm256_srai_epi32::<1>(n_int);
        let s1 = _mm256_slli_epi32::<23>(_mm256_add_epi32(half, bias));
        let s2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_sub_epi32(n_int, half), bias));
        let mut e = _mm256_mul_ps(
            _mm256_mul_ps(y, _mm256_castsi256_ps(s1)),
            _mm256_castsi256_ps(s2),
        );
        e = _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LT_OQ>(v, lo));
        e = _mm256_blendv_ps(
            e,
            _mm256_set1_ps(f32::INFINITY),
            _mm256_cmp_ps::<_CMP_GT_OQ>(v, hi),
        );
        e = _mm256_blendv_ps(e, v, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
        // SAFETY: the chunk holds 8 floats.
        unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), e) };
    }
    for v in chunks.into_remainder() {
        *v = exp(*v - shift);
    }
}

/// e^x for 16 lanes in AVX-512F: the polynomial of [`exp`], with the power of two applied by
/// `vscalefps` (which handles overflow to +∞ and underflow to 0 itself). Inputs are clamped to
/// [−110, 89] first (NaN kept), so −∞ gives exactly 0 and +∞ gives +∞. Agrees with [`exp`] to
/// about 1 ulp (fused vs separate rounding) wherever the result is a normal float.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn exp_avx512(v: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use exp_consts::*;
    use std::arch::x86_64::*;
    // max/min return their second operand when one is NaN: NaN lanes pass through.
    let xc = _mm512_min_ps(
        _mm512_set1_ps(89.0),
        _mm512_max_ps(_mm512_set1_ps(-110.0), v),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)),
    );
    let r = _mm512_fnmadd_ps(
        n,
        _mm512_set1_ps(LN2_LO),
        _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc),
    );
    let mut p = _mm512_set1_ps(POLY[0]);
    for &ck in &POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ck));
    }
    let y = _mm512_add_ps(
        _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r),
        _mm512_set1_ps(1.0),
    );
    _mm512_scalef_ps(y, n)
}

/// The mask of the first `min(n, 16)` lanes of a 16-lane vector (an AVX-512 `__mmask16`): the
/// lanes a loop over `n` remaining elements may touch.
#[inline(always)]
pub(crate) fn lanes16(n: usize) -> u16 {
    if n >= 16 {
        u16::MAX
    } else {
        (1u16 << n) - 1
    }
}

/// `x[i] = e^(x[i] − shift)` over a row with [`exp_avx512`]; returns Σx (f32, 16 lanes added
/// in a fixed order).
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn exp_sub_sum_avx512(x: &mut [f32], shift: f32) -> f32 {
    use std::arch::x86_64::*;
    let sh = _mm512_set1_ps(shift);
    let mut sum = _mm512_setzero_ps();
    let n = x.len();
    let mut i = 0;
    while i < n {
        let left = n - i;
        let m = lanes16(left);
        // SAFETY: lanes of `m` are elements i..min(i + 16, n) of the row; masked lanes are
        // neither read nor written.
        unsafe {
            let p = x.as_mut_ptr().add(i);
            let e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p), sh));
            let e = _mm512_maskz_mov_ps(m, e);
            sum = _mm512_add_ps(sum, e);
            _mm512_mask_storeu_ps(p, m, e);
        }
        i += 16;
    }
    _mm512_reduce_add_ps(sum)
}

/// `x = x·scale + slope·mask` over `n` floats (one fused multiply-add for the mask) in
/// AVX-512F; returns the largest result (−∞ for an empty row).
///
/// # Safety
/// AVX-512F; `x` (and the mask, when given) hold `n` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn scale_mask_max_avx512(
    x: *mut f32,
    n: usize,
    scale: f32,
    mask: Option<(*const f32, f32)>,
) -> f32 {
    use std::arch::x86_64::*;
    let sc = _mm512_set1_ps(scale);
    let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < n {
        let left = n - i;
        let m = lanes16(left);
        // SAFETY: unmasked lanes are elements i..min(i + 16, n) (caller).
        unsafe {
            let p = x.add(i);
            let mut v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p), sc);
            if let Some((mp, slope)) = mask {
                let mv = _mm512_maskz_loadu_ps(m, mp.add(i));
                v = _mm512_fmadd_ps(_mm512_set1_ps(slope), mv, v);
            }
            mx = _mm512_mask_max_ps(mx, m, mx, v);
            _mm512_mask_storeu_ps(p, m, v);
        }
        i += 16;
    }
    _mm512_reduce_max_ps(mx)
}

/// σ(x) = 1 / (1 + e⁻ˣ).
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// tanh through exp: 1 − 2/(e²ˣ + 1) (absolute error ~1e-7; used inside GELU only).
#[inline(always)]
pub fn tanh_via_exp(x: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * x) + 1.0)
}

/// The largest element (−∞ for an empty slice; NaN elements are ignored), with eight lanes so
/// that it vectorises.
#[inline(always)]
pub fn max_f32(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for k in 0..8 {
            lanes[k] = if c[k] > lanes[k] { c[k] } else { lanes[k] };
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    lanes.iter().fold(tail, |a, &v| a.max(v))
}

/// Σx in f64 with eight lanes.
#[inline(always)]
pub fn sum_f64(x: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for k in 0..8 {
            lanes[k] += c[k] as f64;
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&v| v as f64).sum();
    lanes.iter().sum::<f64>() + tail
}

/// Σ(x − shift)² in f64 with eight lanes.
#[inline(always)]
pub fn sum_sq_f64(x: &[f32], shift: f32) -> f64 {
    let mut lanes = [0f64; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for k in 0..8 {
            let d = (c[k] - shift) as f64;
            lanes[k] += d * d;
        }
    }
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&v| ((v - shift) as f64) * ((v - shift) as f64))
        .sum();
    lanes.iter().sum::<f64>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_row_matches_scalar_exp_everywhere() {
        let mut specials = vec![
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            88.0,
            88.72,
            88.8,
            -87.0,
            -103.9,
            -104.1,
            -200.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        specials.extend((0..2000).map(|i| -110.0 + i as f32 * 0.1));
        for shift in [0.0f32, 3.5, -2.0] {
            let mut row = specials.clone();
            exp_sub_row(&mut row, shift);
            for (&x, &got) in specials.iter().zip(&row) {
                let want = exp(x - shift);
                if want.is_nan() {
                    assert!(got.is_nan(), "exp({x} - {shift}) = {got}, want NaN");
                } else {
                    let tol = want.abs() * 2.5e-7 + f32::MIN_POSITIVE;
                    assert!(
                        got == want || (got - want).abs() <= tol,
                        "exp({x} - {shift}) = {got}, scalar {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn exp_is_accurate_over_the_f32_range() {
        let mut x = -110.0f32;
        let mut worst = 0f64;
        while x < 90.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            if want > 1.2e-38 && want < f32::MAX as f64 {
                worst = worst.max(((got - want) / want).abs());
            } else if want < f32::MAX as f64 {
                assert!((got - want).abs() < 1.5e-45, "x={x}: {got:e} vs {want:e}");
            }
            x += 0.0137;
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn exp_avx512_matches_scalar_exp_everywhere() {
        #[cfg(target_arch = "x86_64")]
        if crate::isa::get().avx512f() {
            let mut xs = vec![
                0.0f32, -0.0, 1.0, -1.0, 88.0, 88.72, 88.8, 89.5, -87.0, -103.9,
            ];
            xs.extend([-104.1, -200.0, f32::INFINITY, f32::NEG_INFINITY]);
            xs.extend((0..2000).map(|i| -110.0 + i as f32 * 0.1));
            for shift in [0.0f32, 3.5, -2.0] {
                let mut row = xs.clone();
                // SAFETY: AVX-512F detected above.
                let sum = unsafe { exp_sub_sum_avx512(&mut row, shift) };
                let mut want_sum = 0f64;
                for (&x, &got) in xs.iter().zip(&row) {
                    let want = exp(x - shift);
                    want_sum += want as f64;
                    // Relative 2.5e-7 where normal; below that both are within 2 subnormal
                    // steps of e^x.
                    let tol = want.abs() * 2.5e-7 + 3.0 * 1.4e-45;
                    assert!(
                        got == want || (got - want).abs() <= tol,
                        "exp({x} - {shift}) = {got}, scalar {want}"
                    );
                }
                if want_sum.is_finite() {
                    assert!(((sum as f64) - want_sum).abs() <= want_sum * 1e-6);
                } else {
                    assert_eq!(sum, f32::INFINITY);
                }
                let mut nan = [f32::NAN, 1.0, 2.0];
                // SAFETY: as above.
                let s = unsafe { exp_sub_sum_avx512(&mut nan, shift) };
                assert!(nan[0].is_nan() && s.is_nan());
                assert_eq!(exp(f32::NEG_INFINITY), 0.0);
            }
        }
    }

    #[test]
    fn lane_sums() {
        let x: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        let s: f64 = x.iter().map(|&v| v as f64).sum();
        assert!((sum_f64(&x) - s).abs() < 1e-9);
        let q: f64 = x.iter().map(|&v| ((v - 1.0) as f64).powi(2)).sum();
        assert!((sum_sq_f64(&x, 1.0) - q).abs() < 1e-9);
    }
}
