//! Matrix products: MUL_MAT (f32, f16, bf16, q8_0, q4_0 weights × f32), MUL_MAT_ID and
//! OUT_PROD.
//!
//! MUL_MAT follows ggml: `dst[i, j, i12, i13] = dot(a[:, i, i12/r2, i13/r3], b[:, j, i12, i13])`
//! with `r2 = b.ne2 / a.ne2`, `r3 = b.ne3 / a.ne3`. Operands may be permuted or strided.
//! Activations (`b`) are prepared once per node: used in place when their rows are dense f32,
//! packed to f32 otherwise, and quantized to q8_0 (as ggml does) when the weights are
//! quantized, so quantized products are integer dot products per block. The output is split
//! into tiles of weight rows × activation rows; each task converts its f16/bf16 weight rows
//! to f32 once and reuses them for all its columns.

use super::view::RowIo;
use std::ops::Range;

use super::block_dot;
use super::dot_tile::{self, dots_4xc, max_tile_cols, Bf16Bits, F16Bits, TileWeight};
use super::gemm::{self, F32Rows};
use super::gemm_bf16;
use super::gemm_q8;
use super::interleaved::Layout as Interleaved;
use super::quant_dot::{
    dot_bf16_f32, dot_f16_f32, dot_f32_ref, dot_q4_0_pairs, dot_q4_0_q8_0_ref, dot_q8_0_q8_0,
    dot_q8_0_q8_0_ref, prepare_q4_pairs, q4_pairs_row_bytes, quantize_row_q8_0, Q8_0_BYTES, QK,
};
use super::stored_layout::StoredLayout;
use super::view::{read_index, RawTensor, SendPtr};
use super::{par_ranges, par_ranges_streaming};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::MAX_DIMS;

/// Scratch bytes MUL_MAT / MUL_MAT_ID need for activations of shape `b_ne`.
pub fn scratch_bytes(weights: DType, b_ne: &[usize; MAX_DIMS], b_contiguous: bool) -> usize {
    let rows = b_ne[1] * b_ne[2] * b_ne[3];
    if weights.is_quantized() {
        let k = b_ne[0];
        let partner = block_dot::vec_dot_type(weights)
            .and_then(|p| p.row_size(k).ok())
            .unwrap_or(0);
        rows * ((k / QK) * Q8_0_BYTES)
            .max(gemm_q8::act_row_bytes_for(gemm_q8::Isa::best(), k))
            .max(q4_pairs_row_bytes(k))
            .max(partner)
    } else if b_contiguous {
        0
    } else {
        rows * b_ne[0] * 4
    }
}

fn f32_direct(t: &RawTensor) -> bool {
    t.dtype == DType::F32
        && (t.ne[0] <= 1 || t.nb[0] == 4)
        && (t.ptr.0 as usize).is_multiple_of(4)
        && t.nb[1..].iter().all(|s| s % 4 == 0)
}

/// Dense 2-byte rows of `dtype` (f16 or bf16) that a dot product reads in place.
fn half_direct(t: &RawTensor, dtype: DType) -> bool {
    t.dtype == dtype
        && (t.ne[0] <= 1 || t.nb[0] == 2)
        && (t.ptr.0 as usize).is_multiple_of(2)
        && t.nb[1..].iter().all(|s| s % 2 == 0)
}

/// Activations ready for dot products.
enum Prepared<'s> {
    /// Dense aligned f32 rows read in place.
    Direct(RawTensor),
    /// f32 rows packed contiguously.
    Packed(Vec<f32>, [usize; MAX_DIMS]),
    /// q8_0 rows packed contiguously in the scratch.
    Q8(&'s [u8], usize, [usize; MAX_DIMS]),
    /// Rows quantized for the q4_0 mat-vec kernel (`prepare_q4_pairs`), in the scratch.
    Q4Pairs(&'s [u8], usize, [usize; MAX_DIMS]),
}

fn flat(ne: &[usize; MAX_DIMS], i1: usize, i2: usize, i3: usize) -> usize {
    i1 + ne[1] * (i2 + ne[2] * i3)
}

impl Prepared<'_> {
    fn f32_row(&self, k: usize, (i1, i2, i3): (usize, usize, usize)) -> &[f32] {
        match self {
            Prepared::Direct(b) => {
                // SAFETY: the row lies inside `b`, whose rows are dense, 4-byte aligned f32
                // (checked by `f32_direct`), and `b` is read-only during the product.
                unsafe {
                    std::slice::from_raw_parts(b.at(b.row_offset(i1, i2, i3)).cast::<f32>(), k)
                }
            }
            Prepared::Packed(data, ne) => {
                let r = flat(ne, i1, i2, i3);
                &data[r * k..(r + 1) * k]
            }
            Prepared::Q8(..) | Prepared::Q4Pairs(..) => &[],
        }
    }

    fn q8_row(&self, (i1, i2, i3): (usize, usize, usize)) -> &[u8] {
        match self {
            Prepared::Q8(data, row_bytes, ne) | Prepared::Q4Pairs(data, row_bytes, ne) => {
                let r = flat(ne, i1, i2, i3);
                &data[r * row_bytes..(r + 1) * row_bytes]
            }
            _ => &[],
        }
    }
}

/// Activations for dot products with `weights`; `q4_pairs`: q4_0 weights use the
/// `dot_q4_0_pairs` mat-vec kernel (not the reference).
fn prepare<'s>(
    weights: DType,
    b: RawTensor,
    scratch: &'s mut Vec<u8>,
    q4_pairs: bool,
) -> Result<Prepared<'s>> {
    let k = b.ne[0];
    let nrows = b.nrows();
    if weights == DType::Q4_0 && q4_pairs && k.is_multiple_of(QK) && k > 0 {
        let row_bytes = q4_pairs_row_bytes(k);
        encode_rows(&b, scratch, row_bytes, |x, out| {
            prepare_q4_pairs(x, out);
            Ok(())
        })?;
        return Ok(Prepared::Q4Pairs(scratch.as_slice(), row_bytes, b.ne));
    }
    if let Some(partner) = block_dot::vec_dot_type(weights).filter(|&p| p != DType::Q8_0) {
        // q8_1 / q8_K activations, quantized by the partner type's reference rules.
        let row_bytes = partner.row_size(k)?;
        encode_rows(&b, scratch, row_bytes, |x, out| {
            super::quant_dot::quantize_row(partner, x, out)
        })?;
        return Ok(Prepared::Q8(scratch.as_slice(), row_bytes, b.ne));
    }
    if weights.is_quantized() {
        let row_bytes = DType::Q8_0.row_size(k)?;
        scratch.clear();
        scratch.resize(nrows * row_bytes, 0);
        let out = SendPtr(scratch.as_mut_ptr());
        par_ranges(nrows, super::row_grain(k), |rows| {
            let base = out; // the whole SendPtr, not its raw field
            let mut buf = vec![0f32; k];
            for r in rows {
                let (i1, i2, i3) = b.row_coords(r);
                // SAFETY: row `r` lies inside `b` (read-only).
                unsafe { b.load_row(i1, i2, i3, &mut buf)? };
                // SAFETY: `scratch` holds `nrows` rows of `row_bytes`; this task alone writes
                // row `r`, and `scratch` is not otherwise used until the split returns.
                let row =
                    unsafe { std::slice::from_raw_parts_mut(base.0.add(r * row_bytes), row_bytes) };
                quantize_row_q8_0(&buf, row);
            }
            Ok(())
        })?;
        return Ok(Prepared::Q8(scratch.as_slice(), row_bytes, b.ne));
    }
    if f32_direct(&b) {
        return Ok(Prepared::Direct(b));
    }
    let mut data = vec![0f32; nrows * k];
    if k > 0 {
        let out = SendPtr(data.as_mut_ptr().cast());
        par_ranges(nrows, super::row_grain(k), |rows| {
            let base = out; // the whole SendPtr, not its raw field
            for r in rows {
                let (i1, i2, i3) = b.row_coords(r);
                // SAFETY: `data` holds `nrows` rows of `k`; this task alone writes row `r`, and
                // `data` is not otherwise used until the split returns.
                let row =
                    unsafe { std::slice::from_raw_parts_mut(base.0.cast::<f32>().add(r * k), k) };
                // SAFETY: row `r` lies inside `b` (read-only).
                unsafe { b.load_row(i1, i2, i3, row)? };
            }
            Ok(())
        })?;
    }
    Ok(Prepared::Packed(data, b.ne))
}

