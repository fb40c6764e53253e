//! Normalisations: NORM (layer norm without affine), RMS_NORM, GROUP_NORM, L2_NORM (f32).
//!
//! Sums accumulate in f64 as ggml's do; RMS_NORM may run in place (each row is read before it
//! is written).

use super::math::{sum_f64, sum_sq_f64};
use super::view::RawTensor;
use super::view::RowIo;
use super::{par_ranges, row_grain, simd_fn};
use crate::error::Result;

#[derive(Clone, Copy)]
enum Kind {
    Norm,
    Rms,
    L2,
}

simd_fn! {
    /// Normalises one row in place.
    fn norm_row(kind: Kind, x: &mut [f32], eps: f32) {
        let n0 = x.len();
        match kind {
            Kind::Norm => {
                let mean = (sum_f64(x) / n0 as f64) as f32;
                x.iter_mut().for_each(|v| *v -= mean);
                let sum2 = sum_sq_f64(x, 0.0);
                let variance = (sum2 / n0 as f64) as f32;
                let scale = 1.0 / (variance + eps).sqrt();
                x.iter_mut().for_each(|v| *v *= scale);
            }
            Kind::Rms => {
                let sum2 = sum_sq_f64(x, 0.0);
                let mean = (sum2 / n0 as f64) as f32;
                let scale = 1.0 / (mean + eps).sqrt();
                x.iter_mut().for_each(|v| *v *= scale);
            }
            Kind::L2 => {
                let sum2 = sum_sq_f64(x, 0.0);
                let scale = 1.0 / (sum2.sqrt() as f32).max(eps);
                x.iter_mut().for_each(|v| *v *= scale);
            }
        }
    }
}

fn rows(kind: Kind, dst: RawTensor, a: RawTensor, eps: f32) -> Result<()> {
    let n0 = a.ne[0];
    par_ranges(a.nrows(), row_grain(n0), |range| {
        let mut x = vec![0f32; n0];
        for r in range {
            let (i1, i2, i3) = a.row_coords(r);
            // SAFETY: the row lies inside both tensors and is read before this task, its only
            // writer, stores it.
            unsafe { a.load_row(i1, i2, i3, &mut x)? };
            norm_row(kind, &mut x, eps);
            // SAFETY: as above.
            unsafe { dst.store_row(i1, i2, i3, &x)? };
        }
        Ok(())
    })
}

/// NORM: `(x − mean) / sqrt(var + eps)` per row.
pub fn norm(dst: RawTensor, a: RawTensor, eps: f32) -> Result<()> {
    rows(Kind::Norm, dst, a, eps)
}

/// RMS_NORM: `x / sqrt(mean(x²) + eps)` per row.
pub fn rms_norm(dst: RawTensor, a: RawTensor, eps: f32) -> Result<()> {
    rows(Kind::Rms, dst, a, eps)
}

/// L2_NORM: `x / max(‖x‖, eps)` per row.
pub fn l2_norm(dst: RawTensor, a: RawTensor, eps: f32) -> Result<()> {
    rows(Kind::L2, dst, a, eps)
}

/// GROUP_NORM: channels (dimension 2) form `n_groups` groups of `ceil(ne2 / n_groups)`
/// channels (the last may be shorter, trailing groups empty); each group of each `i3` is
/// normalised over all its elements.
pub fn group_norm(dst: RawTensor, a: RawTensor, n_groups: usize, eps: f32) -> Result<()> {
    let ne = a.ne;
    let per_group = ne[2].div_ceil(n_groups.max(1));
    let tasks = n_groups * ne[3];
    let group_elems = ne[0] * ne[1] * per_group;
    par_ranges(tasks, row_grain(group_elems), |range| {
        let mut x = vec![0f32; ne[0]];
        for task in range {
            let (g, i3) = (task % n_groups, task / n_groups);
            let start = g * per_group;
            let end = (start + per_group).min(ne[2]);
            if start >= end {
                continue;
            }
            let count = (ne[0] * ne[1] * (end - start)) as f64;
            let mut sum = 0f64;
            for i2 in start..end {
                for i1 in 0..ne[1] {
                    // SAFETY: the row lies inside `a`; the group's rows belong to this task.
                    unsafe { a.load_row(i1, i2, i3, &mut x)? };
                    sum += sum_f64(&x);
                }
            }
            let mean = (sum / count) as f32;
            let mut sum2 = 0f64;
            for i2 in start..end {
                for i1 in 0..ne[1] {
                    // SAFETY: as above.
                    unsafe { a.load_row(i1, i2, i3, &mut x)? };
                    sum2 += sum_sq_f64(&x, mean);
                }
            }
            let scale = 1.0 / ((sum2 / count) as f32 + eps).sqrt();
            for i2 in start..end {
                for i1 in 0..ne[1] {
                    // SAFETY: as above; the row is read before it is written.
                    unsafe {
                        a.load_row(i1, i2, i3, &mut x)?;
                        x.iter_mut().for_each(|v| *v = (*v - mean) * scale);
                        dst.store_row(i1, i2, i3, &x)?;
                    }
                }
            }
        }
        Ok(())
    })
}
