//! MUL_MAT and OUT_PROD as row-major GEMM calls, one per batch.
//!
//! Weights that are not f32 (f16, bf16, q8_0, q4_0) are converted to dense f32 rows first,
//! in parallel on the backend's pool; f32 weights with 4-byte-aligned rows are read in place.

use crate::cpu::RowIo;
use rayon::prelude::*;
use rayon::ThreadPool;

use super::library::{BlasLibrary, GemmCall};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::host::RawTensor;

fn layout_error(what: &str, detail: &str) -> Error {
    Error::unsupported(format!("the BLAS backend cannot read {what}: {detail}"))
}

fn aligned_f32(t: &RawTensor) -> bool {
    (t.ptr.0 as usize).is_multiple_of(std::mem::align_of::<f32>())
}

/// The row stride, in f32 elements, of a `rows × cols` f32 matrix whose rows are
/// `stride_bytes` apart; BLAS wants it at least `cols`.
fn leading_dim(rows: usize, cols: usize, stride_bytes: usize, what: &str) -> Result<usize> {
    if rows <= 1 {
        return Ok(cols.max(1));
    }
    if !stride_bytes.is_multiple_of(4) || stride_bytes / 4 < cols.max(1) {
        return Err(layout_error(
            what,
            &format!("rows {stride_bytes} bytes apart hold {cols} f32 values"),
        ));
    }
    Ok(stride_bytes / 4)
}

fn check_dense_f32_rows(t: &RawTensor, what: &str) -> Result<()> {
    if t.dtype != DType::F32 {
        return Err(layout_error(what, &format!("it is {}", t.dtype.name())));
    }
    if t.ne[0] > 1 && t.nb[0] != 4 {
        return Err(layout_error(what, "its rows are not dense"));
    }
    if !aligned_f32(t) {
        return Err(layout_error(what, "it is not 4-byte aligned"));
    }
    Ok(())
}

/// The batch broadcast factors of `b` over `a` in dims 2 and 3.
fn broadcast(a: &RawTensor, b: &RawTensor, op: &str) -> Result<(usize, usize)> {
    if a.ne[2] == 0
        || a.ne[3] == 0
        || !b.ne[2].is_multiple_of(a.ne[2])
        || !b.ne[3].is_multiple_of(a.ne[3])
    {
        return Err(Error::shape(format!(
            "{op}: batch dimensions {:?} do not broadcast to {:?}",
            &a.ne[2..],
            &b.ne[2..]
        )));
    }
    Ok((b.ne[2] / a.ne[2], b.ne[3] / a.ne[3]))
}

/// Zeroes every row of an f32 `dst` (a product over an empty inner dimension).
fn zero_rows(dst: &RawTensor) -> Result<()> {
    let zeros = vec![0f32; dst.ne[0]];
    for r in 0..dst.nrows() {
        let (i1, i2, i3) = dst.row_coords(r);
        // SAFETY: row `r` lies inside `dst`, which this op owns exclusively while it runs.
        unsafe { dst.store_row(i1, i2, i3, &zeros)? };
    }
    Ok(())
}

/// Converts every row of `a` to dense f32 in `out` (row-major, batches one after another).
fn convert_rows(pool: &ThreadPool, a: &RawTensor, out: &mut Vec<f32>) -> Result<()> {
    let k = a.ne[0];
    out.clear();
    out.resize(a.nrows() * k, 0.0);
    if k == 0 {
        return Ok(());
    }
    let grain = (64 * 1024 / k).max(1);
    pool.install(|| {
        out.par_chunks_mut(k)
            .enumerate()
            .with_min_len(grain)
            .try_for_each(|(r, row)| {
                let (i1, i2, i3) = a.row_coords(r);
                // SAFETY: row `r` lies inside `a`, which nothing writes during the op.
                unsafe { a.load_row(i1, i2, i3, row) }
            })
    })
}