/// Fills `scratch` with every row of `b` (read as f32) encoded by `encode` into `row_bytes`
/// bytes, rows split over the pool's threads.
fn encode_rows(
    b: &RawTensor,
    scratch: &mut Vec<u8>,
    row_bytes: usize,
    encode: impl Fn(&[f32], &mut [u8]) -> Result<()> + Sync,
) -> Result<()> {
    let k = b.ne[0];
    scratch.clear();
    scratch.resize(b.nrows() * row_bytes, 0);
    super::par_rows_mut(
        scratch,
        row_bytes,
        || vec![0f32; k],
        |r, out, buf| {
            let (i1, i2, i3) = b.row_coords(r);
            // SAFETY: row `r` lies inside `b` (read-only).
            unsafe { b.load_row(i1, i2, i3, buf)? };
            encode(buf, out)
        },
    )
}

/// One output column: the activation row and the dst offset of element 0 of the column.
#[derive(Clone, Copy)]
struct Col {
    b: (usize, usize, usize),
    dst: usize,
}

/// Computes `dst[i, col] = dot(a[:, i, i02, i03], b[col])` for `i` in `rows`; `n_cols` is the
/// column count of the whole product (which picks the path).
#[allow(clippy::too_many_arguments)]
fn run_tile(
    a: &RawTensor,
    (i02, i03): (usize, usize),
    rows: Range<usize>,
    cols: &[Col],
    n_cols: usize,
    b: &Prepared<'_>,
    dst: &RawTensor,
    reference: bool,
    interleaved: Option<&Interleaved>,
    abuf: &mut Vec<f32>,
) -> Result<()> {
    let k = a.ne[0];
    let write = |col: &Col, i: usize, v: f32| {
        // SAFETY: (i, col) is an element of dst inside this task's tile; tiles are disjoint.
        unsafe {
            dst.at(col.dst + i * dst.nb[0])
                .cast::<f32>()
                .write_unaligned(v)
        }
    };
    match a.dtype {
        DType::Q4_0 if matches!(b, Prepared::Q4Pairs(..)) => {
            let four = super::quant_dot::dot_q4_0_pairs_cols_fn::<4>();
            let two = super::quant_dot::dot_q4_0_pairs_cols_fn::<2>();
            let one = dot_q4_0_pairs;
            BlockDots { one, four, two }.run(a, (i02, i03), rows, cols, b, &write)?;
        }
        DType::Q8_0 | DType::Q4_0 if matches!(b, Prepared::Q8(..)) => {
            let one = match (a.dtype, reference) {
                (DType::Q8_0, false) => dot_q8_0_q8_0,
                (DType::Q8_0, true) => dot_q8_0_q8_0_ref,
                (_, false) => super::quant_dot::dot_q4_0_q8_0,
                (_, true) => dot_q4_0_q8_0_ref,
            };
            let several = a.dtype == DType::Q8_0 && !reference;
            let four = several
                .then(super::quant_dot::dot_q8_0_cols_fn::<4>)
                .flatten();
            let two = several
                .then(super::quant_dot::dot_q8_0_cols_fn::<2>)
                .flatten();
            BlockDots { one, four, two }.run(a, (i02, i03), rows, cols, b, &write)?;
        }
        block if matches!(b, Prepared::Q8(..)) && block_dot::vec_dot_type(block).is_some() => {
            let isa = if reference {
                block_dot::Isa::Portable
            } else {
                block_dot::Isa::best()
            };
            let one = block_dot::dot_fn_with(block, isa).ok_or_else(|| {
                Error::unsupported(format!("MUL_MAT with {} weights", block.name()))
            })?;
            let four = (!reference)
                .then(|| block_dot::dot_cols_fn::<4>(block))
                .flatten();
            let two = (!reference)
                .then(|| block_dot::dot_cols_fn::<2>(block))
                .flatten();
            BlockDots { one, four, two }.run(a, (i02, i03), rows, cols, b, &write)?;
        }
        half @ (DType::F16 | DType::BF16)
            if !reference
                && half_direct(a, half)
                && n_cols > DIRECT_DOT_MAX_COLS
                && interleaved.is_none()
                && dot_tile::simd_tiles() =>
        {
            // More columns: register tiles widening the 16-bit rows as they load them (no
            // f32 copy of the rows to write and read back).
            let (at, first) = ((i02, i03), rows.start);
            if half == DType::F16 {
                let arows = half_rows::<F16Bits>(a, rows, at);
                tiled_rows(arows, first, cols, b, k, true, &write);
            } else {
                let arows = half_rows::<Bf16Bits>(a, rows, at);
                tiled_rows(arows, first, cols, b, k, true, &write);
            }
        }
        half @ (DType::F16 | DType::BF16)
            if !reference && half_direct(a, half) && n_cols <= DIRECT_DOT_MAX_COLS =>
        {
            // Few columns (DIRECT_DOT_MAX_COLS): dot products straight from the f16 / bf16
            // weights, half the bytes of an f32 copy and no conversion pass.
            let dot = if half == DType::F16 {
                dot_f16_f32
            } else {
                dot_bf16_f32
            };
            for col in cols {
                let brow = b.f32_row(k, col.b);
                for i in rows.clone() {
                    // SAFETY: weight row (i, i02, i03) lies inside `a` (read-only) and holds
                    // `k` dense, 2-byte aligned values (checked by `half_direct`).
                    let arow = unsafe {
                        std::slice::from_raw_parts(a.at(a.row_offset(i, i02, i03)).cast::<u16>(), k)
                    };
                    write(col, i, dot(arow, brow));
                }
            }
        }
        _ => {
            let direct = f32_direct(a);
            if !direct {
                abuf.resize(rows.len() * k, 0.0);
                for (ii, i) in rows.clone().enumerate() {
                    // SAFETY: weight row (i, i02, i03) lies inside `a` (read-only).
                    let out = &mut abuf[ii * k..(ii + 1) * k];
                    match interleaved {
                        // SAFETY: row i of the whole interleaved matrix `a` (read-only).
                        Some(layout) => unsafe { load_interleaved_row(a, layout, i, out)? },
                        // SAFETY: weight row (i, i02, i03) lies inside `a` (read-only).
                        None => unsafe { a.load_row(i, i02, i03, out)? },
                    }
                }
            }
            let converted: &[f32] = abuf;
            let arows = rows.clone().enumerate().map(|(ii, i)| {
                if direct {
                    // SAFETY: dense aligned f32 row inside `a` (checked by `f32_direct`),
                    // read-only during the product.
                    unsafe {
                        std::slice::from_raw_parts(a.at(a.row_offset(i, i02, i03)).cast::<f32>(), k)
                    }
                } else {
                    &converted[ii * k..(ii + 1) * k]
                }
            });
            if reference {
                for col in cols {
                    let brow = b.f32_row(k, col.b);
                    for (ii, arow) in arows.clone().enumerate() {
                        write(col, rows.start + ii, dot_f32_ref(arow, brow));
                    }
                }
            } else {
                tiled_rows::<f32>(arows, rows.start, cols, b, k, direct, &write);
            }
        }
    }
    Ok(())
}

