//! Copies and conversions: DUP, CONT, CPY (any pair of f32, f16, bf16, i8, i16, i32, i64,
//! q8_0, q4_0; strided and transposed layouts), GET_ROWS and SET_ROWS.
//!
//! Same-dtype copies move bytes (exact); other pairs convert through f32 a row at a time
//! (quantized destinations are quantized row by row with ggml's reference rounding). When the
//! shapes differ (CONT to a new shape) elements map by their flat logical index.

use super::view::RowIo;
use super::view::{load_f32, read_index, store_f32, RawTensor};
use super::{par_ranges, row_grain};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Whether a copy from `src` to `dst` dtype is implemented: every pair of types but those
/// converting into a type without a quantizer ([`DType::has_quantizer`]).
pub fn supports(src: DType, dst: DType) -> bool {
    src == dst || dst.has_quantizer()
}

/// Copies `src` into `dst` (same element count), converting the dtype.
pub fn copy(dst: RawTensor, src: RawTensor) -> Result<()> {
    if dst.nelements() != src.nelements() {
        return Err(Error::shape(format!(
            "copy of {} elements into {}",
            src.nelements(),
            dst.nelements()
        )));
    }
    let same_type = dst.dtype == src.dtype;
    if same_type && dst.ptr.0 == src.ptr.0 && dst.ne == src.ne && dst.nb == src.nb {
        return Ok(());
    }
    let nrows = dst.nrows();
    if same_type && dst.is_contiguous() && src.is_contiguous() {
        let bytes = dst.dtype.row_size(dst.nelements())?;
        let chunk = 1 << 16;
        return par_ranges(bytes.div_ceil(chunk), 4, |range| {
            let start = range.start * chunk;
            let end = (range.end * chunk).min(bytes);
            // SAFETY: both tensors are contiguous with `bytes` bytes; this task copies its own
            // byte range, and the tensors do not overlap (a copy never aliases partially).
            unsafe {
                std::ptr::copy(src.at(start), dst.at(start), end - start);
            }
            Ok(())
        });
    }
    if dst.ne[0] == src.ne[0] && dst.nrows() == src.nrows() {
        let n0 = dst.ne[0];
        let byte_copy = same_type && !dst.dtype.is_quantized();
        return par_ranges(nrows, row_grain(n0), |rows| {
            let mut buf = vec![0f32; n0];
            for r in rows {
                let (d1, d2, d3) = dst.row_coords(r);
                let (s1, s2, s3) = src.row_coords(r);
                // SAFETY: row `r` of each tensor lies inside it; this task owns dst row `r`.
                unsafe {
                    let sp = src.at(src.row_offset(s1, s2, s3));
                    let dp = dst.at(dst.row_offset(d1, d2, d3));
                    if byte_copy {
                        copy_strided(sp, src.nb[0], dp, dst.nb[0], n0, dst.dtype.type_size());
                    } else if same_type {
                        let bytes = dst.dtype.row_size(n0)?;
                        std::ptr::copy(sp, dp, bytes);
                    } else {
                        load_f32(src.dtype, sp, src.nb[0], &mut buf)?;
                        store_f32(dst.dtype, dp, dst.nb[0], &buf)?;
                    }
                }
            }
            Ok(())
        });
    }
    // Different shapes: map elements by flat index.
    let n0 = dst.ne[0];
    let s0 = src.ne[0];
    par_ranges(nrows, row_grain(n0), |rows| {
        let mut out = vec![0f32; n0];
        let mut src_row = vec![0f32; s0];
        let mut cached: Option<usize> = None;
        for r in rows {
            let (d1, d2, d3) = dst.row_coords(r);
            // SAFETY: dst row `r` lies inside dst and belongs to this task.
            let dp = unsafe { dst.at(dst.row_offset(d1, d2, d3)) };
            if same_type && !dst.dtype.is_quantized() {
                let size = dst.dtype.type_size();
                for i in 0..n0 {
                    let k = r * n0 + i;
                    let (sr, si) = (k / s0, k % s0);
                    let (s1, s2, s3) = src.row_coords(sr);
                    // SAFETY: flat element `k` < nelements lies inside src; element `i` lies
                    // inside dst row `r`.
                    unsafe {
                        std::ptr::copy(
                            src.at(src.row_offset(s1, s2, s3) + si * src.nb[0]),
                            dp.add(i * dst.nb[0]),
                            size,
                        );
                    }
                }
                continue;
            }
            for (i, value) in out.iter_mut().enumerate() {
                let k = r * n0 + i;
                let (sr, si) = (k / s0, k % s0);
                if cached != Some(sr) {
                    let (s1, s2, s3) = src.row_coords(sr);
                    // SAFETY: src row `sr` lies inside src (k < nelements).
                    unsafe { src.load_row(s1, s2, s3, &mut src_row)? };
                    cached = Some(sr);
                }
                *value = src_row[si];
            }
            // SAFETY: dst row `r` lies inside dst and belongs to this task.
            unsafe { store_f32(dst.dtype, dp, dst.nb[0], &out)? };
        }
        Ok(())
    })
}

