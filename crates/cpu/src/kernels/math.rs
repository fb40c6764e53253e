//! Vectorisable scalar math used by the kernels: an exp accurate to about 2 ulp that the
//! compiler can auto-vectorise (libm's `expf` is a call per element), and sums with eight
//! independent f64 lanes (a single accumulator serialises on the add latency).

#[cfg(target_arch = "x86_64")]
use super::simd::{reduce_add, Simd};

/// The constants of [`exp`], shared with its explicit-SIMD form so the two cannot drift.
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

/// `x[i] = e^(x[i] − shift)` over a row, with the best vector ISA the CPU has ([`exp_v`]:
/// fused multiply-adds, constants kept in registers — the auto-vectorised [`exp`] reloads its
/// constants and cannot fuse, and SOFT_MAX spent half its time there), else the scalar [`exp`]
/// per element. Every ISA gives the same bits (the kernel is lane-wise, tails included); they
/// agree with [`exp`] to about 1 ulp (fused vs separate rounding).
pub fn exp_sub_row(x: &mut [f32], shift: f32) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::simd::{Avx2, Avx512};
        if let Some(t) = Avx512::new() {
            // SAFETY: the token proves AVX-512F.
            unsafe { simd_entry::exp_sub_sum_avx512(t, x, shift) };
            return;
        }
        if let Some(t) = Avx2::new() {
            // SAFETY: the token proves AVX2 and FMA.
            unsafe { simd_entry::exp_sub_sum_avx2(t, x, shift) };
            return;
        }
    }
    x.iter_mut().for_each(|v| *v = exp(*v - shift));
}

/// e^x per lane: [`exp`]'s polynomial and range reduction with fused multiply-adds, and the
/// power of two applied by [`Simd::ldexp`]. Inputs are clamped to [−110, 89] first (NaN kept),
/// which is already past both ends of the f32 range, so no selects are needed: −∞ gives exactly
/// 0, +∞ gives +∞, and NaN propagates through the arithmetic.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn exp_v<S: Simd>(s: S, v: S::V) -> S::V {
    use exp_consts::*;
    // `min`/`max` return their second operand when one is NaN: NaN lanes pass through.
    let xc = s.min(s.splat(89.0), s.max(s.splat(-110.0), v));
    // n = round(x·log₂e) by the 1.5·2²³ trick, one fused rounding.
    let n = s.sub(s.fma(xc, s.splat(LOG2E), s.splat(ROUND)), s.splat(ROUND));
    let r = s.fma(n, s.splat(-LN2_LO), s.fma(n, s.splat(-LN2_HI), xc));
    let mut p = s.splat(POLY[0]);
    for &c in &POLY[1..] {
        p = s.fma(p, r, s.splat(c));
    }
    let y = s.add(s.fma(s.mul(p, r), r, r), s.splat(1.0));
    s.ldexp(y, n)
}

/// `x[i] = e^(x[i] − shift)` over a row with [`exp_v`]; returns Σx, summed per lane and then
/// across lanes in a fixed order.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn exp_sub_sum<S: Simd>(s: S, x: &mut [f32], shift: f32) -> f32 {
    let sh = s.splat(shift);
    let mut sum = s.zero();
    let mut chunks = x.chunks_exact_mut(S::LANES);
    for chunk in &mut chunks {
        // SAFETY: the chunk holds LANES floats.
        unsafe {
            let e = exp_v(s, s.sub(s.loadu(chunk.as_ptr()), sh));
            s.storeu(chunk.as_mut_ptr(), e);
            sum = s.add(sum, e);
        }
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let n = tail.len();
        // SAFETY: the tail holds n < LANES floats; the partial forms touch only those.
        unsafe {
            let e = exp_v(s, s.sub(s.load_partial(tail.as_ptr(), n), sh));
            s.store_partial(tail.as_mut_ptr(), e, n);
            sum = s.add(sum, s.keep_first(e, n, 0.0));
        }
    }
    reduce_add(s, sum)
}