/// The direct products of block-quantized weight rows with prepared activation columns: the
/// single-column product `one`, and where the type has them on this CPU the products of
/// four and of two columns at once (each weight block decoded once for all of them; every
/// column keeps `one`'s bits).
struct BlockDots {
    one: block_dot::DotFn,
    four: Option<block_dot::DotColsFn<4>>,
    two: Option<block_dot::DotColsFn<2>>,
}

impl BlockDots {
    /// `dst[i, col]` for weight rows `rows` of batch `at` of `a` and the columns `cols`: four
    /// columns at a time, then two, then one.
    fn run(
        &self,
        a: &RawTensor,
        (i02, i03): (usize, usize),
        rows: Range<usize>,
        cols: &[Col],
        b: &Prepared<'_>,
        write: &impl Fn(&Col, usize, f32),
    ) -> Result<()> {
        let row_bytes = a.dtype.row_size(a.ne[0])?;
        let row = |i: usize| {
            // SAFETY: weight row (i, i02, i03) lies inside `a` (read-only) and spans
            // `row_bytes` bytes of adjacent blocks.
            unsafe { std::slice::from_raw_parts(a.at(a.row_offset(i, i02, i03)), row_bytes) }
        };
        let cols = Self::columns(self.four, cols, rows.clone(), &row, b, write);
        let cols = Self::columns(self.two, cols, rows.clone(), &row, b, write);
        for col in cols {
            let brow = b.q8_row(col.b);
            for i in rows.clone() {
                write(col, i, (self.one)(row(i), brow));
            }
        }
        Ok(())
    }

    /// The leading columns of `cols`, `C` at a time, by the several-column product `dot`
    /// (when there is one); returns the columns left (fewer than `C`, or all of them).
    fn columns<'c, 'r, const C: usize>(
        dot: Option<block_dot::DotColsFn<C>>,
        mut cols: &'c [Col],
        rows: Range<usize>,
        row: &impl Fn(usize) -> &'r [u8],
        b: &Prepared<'_>,
        write: &impl Fn(&Col, usize, f32),
    ) -> &'c [Col] {
        let Some(dot) = dot else {
            return cols;
        };
        while cols.len() >= C {
            let (these, rest) = cols.split_at(C);
            let ys: [&[u8]; C] = std::array::from_fn(|c| b.q8_row(these[c].b));
            for i in rows.clone() {
                for (col, v) in these.iter().zip(dot(row(i), ys)) {
                    write(col, i, v);
                }
            }
            cols = rest;
        }
        cols
    }
}

/// Weight rows `rows` of batch `(i02, i03)` of the 16-bit float matrix `a` as elements of
/// `W` (its own bits: f16 or bf16, dense and 2-byte aligned, as `half_direct` checks).
fn half_rows<'a, W: TileWeight + 'a>(
    a: &'a RawTensor,
    rows: Range<usize>,
    (i02, i03): (usize, usize),
) -> impl Iterator<Item = &'a [W]> {
    let k = a.ne[0];
    // SAFETY: weight row (i, i02, i03) lies inside `a` (read-only during the product) and
    // holds `k` dense, 2-byte aligned values of W's 16-bit layout (`half_direct`).
    rows.map(move |i| unsafe {
        std::slice::from_raw_parts(a.at(a.row_offset(i, i02, i03)).cast(), k)
    })
}

/// [`run_tile`]'s register-tiled dot products: the task's weight rows `arows` (rows
/// `row0..`, as f32 or 16-bit floats widened in registers) against the columns `cols`.
///
/// 4 rows × 2-4 columns per pass (register tiles); rows left over below a multiple of 4 take
/// a tile padded with copies of the last row. Rows outside, columns inside: each
/// 4-row block is fetched from memory once, in address order (a steady stream for the
/// prefetcher), then reused from L1 by every column group. Groups are balanced (13 columns:
/// 4+3+3+3 with AVX-512, else 3+3+3+2+2) so no pass has a single column, which would be bound
/// by loads. With `prefetch` (rows read in place, from memory) the next 4 rows are fetched
/// while the first column group computes; the later groups find these in L1.
#[allow(clippy::too_many_arguments)]
fn tiled_rows<'r, W: TileWeight + 'r>(
    arows: impl Iterator<Item = &'r [W]>,
    row0: usize,
    cols: &[Col],
    b: &Prepared<'_>,
    k: usize,
    prefetch: bool,
    write: &impl Fn(&Col, usize, f32),
) {
    let arows: Vec<&[W]> = arows.collect();
    let n_groups = cols.len().div_ceil(max_tile_cols());
    let (base, extra) = (cols.len() / n_groups, cols.len() % n_groups);
    for r0 in (0..arows.len()).step_by(4) {
        // The last 1-3 rows fill the tile by repeating the last of them (results dropped):
        // a row's bits never depend on the rows beside it, so any split of the rows (thread
        // tasks, a weight split over devices) gives every element the same bits.
        let real = (arows.len() - r0).min(4);
        let a4: [&[W]; 4] = std::array::from_fn(|r| arows[r0 + r.min(real - 1)]);
        let next = (prefetch && r0 + 8 <= arows.len())
            .then(|| std::array::from_fn(|r| arows[r0 + 4 + r].as_ptr()));
        let mut c0 = 0;
        for g in 0..n_groups {
            let width = base + usize::from(g < extra);
            let group = &cols[c0..c0 + width];
            let next = if g == 0 { next } else { None };
            let at = row0 + r0;
            match width {
                1 => tile::<W, 1>(a4, real, group, b, k, at, next, write),
                2 => tile::<W, 2>(a4, real, group, b, k, at, next, write),
                3 => tile::<W, 3>(a4, real, group, b, k, at, next, write),
                _ => tile::<W, 4>(a4, real, group, b, k, at, next, write),
            }
            c0 += width;
        }
    }
}

/// One register tile of [`tiled_rows`]: weight rows `a4` (rows `row0..row0 + 4`) against
/// the `C` columns of `group`, the results of the first `real` rows passed to `write`.
#[allow(clippy::too_many_arguments)]
fn tile<W: TileWeight, const C: usize>(
    a4: [&[W]; 4],
    real: usize,
    group: &[Col],
    b: &Prepared<'_>,
    k: usize,
    row0: usize,
    next: Option<[*const W; 4]>,
    write: &impl Fn(&Col, usize, f32),
) {
    let brows: [&[f32]; C] = std::array::from_fn(|c| b.f32_row(k, group[c].b));
    for (dr, row) in dots_4xc(a4, brows, next).iter().enumerate().take(real) {
        for (col, &v) in group.iter().zip(row) {
            write(col, row0 + dr, v);
        }
    }
}

/// Tasks the dot-product path aims for (enough to keep several threads busy): a constant so the
/// partition, and with it every result bit, is the same for any thread count.
const MIN_TASKS: usize = 16;

/// Largest column count for which compact weights (f16, q8_0, q4_0) are read by dot products
/// of their own type (f16 · f32, integer dots against q8_0 activations): reading the compact
/// rows once is what counts there. With more columns the register-tiled kernel takes over:
/// f16/bf16 rows widened to f32 as it loads them, quantized rows converted to f32 once per
/// tile (faster there, and more accurate). Both decide by the whole product's column count (`n_cols` of
/// [`run_tile`]), never by a tile's, so the path does not depend on how the output is split.
/// Some weight types keep the dot products for a few more columns ([`direct_dot_max_cols`]).
const DIRECT_DOT_MAX_COLS: usize = 2;

