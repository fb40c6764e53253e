//! Reductions and tiling: SUM, SUM_ROWS, MEAN, ARGMAX, REPEAT, CONCAT.
//!
//! Sums accumulate in f64 (ggml uses a double accumulator too). REPEAT and CONCAT copy bytes,
//! so they are exact for every non-quantized dtype.

use super::view::RawTensor;
use super::view::RowIo;
use super::{par_ranges, row_grain};
use crate::error::Result;

fn row_sum(a: &RawTensor, r: usize, buf: &mut [f32]) -> Result<f64> {
    let (i1, i2, i3) = a.row_coords(r);
    // SAFETY: row `r` lies inside `a`, which is read-only during this op.
    unsafe { a.load_row(i1, i2, i3, buf)? };
    Ok(super::math::sum_f64(buf))
}

/// SUM: the sum of all elements into a one-element f32 tensor.
pub fn sum(dst: RawTensor, a: RawTensor) -> Result<()> {
    let n0 = a.ne[0];
    // Row sums in parallel, then added in row order: a parallel tree reduction would group the
    // additions by thread count and change the result's last bits with it.
    let nrows = a.nrows();
    let row_sums: Vec<std::sync::atomic::AtomicU64> =
        (0..nrows).map(|_| Default::default()).collect();
    par_ranges(nrows, row_grain(n0), |rows| {
        let mut buf = vec![0f32; n0];
        for r in rows {
            let s = row_sum(&a, r, &mut buf)?;
            row_sums[r].store(s.to_bits(), std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    })?;
    let total: f64 = row_sums
        .into_iter()
        .map(|s| f64::from_bits(s.into_inner()))
        .sum();
    // SAFETY: dst has one element and nothing else accesses it.
    unsafe { dst.store_row(0, 0, 0, &[total as f32]) }
}

/// SUM_ROWS (or MEAN when `mean`): one value per row, into `[1, ne1, ne2, ne3]`.
pub fn sum_rows(dst: RawTensor, a: RawTensor, mean: bool) -> Result<()> {
    let n0 = a.ne[0];
    par_ranges(a.nrows(), row_grain(n0), |rows| {
        let mut buf = vec![0f32; n0];
        for r in rows {
            let mut s = row_sum(&a, r, &mut buf)?;
            if mean {
                s /= n0 as f64;
            }
            let (i1, i2, i3) = a.row_coords(r);
            // SAFETY: dst row (i1, i2, i3) has one element owned by this task.
            unsafe { dst.store_row(i1, i2, i3, &[s as f32])? };
        }
        Ok(())
    })
}

/// ARGMAX: the index of each row's maximum, as i32; among equal maxima the last wins, as in
/// ggml's `vec_argmax_f32`.
pub fn argmax(dst: RawTensor, a: RawTensor) -> Result<()> {
    let n0 = a.ne[0];
    par_ranges(a.nrows(), row_grain(n0), |rows| {
        let mut buf = vec![0f32; n0];
        for r in rows {
            let (i1, i2, i3) = a.row_coords(r);
            // SAFETY: the row lies inside `a` (read-only).
            unsafe { a.load_row(i1, i2, i3, &mut buf)? };
            let mut best = 0usize;
            let mut max = f32::NEG_INFINITY;
            for (i, &v) in buf.iter().enumerate() {
                if v >= max {
                    max = v;
                    best = i;
                }
            }
            // SAFETY: dst element `r` lies inside dst and belongs to this task.
            unsafe {
                dst.at(dst.offset(r, 0, 0, 0))
                    .cast::<i32>()
                    .write_unaligned(best as i32)
            };
        }
        Ok(())
    })
}

/// REPEAT: `dst[i] = a[i mod a.ne]` in every dimension (bytes copied).
pub fn repeat(dst: RawTensor, a: RawTensor) -> Result<()> {
    let n0 = dst.ne[0];
    let size = dst.dtype.type_size();
    par_ranges(dst.nrows(), row_grain(n0), |rows| {
        for r in rows {
            let (i1, i2, i3) = dst.row_coords(r);
            // SAFETY: the source coordinates are reduced modulo a's shape, so they lie inside
            // `a`; dst row `r` belongs to this task.
            unsafe {
                let sp = a.at(a.row_offset(i1 % a.ne[1], i2 % a.ne[2], i3 % a.ne[3]));
                let dp = dst.at(dst.row_offset(i1, i2, i3));
                for i0 in 0..n0 {
                    std::ptr::copy_nonoverlapping(
                        sp.add((i0 % a.ne[0]) * a.nb[0]),
                        dp.add(i0 * dst.nb[0]),
                        size,
                    );
                }
            }
        }
        Ok(())
    })
}

/// CONCAT: `a` then `b` along dimension `dim` (bytes copied).
pub fn concat(dst: RawTensor, a: RawTensor, b: RawTensor, dim: usize) -> Result<()> {
    let n0 = dst.ne[0];
    let size = dst.dtype.type_size();
    let split = a.ne[dim.min(3)];
    par_ranges(dst.nrows(), row_grain(n0), |rows| {
        for r in rows {
            let (i1, i2, i3) = dst.row_coords(r);
            // SAFETY: every element comes from inside `a` (index below `split` in `dim`) or
            // `b` (index shifted by `split`); dst row `r` belongs to this task.
            unsafe {
                let dp = dst.at(dst.row_offset(i1, i2, i3));
                for i0 in 0..n0 {
                    let mut idx = [i0, i1, i2, i3];
                    let src = if idx[dim] < split {
                        &a
                    } else {
                        idx[dim] -= split;
                        &b
                    };
                    std::ptr::copy_nonoverlapping(
                        src.at(idx[0] * src.nb[0] + src.row_offset(idx[1], idx[2], idx[3])),
                        dp.add(i0 * dst.nb[0]),
                        size,
                    );
                }
            }
        }
        Ok(())
    })
}