/// `x = x·scale + slope·mask` (one fused multiply-add for the mask) over a row; returns the
/// largest result (−∞ for an empty row).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn scale_mask_max<S: Simd>(
    s: S,
    x: &mut [f32],
    scale: f32,
    mask: Option<(&[f32], f32)>,
) -> f32 {
    if let Some((m, _)) = mask {
        assert!(m.len() >= x.len(), "mask row shorter than the scores");
    }
    let (sc, n) = (s.splat(scale), x.len());
    let mut mx = s.splat(f32::NEG_INFINITY);
    let mut i = 0;
    while i < n {
        let left = n - i;
        // SAFETY: elements i..min(i + LANES, n) of the row (and of the mask, asserted at least
        // as long) are the ones the partial forms touch.
        unsafe {
            let p = x.as_mut_ptr().add(i);
            let mut v = s.mul(s.load_partial(p, left), sc);
            if let Some((m, slope)) = mask {
                v = s.fma(s.splat(slope), s.load_partial(m.as_ptr().add(i), left), v);
            }
            mx = s.max(mx, s.keep_first(v, left, f32::NEG_INFINITY));
            s.store_partial(p, v, left);
        }
        i += S::LANES;
    }
    s.reduce_max(mx)
}

/// Each ISA's compiled copy of the generic row kernels: one `#[target_feature]` entry point per
/// ISA, so the generic body and its inlined methods get the ISA's instructions.
#[cfg(target_arch = "x86_64")]
pub(crate) mod simd_entry {
    use super::super::simd::{Avx2, Avx512};