/// Largest column count for which weights of `dtype` are read by direct dot products against
/// their partner activations (see [`DIRECT_DOT_MAX_COLS`]). Weights with minimums or scales
/// per 16 values (q4_1, q5_1 and the K-quants) reach the integer GEMM only through a repacking
/// of every weight panel per call, which for a handful of columns costs more than one direct
/// dot product per column: measured on 14336 × 4096 matrices (2 threads, Zen 5, weights
/// streamed from memory), the direct products stay ahead up to 8 columns for q4_1 / q5_1
/// (at 8: 6.3 vs 4.7 GB/s of weights), 6 for q4_K / q6_K / q2_K, 5 for q5_K / q3_K; the
/// types whose blocks are plain signed bytes times a scale (q8_0, q4_0, q5_0, iq4_*) are
/// faster in the GEMM from 3 columns. Where the type has a several-column product
/// ([`block_dot::dot_cols_fn`]: q4_K, q5_K, q6_K with AVX-512) each weight row is decoded
/// once for four columns and the direct products stay ahead up to ~11 columns (at 8: q4_K
/// 11.7 vs 8.1-8.8 GB/s); 8 is kept. The low-bit and grid types the GEMM decodes a group of
/// 32 at a time (tq1_0, tq2_0, mxfp4, q1_0, q2_0, iq2_xxs, iq3_xxs, iq3_s) decode each weight
/// once per call there, against once per column in the dot products: from 3 columns the
/// GEMM is 1.5-7x faster, and mxfp4, q2_0 and iq3_s (whose dot products are slowest for
/// their size) are faster there from 2 columns (18.4 vs 11.7, 9.2 vs 5.8, 5.1 vs 4.5 GB/s),
/// so they keep the dot products for one column only. iq2_xs, iq2_s, nvfp4 and iq1_s reach
/// the GEMM through `affine` (scales per 16, or iq1_s's shift as a minimum), whose packer
/// costs more per weight: their dot products stay ahead up to 4, 4, 5 and 4 columns (at 3:
/// 3.5 vs 2.4, 4.3 vs 3.1, 8.5 vs 4.6, 2.8 vs 1.9 GB/s; at 8 the GEMM leads: 2.2 vs 1.3,
/// 2.8 vs 1.6, 4.2 vs 3.3, 1.8 vs 1.1). Decided by the whole product's column
/// count, so the path (and every result bit) is the same for any split of the output.
pub fn direct_dot_max_cols(dtype: DType) -> usize {
    match dtype {
        DType::Q4_K | DType::Q5_K | DType::Q6_K if block_dot::dot_cols_fn::<4>(dtype).is_some() => {
            8
        }
        DType::Q4_1 | DType::Q5_1 => 8,
        DType::Q2_K | DType::Q4_K | DType::Q6_K => 6,
        DType::Q3_K | DType::Q5_K => 5,
        DType::MXFP4 | DType::Q2_0 | DType::IQ3_S => 1,
        DType::IQ2_XS | DType::IQ2_S | DType::IQ1_S => 4,
        DType::NVFP4 => 5,
        _ => DIRECT_DOT_MAX_COLS,
    }
}

/// How the direct/tiled path cuts a product into tasks: row tiles of [`TilePlan::ti`] weight
/// rows (16, so even a small mat-vec, a 192-row projection, splits into enough tasks for every
/// thread) times column tiles, over every batch. Chosen from the shape alone, never from the
/// thread count: the f16 path and the register-tile widths depend on a tile's columns, so a
/// thread-dependent split would change the results' last bits with `n_threads`.
#[derive(Clone, Copy)]
struct TilePlan {
    /// Weight rows of the product.
    m: usize,
    /// Columns of the product.
    n: usize,
    /// Weight rows per row tile.
    ti: usize,
    /// Row tiles per batch.
    i_tiles: usize,
    /// Column tiles per batch.
    j_tiles: usize,
    /// Columns per column tile.
    tj: usize,
}

impl TilePlan {
    fn new(m: usize, n: usize, batches: usize) -> TilePlan {
        let ti = 16.min(m.max(1));
        let i_tiles = m.div_ceil(ti);
        let row_tasks = batches * i_tiles;
        let j_tiles = if row_tasks >= MIN_TASKS {
            1
        } else {
            MIN_TASKS.div_ceil(row_tasks).min(n.max(1))
        };
        let tj = n.div_ceil(j_tiles.max(1)).max(1);
        TilePlan {
            m,
            n,
            ti,
            i_tiles,
            j_tiles: n.div_ceil(tj),
            tj,
        }
    }

    /// Tasks over `batches` batches.
    fn tasks(&self, batches: usize) -> usize {
        batches * self.i_tiles * self.j_tiles
    }

    /// Task `task`'s batch, weight rows and columns.
    fn task(&self, task: usize) -> (usize, std::ops::Range<usize>, std::ops::Range<usize>) {
        let jt = task % self.j_tiles;
        let it = (task / self.j_tiles) % self.i_tiles;
        let batch = task / (self.j_tiles * self.i_tiles);
        (
            batch,
            it * self.ti..((it + 1) * self.ti).min(self.m),
            jt * self.tj..((jt + 1) * self.tj).min(self.n),
        )
    }
}

/// Fills `cols` with the output columns `columns` of batch `(i12, i13)` of `dst`.
fn columns_of(
    dst: &RawTensor,
    columns: std::ops::Range<usize>,
    (i12, i13): (usize, usize),
    cols: &mut Vec<Col>,
) {
    cols.clear();
    cols.extend(columns.map(|j| Col {
        b: (j, i12, i13),
        dst: dst.row_offset(j, i12, i13),
    }));
}

/// Whether q4_0 activations are prepared in the pairs layout (offset corrections folded in:
/// no sign fixes per block) for weights `a`: dense rows and a SIMD kernel for it (AVX2,
/// 512-bit VNNI).
fn uses_q4_pairs(a: &RawTensor, reference: bool) -> bool {
    !reference
        && a.nb[0] == a.dtype.type_size()
        && super::quant_dot::PairsIsa::best() != super::quant_dot::PairsIsa::Portable
}

/// MUL_MAT: `dst [M, N, ne12, ne13] = b · aᵀ` per batch, with `a`'s batches broadcast.
pub fn mul_mat(
    dst: RawTensor,
    a: RawTensor,
    b: RawTensor,
    reference: bool,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    mul_mat_tiles(dst, a, None, b, reference, scratch)
}

/// The integer GEMM's kernels for a product of weights `a` into `dst`, when it takes it: not
/// the reference kernels, a CPU with VNNI or AVX2 (the portable integer kernel is slower than
/// dequantized tiles through the f32 GEMM) and operands it accepts ([`gemm_q8::applies`]).
/// Whether the column count calls for it is the caller's part.
fn integer_gemm(a: &RawTensor, dst: &RawTensor, reference: bool) -> Option<gemm_q8::Isa> {
    let isa = gemm_q8::Isa::best();
    (!reference && isa != gemm_q8::Isa::Portable && gemm_q8::applies(a, dst)).then_some(isa)
}