/// Copies `n` elements of `size` bytes from `src` (`src_stride` bytes apart) to `dst`
/// (`dst_stride` apart): one typed load and store per element for the common sizes (a
/// variable-size `copy` per element compiles to a `memmove` call), one `copy` for dense rows.
///
/// # Safety
/// Both ranges must be valid for their `n` elements; a dense destination row must not
/// partially overlap the source row.
unsafe fn copy_strided(
    src: *const u8,
    src_stride: usize,
    dst: *mut u8,
    dst_stride: usize,
    n: usize,
    size: usize,
) {
    macro_rules! typed {
        ($t:ty) => {
            for i in 0..n {
                // SAFETY: element i of each range is valid (caller); unaligned accesses
                // because views may start at any byte.
                unsafe {
                    let v = src.add(i * src_stride).cast::<$t>().read_unaligned();
                    dst.add(i * dst_stride).cast::<$t>().write_unaligned(v);
                }
            }
        };
    }
    if src_stride == size && dst_stride == size {
        // SAFETY: both rows are n·size contiguous bytes (caller); `copy` tolerates overlap.
        unsafe { std::ptr::copy(src, dst, n * size) };
        return;
    }
    match size {
        1 => typed!(u8),
        2 => typed!(u16),
        4 => typed!(u32),
        8 => typed!(u64),
        _ => {
            for i in 0..n {
                // SAFETY: as above.
                unsafe { std::ptr::copy(src.add(i * src_stride), dst.add(i * dst_stride), size) };
            }
        }
    }
}

fn bad_index(what: &str, index: i64, limit: usize) -> Error {
    Error::out_of_bounds(format!("{what}: row index {index} is outside 0..{limit}"))
}

/// GET_ROWS: `dst[:, i10, i11, i12] = a[:, idx[i10, i11, i12], i11, i12]`, as f32 (or i32
/// for an i32 table, copied exactly).
pub fn get_rows(dst: RawTensor, a: RawTensor, idx: RawTensor) -> Result<()> {
    let n0 = a.ne[0];
    par_ranges(dst.nrows(), row_grain(n0), |rows| {
        let mut buf = vec![0f32; n0];
        for r in rows {
            let (i10, i11, i12) = dst.row_coords(r);
            // SAFETY: (i10, i11, i12) is inside the index tensor, whose shape matches dst's
            // rows; the index element is read-only here.
            let row = unsafe { read_index(idx.dtype, idx.at(idx.offset(i10, i11, i12, 0))) };
            if row < 0 || row as usize >= a.ne[1] {
                return Err(bad_index("GET_ROWS", row, a.ne[1]));
            }
            let row = row as usize;
            // SAFETY: the checked row lies inside `a`; dst row `r` belongs to this task.
            unsafe {
                if a.dtype == dst.dtype {
                    let size = a.dtype.type_size();
                    let sp = a.at(a.row_offset(row, i11, i12));
                    let dp = dst.at(dst.row_offset(i10, i11, i12));
                    copy_strided(sp, a.nb[0], dp, dst.nb[0], n0, size);
                } else {
                    a.load_row(row, i11, i12, &mut buf)?;
                    dst.store_row(i10, i11, i12, &buf)?;
                }
            }
        }
        Ok(())
    })
}

/// SET_ROWS: for each row `i` of `b` in batch (i2, i3), writes it (converted to dst's dtype)
/// to dst row `idx[i, i2 % idx.ne1, i3 % idx.ne2]` of the same batch. Rows run in parallel
/// when their targets are distinct, otherwise in order (the last write wins).
pub fn set_rows(dst: RawTensor, b: RawTensor, idx: RawTensor) -> Result<()> {
    let n0 = b.ne[0];
    let nrows = b.nrows();
    let mut targets = Vec::with_capacity(nrows);
    // Each written row's place in dst, to tell whether two rows land on one: work of the rows
    // written, not of dst's size (a decoding step writes one row into a cache of n_ctx).
    let mut keys = Vec::with_capacity(nrows);
    for r in 0..nrows {
        let (i, i2, i3) = b.row_coords(r);
        // SAFETY: (i, i2 % ne1, i3 % ne2) is inside the index tensor (checked by the builder:
        // idx.ne0 == b.ne1).
        let row = unsafe {
            read_index(
                idx.dtype,
                idx.at(idx.offset(i, i2 % idx.ne[1], i3 % idx.ne[2], 0)),
            )
        };
        if row < 0 || row as usize >= dst.ne[1] {
            return Err(bad_index("SET_ROWS", row, dst.ne[1]));
        }
        keys.push(row as usize + dst.ne[1] * (i2 + dst.ne[2] * i3));
        targets.push(row as usize);
    }
    keys.sort_unstable();
    let distinct = keys.windows(2).all(|w| w[0] != w[1]);
    let work = |range: std::ops::Range<usize>| -> Result<()> {
        let mut buf = vec![0f32; n0];
        for r in range {
            let (i, i2, i3) = b.row_coords(r);
            // SAFETY: the checked target row lies inside dst; targets are distinct across
            // tasks (or the loop runs on one thread).
            unsafe {
                b.load_row(i, i2, i3, &mut buf)?;
                dst.store_row(targets[r], i2, i3, &buf)?;
            }
        }
        Ok(())
    };
    if distinct {
        par_ranges(nrows, row_grain(n0), work)
    } else {
        work(0..nrows)
    }
}
