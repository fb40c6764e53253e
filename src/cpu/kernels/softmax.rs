//! SOFT_MAX (with f16/f32 mask, scale and ALiBi) and DIAG_MASK_INF.
//!
//! Each row is read before it is written, so both may run in place.

use super::math;
use super::view::RawTensor;
use super::{par_ranges, row_grain, simd_fn};
use crate::error::Result;

/// ggml's ALiBi slope of head `h` of `n_head` for `max_bias` (1 when `max_bias` is 0).
pub fn alibi_slope(max_bias: f32, n_head: usize, h: usize) -> f32 {
    if max_bias <= 0.0 {
        return 1.0;
    }
    let n_head_log2 = 1usize << (usize::BITS - 1 - n_head.max(1).leading_zeros());
    let m0 = 2f32.powf(-max_bias / n_head_log2 as f32);
    let m1 = 2f32.powf(-(max_bias / 2.0) / n_head_log2 as f32);
    if h < n_head_log2 {
        m0.powf((h + 1) as f32)
    } else {
        m1.powf((2 * (h - n_head_log2) + 1) as f32)
    }
}

/// SOFT_MAX: `softmax(x·scale + slope·mask)` per row; mask rows `(i1, i2 % m2, i3 % m3)`.
pub fn soft_max(
    dst: RawTensor,
    a: RawTensor,
    mask: Option<RawTensor>,
    scale: f32,
    max_bias: f32,
) -> Result<()> {
    let n0 = a.ne[0];
    let n_head = a.ne[2];
    par_ranges(a.nrows(), row_grain(n0), |rows| {
        let mut x = vec![0f32; n0];
        let mut m = vec![0f32; if mask.is_some() { n0 } else { 0 }];
        for r in rows {
            let (i1, i2, i3) = a.row_coords(r);
            // SAFETY: the row lies inside `a` and `dst` and is read before this task, its only
            // writer, stores it; the mask row lies inside the mask (builder check), read-only.
            unsafe { a.load_row(i1, i2, i3, &mut x)? };
            let masked = if let Some(mask) = &mask {
                // SAFETY: as above.
                unsafe { mask.load_row(i1, i2 % mask.ne[2], i3 % mask.ne[3], &mut m)? };
                Some((m.as_slice(), alibi_slope(max_bias, n_head, i2)))
            } else {
                None
            };
            soft_max_row_fast(&mut x, masked, scale);
            // SAFETY: as above.
            unsafe { dst.store_row(i1, i2, i3, &x)? };
        }
        Ok(())
    })
}

/// [`soft_max_row`] in AVX-512F when the CPU has it (scale and mask in one fused
/// multiply-add, 16-lane exp, f32 sum in 16 lanes; agrees with it to a few ulp), else
/// [`soft_max_row`]. Rows whose every element is −∞ (or NaN) go to [`soft_max_row`], so both
/// give the same result for them.
pub(crate) fn soft_max_row_fast(x: &mut [f32], mask: Option<(&[f32], f32)>, scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if super::attention::has_avx512f() && mask.is_none_or(|(m, _)| m.len() >= x.len()) {
        let original = x.len();
        // SAFETY: AVX-512F was detected; x (and the mask, checked above) hold x.len() floats.
        let max = unsafe {
            math::scale_mask_max_avx512(
                x.as_mut_ptr(),
                original,
                scale,
                mask.map(|(m, s)| (m.as_ptr(), s)),
            )
        };
        if max > f32::NEG_INFINITY && max < f32::INFINITY {
            // SAFETY: as above.
            let sum = unsafe { math::exp_sub_sum_avx512(x, max) };
            let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
            scale_row(x, inv);
            return;
        }
        // x was scaled and masked in place: finish with scale 1 and no mask.
        soft_max_row(x, None, 1.0);
        return;
    }
    soft_max_row(x, mask, scale)
}

simd_fn! {
    /// `x *= s` (vectorised).
    fn scale_row(x: &mut [f32], s: f32) {
        x.iter_mut().for_each(|v| *v *= s);
    }
}

simd_fn! {
    /// `x = softmax(x·scale + slope·mask)` in place (max-subtracted exp, f64 sum).
    pub(crate) fn soft_max_row(x: &mut [f32], mask: Option<(&[f32], f32)>, scale: f32) {
        match mask {
            Some((m, slope)) => x
                .iter_mut()
                .zip(m)
                .for_each(|(v, &mv)| *v = *v * scale + slope * mv),
            None => x.iter_mut().for_each(|v| *v *= scale),
        }
        let max = math::max_f32(x);
        math::exp_sub_row(x, max);
        let sum = math::sum_f64(x);
        let inv = if sum > 0.0 { (1.0 / sum) as f32 } else { 0.0 };
        x.iter_mut().for_each(|v| *v *= inv);
    }
}

/// DIAG_MASK_INF: elements with column `i0 > n_past + i1` become −∞.
pub fn diag_mask_inf(dst: RawTensor, a: RawTensor, n_past: usize) -> Result<()> {
    let n0 = a.ne[0];
    par_ranges(a.nrows(), row_grain(n0), |rows| {
        let mut x = vec![0f32; n0];
        for r in rows {
            let (i1, i2, i3) = a.row_coords(r);
            // SAFETY: whole-row read before write by the row's only writer.
            unsafe { a.load_row(i1, i2, i3, &mut x)? };
            for v in x.iter_mut().skip(n_past + i1 + 1) {
                *v = f32::NEG_INFINITY;
            }
            // SAFETY: as above.
            unsafe { dst.store_row(i1, i2, i3, &x)? };
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast row (AVX-512 when present) and the portable row against an f64 softmax:
    /// relative error below 1e-6 per element, lengths leaving partial vectors, with and
    /// without a mask holding −∞; an all −∞ row gives what [`soft_max_row`] gives.
    #[test]
    fn fast_row_matches_f64_softmax() {
        let mut seed = 3u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 * 8.0 - 4.0
        };
        for n in [1usize, 7, 16, 33, 128, 300] {
            let x: Vec<f32> = (0..n).map(|_| next()).collect();
            let m: Vec<f32> = (0..n)
                .map(|i| {
                    if i % 3 == 1 && n > 1 {
                        f32::NEG_INFINITY
                    } else {
                        next()
                    }
                })
                .collect();
            for masked in [false, true] {
                let (scale, slope) = (0.7f32, 0.5f32);
                let logits: Vec<f64> = (0..n)
                    .map(|i| {
                        let v = x[i] as f64 * scale as f64;
                        if masked {
                            v + slope as f64 * m[i] as f64
                        } else {
                            v
                        }
                    })
                    .collect();
                let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
                for fast in [true, false] {
                    let mut row = x.clone();
                    let mask = masked.then_some((m.as_slice(), slope));
                    if fast {
                        soft_max_row_fast(&mut row, mask, scale);
                    } else {
                        soft_max_row(&mut row, mask, scale);
                    }
                    for (i, (&g, l)) in row.iter().zip(&logits).enumerate() {
                        let want = (l - max).exp() / sum;
                        assert!(
                            (g as f64 - want).abs() <= 1e-6 * want + 1e-30,
                            "n={n} masked={masked} fast={fast} [{i}]: {g} vs {want}"
                        );
                    }
                }
            }
        }
        let inf = vec![f32::NEG_INFINITY; 20];
        let (mut a, mut b) = (inf.clone(), inf);
        soft_max_row_fast(&mut a, None, 1.0);
        soft_max_row(&mut b, None, 1.0);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b));
    }
}