/// [`mul_mat`]; with `interleaved`, `a` is a whole 2-D q4_1 matrix stored in that layout,
/// which only the f32 tile path (more than [`direct_dot_max_cols`] columns, fewer than the
/// GEMM's) may then reach: its rows are rebuilt and converted one at a time.
fn mul_mat_tiles(
    dst: RawTensor,
    a: RawTensor,
    interleaved: Option<&Interleaved>,
    b: RawTensor,
    reference: bool,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let (m, n) = (a.ne[1], b.ne[1]);
    let (ne12, ne13) = (b.ne[2], b.ne[3]);
    if a.ne[2] == 0 || a.ne[3] == 0 || ne12 % a.ne[2] != 0 || ne13 % a.ne[3] != 0 {
        return Err(Error::shape("MUL_MAT batch dimensions do not broadcast"));
    }
    let (r2, r3) = (ne12 / a.ne[2], ne13 / a.ne[3]);
    // One weight matrix for every batch, batches laid out back to back: one product with all
    // the batches' columns (every element's sum is the same; the weights are read once).
    if a.ne[2] == 1 && a.ne[3] == 1 && ne12 * ne13 > 1 && batches_flat(&b) && batches_flat(&dst) {
        return mul_mat_tiles(
            flatten_batches(dst),
            a,
            interleaved,
            flatten_batches(b),
            reference,
            scratch,
        );
    }
    // Quantized weights with more than a couple of columns: integer block products against
    // q8_0 activations (see `gemm_q8`), with VNNI or AVX2 (the portable kernel is slower than
    // dequantized tiles through the f32 GEMM).
    if n > direct_dot_max_cols(a.dtype) {
        if let Some(isa) = integer_gemm(&a, &dst, reference) {
            return gemm_q8::mul_mat(isa, &dst, &a, interleaved, &b, (r2, r3), scratch);
        }
    }
    // bf16 weights: bf16 × bf16 products on AMX tiles where the CPU has them (see `gemm_bf16`).
    if !reference
        && n > DIRECT_DOT_MAX_COLS
        && gemm_bf16::applies(&a, &dst)
        && gemm_bf16::Isa::best() == gemm_bf16::Isa::Amx
    {
        return gemm_bf16::mul_mat(gemm_bf16::Isa::Amx, &dst, &a, &b, (r2, r3));
    }
    if !reference && gemm::applies(&a, &dst, n) {
        return mul_mat_gemm_from(&dst, &a, interleaved, b, (r2, r3), scratch);
    }
    // Quantized weights: integer dot products with q8_0 activations (ggml's way) only up to
    // `direct_dot_max_cols` columns.
    let activations = if a.dtype.is_quantized() && !reference && n > direct_dot_max_cols(a.dtype) {
        DType::F32
    } else {
        a.dtype
    };
    let prepared = prepare(activations, b, scratch, uses_q4_pairs(&a, reference))?;
    let batches = ne12 * ne13;
    let plan = TilePlan::new(m, n, batches);
    // Small products run on one thread: a task costs about ti·tj·K multiply-adds. A
    // mat-vec streams its weights, one range per thread (see `par_ranges_streaming`); its
    // smaller minimum lets products of a few hundred rows use both threads.
    let work_per_task = plan.ti * plan.tj * a.ne[0];
    let min_chunk_work = if n == 1 { 1usize << 14 } else { 1usize << 16 };
    let grain = min_chunk_work.div_ceil(work_per_task.max(1)).max(1);
    let split = if n == 1 {
        par_ranges_streaming
    } else {
        par_ranges
    };
    split(plan.tasks(batches), grain, |range| {
        let mut abuf = Vec::new();
        let mut cols = Vec::with_capacity(plan.tj);
        for task in range {
            let (batch, rows, columns) = plan.task(task);
            let (i12, i13) = (batch % ne12, batch / ne12);
            columns_of(&dst, columns, (i12, i13), &mut cols);
            run_tile(
                &a,
                (i12 / r2, i13 / r3),
                rows,
                &cols,
                n,
                &prepared,
                &dst,
                reference,
                interleaved,
                &mut abuf,
            )?;
        }
        Ok(())
    })
}

/// One product of a run of plainly stored mat-vecs sharing their activations
/// ([`mul_mat_plain_run`]).
#[derive(Clone, Copy)]
pub struct PlainProduct {
    /// The output, `(m, n)` f32.
    pub dst: RawTensor,
    /// The quantized weights, `(k, m)`.
    pub a: RawTensor,
}

/// Whether `dst = a · b` is a mat-vec with plainly stored quantized weights that
/// [`mul_mat_plain_run`] may compute together with others of the same weight type reading the
/// same `b`: 2-D operands, at most [`direct_dot_max_cols`] columns, dense weight rows, so that
/// alone it would take [`mul_mat`]'s direct dot path.
pub fn joins_plain_run(dst: &RawTensor, a: &RawTensor, b: &RawTensor, reference: bool) -> bool {
    let (k, m, n) = (a.ne[0], a.ne[1], b.ne[1]);
    !reference
        && a.dtype.is_quantized()
        && block_dot::vec_dot_type(a.dtype).is_some()
        && a.nb[0] == a.dtype.type_size()
        && a.ne[2] * a.ne[3] == 1
        && b.dtype == DType::F32
        && b.ne[0] == k
        && b.ne[2] * b.ne[3] == 1
        && (1..=direct_dot_max_cols(a.dtype)).contains(&n)
        && k > 0
        && m > 0
        && dst.dtype == DType::F32
        && dst.ne[0] == m
        && dst.ne[1] == n
        && dst.ne[2] * dst.ne[3] == 1
        && !gemm::applies(a, dst, n)
}

/// Several mat-vecs with plainly stored weights of one quantized type and the same
/// activations `b` as one parallel job: the activations are prepared once and every product's
/// tasks (the row and column tiles [`mul_mat`] would use for it alone) form one list. Every
/// product must satisfy [`joins_plain_run`] and share the first one's type and row length;
/// each result has the bits of [`mul_mat`] alone.
pub fn mul_mat_plain_run(
    products: &[PlainProduct],
    b: RawTensor,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let Some(first) = products.first() else {
        return Ok(());
    };
    let same = |p: &PlainProduct| {
        joins_plain_run(&p.dst, &p.a, &b, false)
            && p.a.dtype == first.a.dtype
            && p.a.ne[0] == first.a.ne[0]
    };
    if !products.iter().all(same) {
        return Err(Error::shape(
            "fused mat-vecs: operands do not fit this path",
        ));
    }
    let n = b.ne[1];
    // As `mul_mat_tiles` prepares them for each product alone (same type, same dense rows).
    let prepared = prepare(first.a.dtype, b, scratch, uses_q4_pairs(&first.a, false))?;
    // Per product: its first task and the tiles `mul_mat_tiles` would cut it into alone.
    let mut plans = Vec::with_capacity(products.len());
    let mut total = 0;
    for p in products {
        let plan = TilePlan::new(p.a.ne[1], n, 1);
        plans.push((total, plan));
        total += plan.tasks(1);
    }
    par_ranges_streaming(total, 1, |range| {
        let mut abuf = Vec::new();
        let mut cols = Vec::with_capacity(n);
        for task in range {
            let which = plans.partition_point(|(start, _)| *start <= task) - 1;
            let (start, plan) = plans[which];
            let PlainProduct { dst, a } = products[which];
            let (_, rows, columns) = plan.task(task - start);
            columns_of(&dst, columns, (0, 0), &mut cols);
            run_tile(
                &a,
                (0, 0),
                rows,
                &cols,
                n,
                &prepared,
                &dst,
                false,
                None,
                &mut abuf,
            )?;
        }
        Ok(())
    })
}

/// Whether `t`'s batches (dimensions 2 and 3) follow each other with the row stride, so its
/// rows can be addressed as one matrix of `ne1 · ne2 · ne3` rows.
fn batches_flat(t: &RawTensor) -> bool {
    t.nb[2] == t.nb[1] * t.ne[1] && t.nb[3] == t.nb[2] * t.ne[2]
}

