//! SOFT_MAX (with f16/f32 mask, scale and ALiBi) and DIAG_MASK_INF.
//!
//! Each row is read before it is written, so both may run in place.

use super::math;
use super::view::RawTensor;
use super::view::RowIo;
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
            soft_max_row(&mut x, masked, scale);
            // SAFETY: as above.
            unsafe { dst.store_row(i1, i2, i3, &x)? };
        }
        Ok(())
    })
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