    /// [`super::exp_sub_sum`] with AVX2 and FMA.
    ///
    /// # Safety
    /// None beyond the token, which proves the features (`target_feature` makes it unsafe).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp_sub_sum_avx2(t: Avx2, x: &mut [f32], shift: f32) -> f32 {
        super::exp_sub_sum(t, x, shift)
    }

    /// [`super::exp_sub_sum`] with AVX-512F.
    ///
    /// # Safety
    /// As [`exp_sub_sum_avx2`].
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn exp_sub_sum_avx512(t: Avx512, x: &mut [f32], shift: f32) -> f32 {
        super::exp_sub_sum(t, x, shift)
    }

    /// [`super::scale_mask_max`] with AVX2 and FMA.
    ///
    /// # Safety
    /// As [`exp_sub_sum_avx2`].
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn scale_mask_max_avx2(
        t: Avx2,
        x: &mut [f32],
        scale: f32,
        mask: Option<(&[f32], f32)>,
    ) -> f32 {
        super::scale_mask_max(t, x, scale, mask)
    }

    /// [`super::scale_mask_max`] with AVX-512F.
    ///
    /// # Safety
    /// As [`exp_sub_sum_avx2`].
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn scale_mask_max_avx512(
        t: Avx512,
        x: &mut [f32],
        scale: f32,
        mask: Option<(&[f32], f32)>,
    ) -> f32 {
        super::scale_mask_max(t, x, scale, mask)
    }
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

    /// The inputs of the row tests: specials, both ends of the range, and a sweep.
    fn exp_inputs() -> Vec<f32> {
        let mut xs = vec![
            0.0f32, -0.0, 1.0, -1.0, 88.0, 88.72, 88.8, 89.5, -87.0, -103.9, -104.1, -200.0,
        ];
        xs.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
        xs.extend((0..2000).map(|i| -110.0 + i as f32 * 0.1));
        xs
    }

    /// The mask row the scale/mask kernel is tested with.
    fn row_mask(n: usize) -> Vec<f32> {
        (0..n).map(|i| -(i as f32 % 7.0) * 0.25).collect()
    }

    /// Runs the generic row kernels with `s` on `xs` (every prefix length up to 40, so each
    /// tail length is seen) and returns the exp rows, their sums and the scale/mask rows with
    /// their maxima.
    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::type_complexity)]
    fn run_rows<S: Simd>(s: S, xs: &[f32], shift: f32) -> Vec<(Vec<f32>, f32, Vec<f32>, f32)> {
        let mask = row_mask(xs.len());
        (0..40)
            .chain([xs.len()])
            .map(|n| {
                let mut e = xs[..n].to_vec();
                let sum = exp_sub_sum(s, &mut e, shift);
                let mut m = xs[..n].to_vec();
                let mx = scale_mask_max(s, &mut m, 0.37, Some((&mask[..n], 1.5)));
                (e, sum, m, mx)
            })
            .collect()
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn simd_rows_match_scalar_and_agree_across_isas_bit_for_bit() {
        use super::super::simd::{tests::Emu16, Avx2, Avx512};
        let Some(avx2) = Avx2::new() else { return };
        let xs = exp_inputs();
        let mask = row_mask(xs.len());
        for shift in [0.0f32, 3.5, -2.0] {
            let a = run_rows(avx2, &xs, shift);
            let e16 = run_rows(Emu16::new().unwrap(), &xs, shift);
            for ((ea, sa, ma, xa), (eb, sb, mb, xb)) in a.iter().zip(&e16) {
                let n = ea.len();
                // Lane-wise results: the same bits whatever the vector width.
                assert_eq!(bits(ea), bits(eb), "exp rows, n={n}");
                assert_eq!(bits(ma), bits(mb), "scale/mask rows, n={n}");
                assert!(xa.to_bits() == xb.to_bits() || (xa.is_nan() && xb.is_nan()));
                // Against the scalar references.
                let mut want_sum = 0f64;
                for (&x, &got) in xs.iter().zip(ea) {
                    let want = exp(x - shift);
                    want_sum += want as f64;
                    if want.is_nan() {
                        assert!(got.is_nan(), "exp({x} - {shift}) = {got}, want NaN");
                    } else {
                        // Relative 2.5e-7 where normal; below that within 2 subnormal steps.
                        let tol = want.abs() * 2.5e-7 + 3.0 * 1.4e-45;
                        assert!(
                            got == want || (got - want).abs() <= tol,
                            "exp({x} - {shift}) = {got}, scalar {want}"
                        );
                    }
                }
                for ((&x, &got), &m) in xs.iter().zip(ma).zip(&mask) {
                    let want = x * 0.37 + 1.5 * m;
                    // Fused vs separate rounding: within an ulp of the larger term.
                    let tol = ((x * 0.37).abs() + (1.5 * m).abs()) * 1.2e-7;
                    assert!(
                        got.to_bits() == want.to_bits()
                            || (got.is_nan() && want.is_nan())
                            || (got - want).abs() <= tol,
                        "scale/mask of {x}: {got} vs {want}"
                    );
                }
                for (sum, label) in [(*sa, "AVX2"), (*sb, "16 lanes")] {
                    if want_sum.is_nan() {
                        assert!(sum.is_nan(), "{label} sum of a row with NaN, n={n}");
                    } else if want_sum <= f32::MAX as f64 {
                        assert!(
                            ((sum as f64) - want_sum).abs() <= want_sum * 1e-6,
                            "{label} sum {sum} vs {want_sum}, n={n}"
                        );
                    } else {
                        assert_eq!(sum, f32::INFINITY, "{label}, n={n}");
                    }
                }
                let want_max = ma.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                if !ma.iter().any(|v| v.is_nan()) {
                    assert_eq!(*xa, want_max, "max, n={n}");
                }
            }
            // The AVX-512 kernels give the stand-in's bits, sums and maxima included.
            if let Some(t) = Avx512::new() {
                for (got, want) in run_rows(t, &xs, shift).iter().zip(&e16) {
                    assert_eq!(bits(&got.0), bits(&want.0));
                    assert_eq!(bits(&got.2), bits(&want.2));
                    assert_eq!(bits(&[got.1, got.3]), bits(&[want.1, want.3]));
                }
            }
        }
        // The dispatching row form is one of them.
        let mut row = xs.clone();
        exp_sub_row(&mut row, 1.0);
        assert_eq!(
            bits(&row),
            bits(&run_rows(avx2, &xs, 1.0).last().unwrap().0)
        );
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    }

    /// Bit patterns, with every NaN the same.
    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter()
            .map(|v| if v.is_nan() { u32::MAX } else { v.to_bits() })
            .collect()
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