/// `t` (with [`batches_flat`] batches) as one matrix of all its rows.
fn flatten_batches(t: RawTensor) -> RawTensor {
    let rows = t.ne[1] * t.ne[2] * t.ne[3];
    let bytes = t.nb[1] * rows;
    RawTensor {
        ne: [t.ne[0], rows, 1, 1],
        nb: [t.nb[0], t.nb[1], bytes, bytes],
        ..t
    }
}

/// MUL_MAT through the packed GEMM path (see [`gemm`]): activations as f32 rows, then
/// single-threaded multiplications of fixed weight panels, in parallel.
///
/// With `interleaved`, `a` is a whole 2-D matrix stored in that layout.
fn mul_mat_gemm_from(
    dst: &RawTensor,
    a: &RawTensor,
    interleaved: Option<&Interleaved>,
    b: RawTensor,
    (r2, r3): (usize, usize),
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let (k, m, n) = (a.ne[0], a.ne[1], b.ne[1]);
    let (ne12, ne13) = (b.ne[2], b.ne[3]);
    let prepared = prepare(DType::F32, b, scratch, false)?;
    let rows_of = |i12: usize, i13: usize| -> F32Rows {
        match &prepared {
            Prepared::Direct(b) => F32Rows {
                // SAFETY: batch (i12, i13) starts inside `b`.
                ptr: unsafe { b.at(b.row_offset(0, i12, i13)) }.cast::<f32>(),
                row_stride: b.nb[1] / 4,
            },
            Prepared::Packed(data, ne) => F32Rows {
                ptr: data[flat(ne, 0, i12, i13) * k..].as_ptr(),
                row_stride: k,
            },
            Prepared::Q8(..) | Prepared::Q4Pairs(..) => F32Rows {
                ptr: std::ptr::null(),
                row_stride: 0,
            },
        }
    };
    let (r2, r3) = (r2.max(1), r3.max(1));
    let product = |batch: usize| {
        let (i12, i13) = (batch % ne12, batch / ne12);
        gemm::Product {
            weights: match interleaved {
                Some(layout) => gemm::WeightRows::Interleaved {
                    ptr: a.ptr.0.cast_const(),
                    layout: *layout,
                },
                None => gemm::WeightRows::of(a, (i12 / r2, i13 / r3)),
            },
            b: rows_of(i12, i13),
            // SAFETY: output row 0 of batch (i12, i13) lies inside `dst`.
            dst: unsafe { dst.at(dst.row_offset(0, i12, i13)) }.cast::<f32>(),
            dst_stride: dst.nb[1] / 4,
        }
    };
    // SAFETY: every batch's pointers address live host memory of the node's tensors with the
    // shapes and strides of `a`, `b` and `dst` (checked when the node was built); batches
    // write their own dst rows, which do not overlap the read-only weights and activations.
    unsafe { gemm::run(gemm::Isa::best(), (m, n, k), ne12 * ne13, &product) }
}

/// MUL_MAT_ID: for token `t` and slot `e`, `dst[:, e, t] = experts[ids[e, t]] · b[:, e % n_b, t]`.
/// Experts with more tokens than their type's dot products take run the integer GEMM on their
/// gathered columns ([`expert_gemm`]); the others take dot products or f32 tiles per row tile.
pub fn mul_mat_id(
    dst: RawTensor,
    experts: RawTensor,
    b: RawTensor,
    ids: RawTensor,
    reference: bool,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let n_expert = experts.ne[2];
    let (n_used, n_tokens) = (ids.ne[0], ids.ne[1]);
    let mut by_expert: Vec<Vec<Col>> = vec![Vec::new(); n_expert];
    for t in 0..n_tokens {
        for e in 0..n_used {
            // SAFETY: (e, t) lies inside the ids tensor (read-only).
            let x = unsafe { read_index(ids.dtype, ids.at(ids.offset(e, t, 0, 0))) };
            if x < 0 || x as usize >= n_expert {
                return Err(Error::out_of_bounds(format!(
                    "MUL_MAT_ID: expert id {x} is outside 0..{n_expert}"
                )));
            }
            by_expert[x as usize].push(Col {
                b: (e % b.ne[1], t, 0),
                dst: dst.row_offset(e, t, 0),
            });
        }
    }
    // Experts with more tokens than their type's dot products take: the integer GEMM on a
    // gathered copy of their columns, one expert at a time (each call parallel inside).
    let mut on_gemm = vec![false; n_expert];
    for (x, cols) in by_expert.iter().enumerate() {
        on_gemm[x] = expert_gemm(&dst, &experts, x, &b, cols, reference, scratch)?;
    }
    let m = experts.ne[1];
    let ti = 16.min(m.max(1));
    let i_tiles = m.div_ceil(ti);
    let tasks: Vec<(usize, usize)> = (0..n_expert)
        .filter(|&x| !by_expert[x].is_empty() && !on_gemm[x])
        .flat_map(|x| (0..i_tiles).map(move |it| (x, it)))
        .collect();
    if tasks.is_empty() {
        return Ok(()); // every expert went through the GEMM: no activations to prepare
    }
    let prepared = prepare(experts.dtype, b, scratch, false)?;
    par_ranges(tasks.len(), 1, |range| {
        let mut abuf = Vec::new();
        for &(x, it) in &tasks[range] {
            run_tile(
                &experts,
                (x, 0),
                it * ti..((it + 1) * ti).min(m),
                &by_expert[x],
                by_expert[x].len(),
                &prepared,
                &dst,
                reference,
                None,
                &mut abuf,
            )?;
        }
        Ok(())
    })
}

/// MUL_MAT_ID's product of expert `x` with its columns `cols` on the integer GEMM, when the
/// expert's type and token count take it (as a plain MUL_MAT of that many columns would):
/// the columns' activations gathered into a dense f32 matrix, the products computed into a
/// dense output, then scattered to their `dst` rows. Each output column depends on its own
/// activations only, so the bits are those of a MUL_MAT of the same columns. Returns whether
/// the expert was computed here.
fn expert_gemm(
    dst: &RawTensor,
    experts: &RawTensor,
    x: usize,
    b: &RawTensor,
    cols: &[Col],
    reference: bool,
    scratch: &mut Vec<u8>,
) -> Result<bool> {
    let (k, m, n) = (experts.ne[0], experts.ne[1], cols.len());
    let dense_f32 = |t: &RawTensor| t.dtype == DType::F32 && t.nb[0] == 4;
    if n <= direct_dot_max_cols(experts.dtype) || !dense_f32(b) || !dense_f32(dst) {
        return Ok(false);
    }
    // Expert `x`'s matrix (`x < ne[2]`: the caller checked the ids).
    // SAFETY: its first byte lies inside `experts`.
    let ptr = SendPtr(unsafe { experts.at(x * experts.nb[2]) });
    let expert = RawTensor {
        ptr,
        ne: [k, m, 1, 1],
        ..*experts
    };
    let mut out = vec![0f32; n * m];
    let dense = |p: *mut f32, rows: usize, row_len: usize| {
        let ne = [row_len, rows, 1, 1];
        RawTensor {
            ptr: SendPtr(p.cast()),
            dtype: DType::F32,
            ne,
            nb: crate::tensor::contiguous_strides(DType::F32, &ne),
        }
    };
    let out_t = dense(out.as_mut_ptr(), n, m);
    let Some(isa) = integer_gemm(&expert, &out_t, reference) else {
        return Ok(false);
    };
    let mut acts = vec![0f32; n * k];
    for (row, col) in acts.chunks_exact_mut(k).zip(cols) {
        let (i1, i2, i3) = col.b;
        // SAFETY: activation row (i1, i2, i3) lies inside `b` (its coordinates come from the
        // ids' slots and tokens, within b's shape) and holds `k` adjacent f32 (nb[0] == 4).
        let src = unsafe { b.at(b.row_offset(i1, i2, i3)).cast::<f32>().cast_const() };
        // SAFETY: as above; `row` holds `k` f32 and does not overlap `b`.
        unsafe { std::ptr::copy_nonoverlapping(src, row.as_mut_ptr(), k) };
    }
    let acts_t = dense(acts.as_mut_ptr(), n, k);
    gemm_q8::mul_mat(isa, &out_t, &expert, None, &acts_t, (1, 1), scratch)?;
    for (values, col) in out.chunks_exact(m).zip(cols) {
        // SAFETY: `col.dst` is the byte offset of a dst row of `m` adjacent f32 (nb[0] == 4),
        // written by this expert's slot alone.
        unsafe {
            std::ptr::copy_nonoverlapping(values.as_ptr(), dst.at(col.dst).cast::<f32>(), m);
        }
    }
    Ok(true)
}