/// MUL_MAT: `dst[:, j, i2, i3] = a[:, :, i2/r2, i3/r3] · b[:, j, i2, i3]`, i.e. per batch the
/// row-major product `dst (N×M) = b (N×K) · aᵀ (K×M)`.
pub(crate) fn mul_mat(
    library: &BlasLibrary,
    pool: &ThreadPool,
    dst: RawTensor,
    a: RawTensor,
    b: RawTensor,
    scratch: &mut Vec<f32>,
) -> Result<()> {
    let (k, m, n) = (a.ne[0], a.ne[1], b.ne[1]);
    if b.ne[0] != k || dst.ne != [m, n, b.ne[2], b.ne[3]] {
        return Err(Error::shape(format!(
            "MUL_MAT: weights {:?}, activations {:?} and result {:?} do not fit",
            a.ne, b.ne, dst.ne
        )));
    }
    let (r2, r3) = broadcast(&a, &b, "MUL_MAT")?;
    check_dense_f32_rows(&b, "the activations")?;
    check_dense_f32_rows(&dst, "the result")?;
    if m == 0 || n == 0 || dst.nrows() == 0 {
        return Ok(());
    }
    if k == 0 {
        return zero_rows(&dst);
    }
    let ldb = leading_dim(n, k, b.nb[1], "the activations")?;
    let ldc = leading_dim(n, m, dst.nb[1], "the result")?;
    let direct = a.dtype == DType::F32 && (k <= 1 || a.nb[0] == 4) && aligned_f32(&a);
    let lda_direct = if direct {
        leading_dim(m, k, a.nb[1], "the weights").ok()
    } else {
        None
    };
    if lda_direct.is_none() {
        if !a.dense_rows() {
            return Err(layout_error("the weights", "their rows are not dense"));
        }
        convert_rows(pool, &a, scratch)?;
    }
    for i3 in 0..b.ne[3] {
        for i2 in 0..b.ne[2] {
            let (a2, a3) = (i2 / r2, i3 / r3);
            let (weights, lda) = match lda_direct {
                // SAFETY: batch (a2, a3) lies inside `a` (a2 < a.ne2, a3 < a.ne3).
                Some(lda) => (
                    unsafe { a.at(a.row_offset(0, a2, a3)) }
                        .cast_const()
                        .cast::<f32>(),
                    lda,
                ),
                None => {
                    let start = (a2 + a.ne[2] * a3) * m * k;
                    (scratch[start..start + m * k].as_ptr(), k)
                }
            };
            let call = GemmCall {
                trans_a: false,
                trans_b: true,
                m: n,
                n: m,
                k,
                // SAFETY: batch (i2, i3) lies inside `b` and `dst`.
                a: unsafe { b.at(b.row_offset(0, i2, i3)) }.cast::<f32>(),
                lda: ldb,
                b: weights,
                ldb: lda,
                // SAFETY: as above.
                c: unsafe { dst.at(dst.row_offset(0, i2, i3)) }.cast::<f32>(),
                ldc,
            };
            // SAFETY: the three matrices have the sizes and strides in `call` (checked
            // above), the result is a distinct tensor that only this op writes, and the
            // weights and activations are read-only during the op.
            unsafe { library.sgemm(&call)? };
        }
    }
    Ok(())
}

/// OUT_PROD: `dst[i0, i1, i2, i3] = Σ_k a[i0, k, i2/r2, i3/r3] · b[i1, k, i2, i3]`, i.e. per
/// batch the row-major product `dst (N1×N0) = bᵀ (N1×K) · a (K×N0)`, where `b` may be stored
/// plainly or be a transposed view.
pub(crate) fn out_prod(
    library: &BlasLibrary,
    dst: RawTensor,
    a: RawTensor,
    b: RawTensor,
) -> Result<()> {
    let (n0, kk, n1) = (a.ne[0], a.ne[1], b.ne[0]);
    if b.ne[1] != kk || dst.ne != [n0, n1, b.ne[2], b.ne[3]] {
        return Err(Error::shape(format!(
            "OUT_PROD: operands {:?}, {:?} and result {:?} do not fit",
            a.ne, b.ne, dst.ne
        )));
    }
    let (r2, r3) = broadcast(&a, &b, "OUT_PROD")?;
    check_dense_f32_rows(&a, "the first operand")?;
    check_dense_f32_rows(&dst, "the result")?;
    if b.dtype != DType::F32 || !aligned_f32(&b) {
        return Err(layout_error("the second operand", "it is not aligned f32"));
    }
    if n0 == 0 || n1 == 0 || dst.nrows() == 0 {
        return Ok(());
    }
    if kk == 0 {
        return zero_rows(&dst);
    }
    // op(X) = bᵀ restricted to one batch: n1 × kk.
    let (trans_x, ldx) = if n1 <= 1 || b.nb[0] == 4 {
        // stored as kk rows of n1 values
        (true, leading_dim(kk, n1, b.nb[1], "the second operand")?)
    } else if kk <= 1 || b.nb[1] == 4 {
        // transposed view: stored as n1 rows of kk values
        (false, leading_dim(n1, kk, b.nb[0], "the second operand")?)
    } else {
        return Err(layout_error(
            "the second operand",
            "neither its rows nor its columns are dense",
        ));
    };
    let lda = leading_dim(kk, n0, a.nb[1], "the first operand")?;
    let ldc = leading_dim(n1, n0, dst.nb[1], "the result")?;
    for i3 in 0..b.ne[3] {
        for i2 in 0..b.ne[2] {
            let call = GemmCall {
                trans_a: trans_x,
                trans_b: false,
                m: n1,
                n: n0,
                k: kk,
                // SAFETY: batch (i2, i3) lies inside `b` and `dst`, batch (i2/r2, i3/r3)
                // inside `a`.
                a: unsafe { b.at(b.row_offset(0, i2, i3)) }.cast::<f32>(),
                lda: ldx,
                // SAFETY: as above.
                b: unsafe { a.at(a.row_offset(0, i2 / r2, i3 / r3)) }.cast::<f32>(),
                ldb: lda,
                // SAFETY: as above.
                c: unsafe { dst.at(dst.row_offset(0, i2, i3)) }.cast::<f32>(),
                ldc,
            };
            // SAFETY: sizes and strides checked above; the result is written by this op
            // alone and does not overlap its read-only operands.
            unsafe { library.sgemm(&call)? };
        }
    }
    Ok(())
}
