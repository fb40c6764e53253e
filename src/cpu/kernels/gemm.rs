//! The packed GEMM path of MUL_MAT: products with enough columns run as f32 matrix
//! multiplications on the `gemm` crate's cache-blocked, register-tiled micro-kernels (AVX2/FMA
//! or AVX-512 chosen at run time, threads from the current rayon pool).
//!
//! f32 weights are read in place. f16, bf16, q8_0 and q4_0 weights are converted to f32 in
//! panels of rows (converted once per panel and reused for every column), so memory use stays
//! bounded whatever the weight size. Activations are dense f32 rows (read in place or packed by
//! the caller). Unlike the quantized dot-product path the activations are not quantized, so the
//! result is at least as accurate.

use super::view::RawTensor;
use crate::dtype::DType;
use crate::error::Result;

/// Columns (activation rows) from which the GEMM path beats the register-tiled dot products
/// (`dot_tile`): below this the gemm crate spends most of its time packing the weights.
pub const MIN_COLS: usize = 32;

/// Weight rows converted to f32 per panel for non-f32 weights.
const PANEL_ROWS: usize = 256;

/// Dense f32 activation rows of one batch: base pointer and row stride in elements.
#[derive(Clone, Copy)]
pub struct F32Rows {
    /// First element of row 0.
    pub ptr: *const f32,
    /// Elements between the starts of consecutive rows.
    pub row_stride: usize,
}

// SAFETY: `F32Rows` is a read-only view of activations that stay alive and unchanged for the
// whole MUL_MAT node; sharing it between the node's worker threads only reads them.
unsafe impl Send for F32Rows {}
// SAFETY: as above.
unsafe impl Sync for F32Rows {}

/// Whether the weights' rows can be read in place as f32 (dense, aligned).
fn weights_direct(a: &RawTensor) -> bool {
    a.dtype == DType::F32
        && (a.ne[0] <= 1 || a.nb[0] == 4)
        && (a.ptr.0 as usize).is_multiple_of(4)
        && a.nb[1..].iter().all(|s| s % 4 == 0)
}

/// Whether the GEMM path handles this product.
pub fn applies(a: &RawTensor, dst: &RawTensor, n_cols: usize) -> bool {
    n_cols >= MIN_COLS
        && a.ne[0] >= 8
        && dst.dtype == DType::F32
        && dst.nb[0] == 4
        && (dst.ptr.0 as usize).is_multiple_of(4)
        && dst.nb[1..].iter().all(|s| s % 4 == 0)
        && matches!(
            a.dtype,
            DType::F32 | DType::F16 | DType::BF16 | DType::Q8_0 | DType::Q4_0
        )
}

/// `D[j, i] = Σ_k B[j, k] · W[i, k]` for one batch: `m` weight rows starting at `weights`
/// (row stride `w_stride` elements), `n` activation rows `b`, output rows at `dst` with row
/// stride `dst_stride` elements. Single-threaded: the crate's results depend on how it splits
/// the work, so parallelism comes from the caller's fixed panels instead.
///
/// # Safety
/// Every pointer must address the elements implied by the sizes and strides; `dst` must not
/// overlap the inputs and must not be written by anyone else during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    weights: *const f32,
    w_stride: usize,
    b: F32Rows,
    dst: *mut f32,
    dst_stride: usize,
) {
    // gemm computes dst (n×m) = lhs (n×k) · rhs (k×m) with explicit strides: lhs is the
    // activations (row stride b.row_stride, column stride 1), rhs is the weights transposed
    // (row stride 1 along k, column stride w_stride across weight rows).
    // SAFETY: the caller guarantees the extents; strides fit in isize because they describe
    // allocations smaller than isize::MAX bytes.
    unsafe {
        gemm::gemm(
            n,
            m,
            k,
            dst,
            1,
            dst_stride as isize,
            false,
            b.ptr,
            1,
            b.row_stride as isize,
            weights,
            w_stride as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Weight-row panels of an `m`-row product: a function of `m` alone, so every output element
/// comes from the same crate call (same shape, same reduction order) for any thread count.
pub fn panels(m: usize) -> usize {
    m.div_ceil(PANEL_ROWS).max(1)
}

/// One panel of MUL_MAT through GEMM: weight rows `panel * PANEL_ROWS ..` of batch `(i02,
/// i03)` of `a` (converted to f32 in `buf` unless they are dense f32) against the `n`
/// activation rows `b`, into the matching output columns of the rows starting at byte offset
/// `dst_offset` of `dst`.
///
/// # Safety
/// `a`, `b` and `dst` must describe live host memory of the stated shapes; these output
/// elements must belong to this call alone and must not overlap `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn mul_mat_panel(
    a: &RawTensor,
    (i02, i03): (usize, usize),
    b: F32Rows,
    n: usize,
    dst: &RawTensor,
    dst_offset: usize,
    panel: usize,
    buf: &mut Vec<f32>,
) -> Result<()> {
    let (k, m) = (a.ne[0], a.ne[1]);
    let start = panel * PANEL_ROWS;
    let count = PANEL_ROWS.min(m - start);
    let dst_stride = dst.nb[1] / 4;
    // SAFETY: offsets inside `dst` (caller).
    let dst_ptr = unsafe { dst.at(dst_offset) }.cast::<f32>();
    let (weights, w_stride) = if weights_direct(a) {
        // SAFETY: weight row (start, i02, i03) lies inside `a`, whose rows are dense f32.
        let w = unsafe { a.at(a.row_offset(start, i02, i03)) }
            .cast::<f32>()
            .cast_const();
        (w, a.nb[1] / 4)
    } else {
        buf.resize(count * k, 0.0);
        for (r, out) in buf.chunks_mut(k).enumerate() {
            // SAFETY: weight row (start + r, i02, i03) lies inside `a` (read-only).
            unsafe { a.load_row(start + r, i02, i03, out)? };
        }
        (buf.as_ptr(), k)
    };
    // SAFETY: `weights` addresses `count` dense rows of `k` with stride `w_stride`; the output
    // columns start..start+count of each dst row are inside `dst` and belong to this call.
    unsafe {
        sgemm(
            count,
            n,
            k,
            weights,
            w_stride,
            b,
            dst_ptr.add(start),
            dst_stride,
        );
    }
    Ok(())
}