/// OUT_PROD: `dst[i0, i1, i2, i3] = Σ_k a[i0, k, i2/r2, i3/r3] · b[i1, k, i2, i3]`.
pub fn out_prod(dst: RawTensor, a: RawTensor, b: RawTensor) -> Result<()> {
    let n0 = dst.ne[0];
    let kk = a.ne[1];
    let (r2, r3) = (b.ne[2] / a.ne[2].max(1), b.ne[3] / a.ne[3].max(1));
    par_ranges(dst.nrows(), super::row_grain(n0 * kk.max(1)), |rows| {
        let mut acc = vec![0f32; n0];
        let mut arow = vec![0f32; n0];
        for r in rows {
            let (i1, i2, i3) = dst.row_coords(r);
            acc.iter_mut().for_each(|v| *v = 0.0);
            for k in 0..kk {
                // SAFETY: (i1, k, i2, i3) lies inside `b` and the weight row inside `a`; both
                // are read-only.
                let bv = unsafe { b.at(b.offset(i1, k, i2, i3)).cast::<f32>().read_unaligned() };
                // SAFETY: as above.
                unsafe { a.load_row(k, i2 / r2.max(1), i3 / r3.max(1), &mut arow)? };
                acc.iter_mut().zip(&arow).for_each(|(s, &x)| *s += x * bv);
            }
            // SAFETY: dst row `r` belongs to this task.
            unsafe { dst.store_row(i1, i2, i3, &acc)? };
        }
        Ok(())
    })
}

/// MUL_MAT whose weights `a` are stored interleaved (`layout`, see [`super::interleaved`]):
/// with few columns (the mat-vec of decoding), the 8-row group kernel against q8_1
/// activations, each result bit for bit the plain layout's; with more, the plain layout's
/// paths reading rebuilt rows; for the reference kernels and batched activations, the
/// product of a plain copy of the weights. Every path gives the plain layout's bits.
pub fn mul_mat_interleaved(
    dst: RawTensor,
    a: RawTensor,
    layout: &Interleaved,
    b: RawTensor,
    reference: bool,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let (k, m, n) = (a.ne[0], a.ne[1], b.ne[1]);
    // The whole 2-D matrix against one batch of columns: what the interleaved paths handle.
    let whole = is_whole_interleaved(&dst, &a, layout, &b);
    // More columns: the plain layout's paths (GEMM, f32 tiles), converting rebuilt rows.
    if !reference && whole && n > direct_dot_max_cols(DType::Q4_1) {
        return mul_mat_tiles(dst, a, Some(layout), b, reference, scratch);
    }
    if reference || !whole {
        let stored = StoredLayout::Interleaved(*layout);
        return mul_mat_rebuilt(dst, a, &stored, b, reference, scratch);
    }
    debug_assert!(k > 0 && m > 0);
    mat_vecs_interleaved(
        &[InterleavedProduct {
            dst,
            a,
            layout: *layout,
        }],
        b,
        scratch,
    )
}

/// MUL_MAT with weights stored in one of the repacking buffer type's layouts (`a` points at
/// the stored bytes): each layout's own path.
pub fn mul_mat_laid_out(
    dst: RawTensor,
    a: RawTensor,
    layout: &StoredLayout,
    b: RawTensor,
    reference: bool,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    match layout {
        StoredLayout::Interleaved(l) => mul_mat_interleaved(dst, a, l, b, reference, scratch),
        StoredLayout::Panels(_) | StoredLayout::Nibbles(_) => {
            mul_mat_stored_panels(dst, a, layout, b, reference, scratch)
        }
    }
}

/// MUL_MAT with weights stored as panels for the integer GEMM (the repacking buffer type's
/// layouts for q8_0, [`gemm_q8::stored`], and q4_0, [`gemm_q8::nibbles`]): the GEMM reads
/// them as stored, for any column count, with the bits of the GEMM on the plain rows. The
/// reference kernels, a CPU without the integer kernels, or a product the GEMM cannot take
/// get the plain bytes rebuilt and the plain path.
fn mul_mat_stored_panels(
    dst: RawTensor,
    a: RawTensor,
    layout: &StoredLayout,
    b: RawTensor,
    reference: bool,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let isa = integer_gemm(&a, &dst, reference).filter(|_| b.ne[0] == a.ne[0]);
    if let Some(isa) = isa {
        match layout {
            // the packed lines are read with aligned loads
            StoredLayout::Panels(l) if (a.ptr.0 as usize).is_multiple_of(64) => {
                return gemm_q8::mul_mat_stored(isa, &dst, &a, l, &b, scratch);
            }
            StoredLayout::Nibbles(l) => {
                return gemm_q8::mul_mat_nibbles(isa, &dst, &a, l, &b, scratch);
            }
            _ => {}
        }
    }
    mul_mat_rebuilt(dst, a, layout, b, reference, scratch)
}

/// MUL_MAT on a plain copy of weights stored in `layout` (`a` points at the stored bytes).
fn mul_mat_rebuilt(
    dst: RawTensor,
    a: RawTensor,
    layout: &StoredLayout,
    b: RawTensor,
    reference: bool,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let plain_bytes = layout.plain_bytes();
    let mut plain = vec![0u64; plain_bytes.div_ceil(8)];
    // SAFETY: `plain` holds at least `plain_bytes` bytes; viewing u64s as bytes is valid.
    let bytes =
        unsafe { std::slice::from_raw_parts_mut(plain.as_mut_ptr().cast::<u8>(), plain_bytes) };
    // SAFETY: `a` is the whole matrix stored in `layout` (the caller's), read-only during the
    // product.
    let stored = unsafe { std::slice::from_raw_parts(a.ptr.0.cast_const(), layout.stored_bytes()) };
    layout.copy_out(stored, 0, bytes);
    let a_plain = RawTensor {
        ptr: SendPtr(bytes.as_mut_ptr()),
        ..a
    };
    mul_mat(dst, a_plain, b, reference, scratch)
}

/// Whether `a` is the whole 2-D interleaved q4_1 matrix of `layout` and `dst = a · b` one batch
/// of columns: the shapes the group kernel handles.
fn is_whole_interleaved(
    dst: &RawTensor,
    a: &RawTensor,
    layout: &Interleaved,
    b: &RawTensor,
) -> bool {
    let (k, m, n) = (a.ne[0], a.ne[1], b.ne[1]);
    a.dtype == DType::Q4_1
        && a.ne[2] * a.ne[3] == 1
        && layout.rows == m
        && layout.row_bytes == a.nb[1]
        && b.ne[0] == k
        && b.ne[2] * b.ne[3] == 1
        && dst.ne[0] == m
        && dst.ne[1] == n
}

/// One product of a run of mat-vecs sharing their activations ([`mul_mat_interleaved_run`]).
#[derive(Clone, Copy)]
pub struct InterleavedProduct {
    /// The output, `(m, n)` f32.
    pub dst: RawTensor,
    /// The weights as stored (interleaved).
    pub a: RawTensor,
    /// Their layout.
    pub layout: Interleaved,
}

/// Whether `dst = a · b` (weights interleaved by `layout`) is a mat-vec that
/// [`mul_mat_interleaved_run`] may compute together with others reading the same `b`.
pub fn joins_interleaved_run(
    dst: &RawTensor,
    a: &RawTensor,
    layout: &Interleaved,
    b: &RawTensor,
    reference: bool,
) -> bool {
    !reference
        && b.dtype == DType::F32
        && b.ne[1] <= direct_dot_max_cols(DType::Q4_1)
        && a.ne[0] > 0
        && a.ne[1] > 0
        && is_whole_interleaved(dst, a, layout, b)
}

/// Several mat-vecs with interleaved q4_1 weights and the same activations `b` (a layer's
/// query, key and value projections; its gate and up projections) as one parallel job: the
/// activations are quantized once and the products' row tiles are shared out as one list, so
/// the small products ride on the large ones' stream instead of each paying a start and a
/// join. Every product must satisfy [`joins_interleaved_run`]; each result has the bits of
/// [`mul_mat_interleaved`] alone.
pub fn mul_mat_interleaved_run(
    products: &[InterleavedProduct],
    b: RawTensor,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let fits = |p: &InterleavedProduct| joins_interleaved_run(&p.dst, &p.a, &p.layout, &b, false);
    if products.is_empty()
        || !products.iter().all(fits)
        || products.windows(2).any(|w| w[0].a.ne[0] != w[1].a.ne[0])
    {
        return Err(Error::shape(
            "fused mat-vecs: operands do not fit this path",
        ));
    }
    mat_vecs_interleaved(products, b, scratch)
}

/// The group kernel's mat-vecs (see [`mul_mat_interleaved`]) of every product, all with
/// the activations `b` and the same row length; tasks of two groups (16 rows) as the plain
/// mat-vec's row tiles, numbered across the products in order.
fn mat_vecs_interleaved(
    products: &[InterleavedProduct],
    b: RawTensor,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    use super::interleaved::GROUP;
    let (k, n) = (b.ne[0], b.ne[1]);
    let prepared = prepare(DType::Q4_1, b, scratch, false)?;
    let nb = k / QK;
    let single = block_dot::dot_fn_with(DType::Q4_1, block_dot::Isa::best())
        .ok_or_else(|| Error::unsupported("MUL_MAT with q4_1 weights"))?;
    let tile = 2 * GROUP;
    // First task of each product, and the total.
    let mut starts = Vec::with_capacity(products.len() + 1);
    let mut total = 0;
    for p in products {
        starts.push(total);
        total += p.a.ne[1].div_ceil(tile);
    }
    starts.push(total);
    par_ranges_streaming(total, 1, |tasks| {
        let mut t = tasks.start;
        while t < tasks.end {
            // The product holding task `t`, and this range's tasks inside it.
            let which = starts.partition_point(|&s| s <= t) - 1;
            let p = &products[which];
            let (dst, a) = (p.dst, p.a);
            let end = tasks.end.min(starts[which + 1]);
            let (m, row_bytes) = (a.ne[1], p.layout.row_bytes);
            let grouped = p.layout.grouped_rows();
            let rows = (t - starts[which]) * tile..((end - starts[which]) * tile).min(m);
            let write = |j: usize, i: usize, v: f32| {
                // SAFETY: (i, j) is an element of dst; tasks own disjoint row ranges.
                unsafe {
                    dst.at(dst.row_offset(j, 0, 0) + i * dst.nb[0])
                        .cast::<f32>()
                        .write_unaligned(v)
                }
            };
            // Columns four, then two, at a time while they last (each group's nibbles split
            // once for all of them; the same bits as one column at a time), then one.
            let mut j = 0;
            while j < n {
                let take = match n - j {
                    1 => 1,
                    2 | 3 => 2,
                    _ => 4,
                };
                let rows = rows.clone();
                let out = |c: usize, i: usize, v: f32| write(j + c, i, v);
                let y = |c: usize| prepared.q8_row((j + c, 0, 0));
                match take {
                    1 => interleaved_columns::<1>(&a, rows, grouped, row_bytes, nb, y, single, out),
                    2 => interleaved_columns::<2>(&a, rows, grouped, row_bytes, nb, y, single, out),
                    _ => interleaved_columns::<4>(&a, rows, grouped, row_bytes, nb, y, single, out),
                }
                j += take;
            }
            t = end;
        }
        Ok(())
    })
}

/// One task's rows `rows` of an interleaved q4_1 product for `C` columns (activation rows
/// `y(0..C)`, `nb` blocks each): whole groups (below `grouped`) by the group kernel for all
/// columns at once, the plainly stored rows after them by `single`; `out(c, i, v)` writes
/// column `c`'s row `i`.
#[allow(clippy::too_many_arguments)]
fn interleaved_columns<'y, const C: usize>(
    a: &RawTensor,
    rows: Range<usize>,
    grouped: usize,
    row_bytes: usize,
    nb: usize,
    y: impl Fn(usize) -> &'y [u8],
    single: block_dot::DotFn,
    out: impl Fn(usize, usize, f32),
) {
    use super::interleaved::{dot_group, dot_group_cols, GROUP};
    let ys: [&[u8]; C] = std::array::from_fn(y);
    let mut r = rows.start;
    while r + GROUP <= grouped.min(rows.end) {
        // SAFETY: group r / 8 holds 8 rows of `row_bytes` inside `a` (read-only).
        let group = unsafe { std::slice::from_raw_parts(a.at(r * row_bytes), GROUP * row_bytes) };
        // One column: the single-column kernel (same bits, a little faster).
        let values = if C == 1 {
            std::array::from_fn(|_| dot_group(group, ys[0], nb))
        } else {
            dot_group_cols(group, ys, nb)
        };
        for (c, values) in values.into_iter().enumerate() {
            for (dr, v) in values.into_iter().enumerate() {
                out(c, r + dr, v);
            }
        }
        r += GROUP;
    }
    for i in r..rows.end {
        // SAFETY: rows past the groups are stored plainly inside `a` (read-only).
        let row = unsafe { std::slice::from_raw_parts(a.at(i * row_bytes), row_bytes) };
        for (c, y) in ys.iter().enumerate() {
            out(c, i, single(row, y));
        }
    }
}

/// Row `i` of the interleaved q4_1 matrix `a` (laid out by `layout`) as f32 in `out`.
///
/// # Safety
/// `a` must be the whole stored matrix, readable, with `i < layout.rows`.
unsafe fn load_interleaved_row(
    a: &RawTensor,
    layout: &Interleaved,
    i: usize,
    out: &mut [f32],
) -> Result<()> {
    let mut plain = vec![0u8; layout.row_bytes];
    // SAFETY: forwarded from the caller; the row's blocks are all inside the matrix.
    unsafe { super::interleaved::gather_blocks(a.ptr.0.cast_const(), layout, i, 0, &mut plain) };
    DType::Q4_1.row_to_f32(&plain, out)
}
