//! Weight rows stored eight at a time, block by block ("interleaved"), and the mat-vec product
//! that reads them: the layout of the CPU's repacking buffer type
//! ([`crate::repack`]).
//!
//! # The layout
//!
//! A tensor of `rows` rows of `row_bytes` bytes (q4_1 blocks of 20 bytes: an f16 scale `d`, an
//! f16 minimum `m`, 16 bytes of nibbles) occupies the same number of bytes as stored plainly.
//! Its first `8 · ⌊rows / 8⌋` rows form groups of [`GROUP`] consecutive rows; group `g` fills
//! bytes `g · 8 · row_bytes ..` with one *superblock* per block column `k` (160 bytes, in `k`
//! order): the 8 rows' `d` (16 bytes, row order), their `m` (16 bytes), then their nibble
//! bytes, 16 per row, in the row order `0 4 1 5 2 6 3 7` ([`SLOT_ROWS`]). The remaining
//! `rows % 8` rows follow, stored plainly. The mapping moves whole fields of blocks, so every
//! byte of the plain tensor has exactly one place: a write or read of any byte range maps
//! exactly ([`copy_in`], [`copy_out`]), and nothing can go stale.
//!
//! # The product
//!
//! [`dot_group`] computes the 8 rows' products with one q8_1 activation row ([`dot_group_cols`]
//! with several, each group's nibbles split once for all of them), and its result for each
//! row (and column) is **bit for bit** the single-row product of [`super::dot_legacy`] (same
//! lanes, same fused multiply-adds, same reduction). The AVX2 version loads 32 nibble bytes
//! (rows `p` and `p + 4`) at once, splits low and high nibbles, multiplies them against the
//! activation's first and second 16 values broadcast to both halves (`maddubs`: `|pair| ≤
//! 2·15·128`, two such sums in `i16` ≤ 7680, no saturation), widens to `i32` pairs and adds
//! them with a three-level `hadd` tree whose result holds row `r`'s exact block sum in lane
//! `r`. The 8 rows' scales are one load each, so the rows' lanes are updated with the same
//! two FMAs the single-row version does per block.

use super::dot_legacy::{self, LANES};
use crate::dtype::DType;
use crate::quant::legacy::{Q4_1_BYTES, Q8_1_BYTES, QK};

/// Rows per interleaved group.
pub const GROUP: usize = 8;
/// Bytes of one superblock (one block of each of the group's rows).
pub const SUPERBLOCK: usize = GROUP * Q4_1_BYTES;
/// The row stored in nibble slot `t` of a superblock: the layout's definition, which the
/// kernels use through its inverse [`slot_of`] (checked against this table by the tests).
#[cfg_attr(not(test), allow(dead_code))]
pub const SLOT_ROWS: [usize; GROUP] = [0, 4, 1, 5, 2, 6, 3, 7];

/// Values per block.
pub const BLOCK_VALUES: usize = QK;
/// Bytes per (plain) block.
pub const BLOCK_BYTES: usize = Q4_1_BYTES;

/// Whether rows of `dtype` with `row_len` values can be interleaved (a product kernel exists).
pub fn supported(dtype: DType, row_len: usize) -> bool {
    dtype == DType::Q4_1 && row_len > 0 && row_len.is_multiple_of(QK)
}

/// The slot of row `r` (0..8) of a group: the inverse of [`SLOT_ROWS`].
const fn slot_of(r: usize) -> usize {
    2 * (r % 4) + r / 4
}

/// The fields of a q4_1 block (`d`, `m`, the nibbles) as byte ranges: each moves as a whole.
const FIELDS: [(usize, usize); 3] = [(0, 2), (2, 4), (4, 20)];

/// Where byte `e` (0..20) of row `r`'s block lands inside its superblock.
#[inline]
fn superblock_offset(r: usize, e: usize) -> usize {
    match e {
        0..2 => 2 * r + e,
        2..4 => 16 + 2 * r + (e - 2),
        _ => 32 + 16 * slot_of(r) + (e - 4),
    }
}

/// The interleaved layout of one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Bytes of one plain row (a whole number of q4_1 blocks).
    pub row_bytes: usize,
    /// Rows of the tensor.
    pub rows: usize,
}

impl Layout {
    /// The layout of `rows` q4_1 rows of `row_len` values, if they can be interleaved.
    pub fn new(dtype: DType, row_len: usize, rows: usize) -> Option<Layout> {
        supported(dtype, row_len).then(|| Layout {
            row_bytes: row_len / QK * Q4_1_BYTES,
            rows,
        })
    }

    /// Bytes of the whole tensor (plain or interleaved: the same).
    pub fn bytes(&self) -> usize {
        self.row_bytes * self.rows
    }

    /// Rows stored in groups.
    pub fn grouped_rows(&self) -> usize {
        self.rows / GROUP * GROUP
    }

    /// Calls `f(plain offset, stored offset, length)` for each contiguous piece of the plain
    /// byte range `start..start + len` (which must lie inside the tensor).
    fn pieces(&self, start: usize, len: usize, mut f: impl FnMut(usize, usize, usize)) {
        let grouped = self.grouped_rows() * self.row_bytes;
        let end = start + len;
        let mut p = start;
        while p < end.min(grouped) {
            let (r, in_row) = (p / self.row_bytes, p % self.row_bytes);
            let (k, e) = (in_row / Q4_1_BYTES, in_row % Q4_1_BYTES);
            let (g, ri) = (r / GROUP, r % GROUP);
            let block_end = (p - e + Q4_1_BYTES).min(end);
            let base = g * GROUP * self.row_bytes + k * SUPERBLOCK;
            for &(lo, hi) in &FIELDS {
                let (a, b) = (e.max(lo), (block_end - (p - e)).min(hi));
                if a < b {
                    f(p - e + a, base + superblock_offset(ri, a), b - a);
                }
            }
            p = block_end;
        }
        if end > p {
            f(p, p, end - p);
        }
    }
}

/// Calls `f(plain offset, [stored offsets of d, m, nibbles])` for every block of the tensor
/// (rows past the groups: their plain offsets, stored plainly).
fn each_block(layout: &Layout, mut f: impl FnMut(usize, [usize; 3])) {
    let rb = layout.row_bytes;
    let blocks = rb / Q4_1_BYTES;
    for g in 0..layout.grouped_rows() / GROUP {
        let group = g * GROUP * rb;
        for k in 0..blocks {
            let sb = group + k * SUPERBLOCK;
            for r in 0..GROUP {
                let plain = group + r * rb + k * Q4_1_BYTES;
                f(
                    plain,
                    [sb + 2 * r, sb + 16 + 2 * r, sb + 32 + 16 * slot_of(r)],
                );
            }
        }
    }
    for plain in (layout.grouped_rows() * rb..layout.bytes()).step_by(Q4_1_BYTES) {
        f(plain, [plain, plain + 2, plain + 4]);
    }
}

/// Rebuilds the plain rows `rows` (starting at a multiple of [`GROUP`]) of a tensor laid out by
/// `layout` whose stored bytes are `stored` into `out` (the rows back to back): whole groups
/// block by block with fixed-size moves, the rows past the groups as stored. What a product
/// reading plain rows (the integer GEMM's packers) uses, a panel of rows at a time.
///
/// # Panics
/// If `rows` does not start a group or exceeds the tensor, or `stored` / `out` are short.
pub fn plain_rows(layout: &Layout, stored: &[u8], rows: std::ops::Range<usize>, out: &mut [u8]) {
    let rb = layout.row_bytes;
    assert!(rows.start.is_multiple_of(GROUP) && rows.start <= rows.end && rows.end <= layout.rows);
    assert!(stored.len() >= layout.bytes() && out.len() >= rows.len() * rb);
    let blocks = rb / Q4_1_BYTES;
    let mut r0 = rows.start;
    while r0 + GROUP <= rows.end.min(layout.grouped_rows()) {
        let group = &stored[r0 * rb..(r0 + GROUP) * rb];
        let plain = &mut out[(r0 - rows.start) * rb..(r0 - rows.start + GROUP) * rb];
        for (k, sb) in group.chunks_exact(SUPERBLOCK).take(blocks).enumerate() {
            for r in 0..GROUP {
                let block = &mut plain[r * rb + k * Q4_1_BYTES..][..Q4_1_BYTES];
                block[0..2].copy_from_slice(&sb[2 * r..2 * r + 2]);
                block[2..4].copy_from_slice(&sb[16 + 2 * r..16 + 2 * r + 2]);
                let at = 32 + 16 * slot_of(r);
                block[4..20].copy_from_slice(&sb[at..at + 16]);
            }
        }
        r0 += GROUP;
    }
    // The rows past the groups (or a partial group's rows, which `copy_out` maps).
    let (from, to) = ((r0 - rows.start) * rb, (rows.end - rows.start) * rb);
    copy_out(layout, stored, r0 * rb, &mut out[from..to]);
}

/// Writes the plain bytes `data` at plain offset `start` of a tensor laid out by `layout`
/// whose stored bytes are `stored`.
///
/// # Panics
/// If `start + data.len()` exceeds the tensor or `stored` is shorter than it (callers check).
pub fn copy_in(layout: &Layout, stored: &mut [u8], start: usize, data: &[u8]) {
    assert!(start + data.len() <= layout.bytes() && stored.len() >= layout.bytes());
    if start == 0 && data.len() == layout.bytes() {
        // The whole tensor (a weight being loaded): block by block with fixed-size moves.
        return each_block(layout, |plain, packed| {
            stored[packed[0]..packed[0] + 2].copy_from_slice(&data[plain..plain + 2]);
            stored[packed[1]..packed[1] + 2].copy_from_slice(&data[plain + 2..plain + 4]);
            stored[packed[2]..packed[2] + 16].copy_from_slice(&data[plain + 4..plain + 20]);
        });
    }
    layout.pieces(start, data.len(), |plain, at, n| {
        stored[at..at + n].copy_from_slice(&data[plain - start..plain - start + n]);
    });
}

/// Reads the plain bytes at plain offset `start` into `out` from a tensor laid out by
/// `layout` whose stored bytes are `stored`.
///
/// # Panics
/// As [`copy_in`].
pub fn copy_out(layout: &Layout, stored: &[u8], start: usize, out: &mut [u8]) {
    assert!(start + out.len() <= layout.bytes() && stored.len() >= layout.bytes());
    if start == 0 && out.len() == layout.bytes() {
        return each_block(layout, |plain, packed| {
            out[plain..plain + 2].copy_from_slice(&stored[packed[0]..packed[0] + 2]);
            out[plain + 2..plain + 4].copy_from_slice(&stored[packed[1]..packed[1] + 2]);
            out[plain + 4..plain + 20].copy_from_slice(&stored[packed[2]..packed[2] + 16]);
        });
    }
    layout.pieces(start, out.len(), |plain, at, n| {
        out[plain - start..plain - start + n].copy_from_slice(&stored[at..at + n]);
    });
}

/// Rebuilds `out.len() / 20` plain blocks of row `row`, from block `first` on, of the matrix
/// laid out by `layout` whose stored bytes start at `stored`.
///
/// # Safety
/// `stored` must be valid for reading `layout.bytes()` bytes; `row < layout.rows` and the
/// blocks must lie inside the row.
pub unsafe fn gather_blocks(
    stored: *const u8,
    layout: &Layout,
    row: usize,
    first: usize,
    out: &mut [u8],
) {
    let grouped = row < layout.grouped_rows();
    for (i, block) in out.chunks_exact_mut(Q4_1_BYTES).enumerate() {
        let k = first + i;
        if grouped {
            let (g, r) = (row / GROUP, row % GROUP);
            let sb = g * GROUP * layout.row_bytes + k * SUPERBLOCK;
            // SAFETY: superblock k of group g lies inside the stored bytes (caller); the
            // three fields are copied from their places in it.
            unsafe {
                let base = stored.add(sb);
                std::ptr::copy_nonoverlapping(
                    base.add(superblock_offset(r, 0)),
                    block.as_mut_ptr(),
                    2,
                );
                std::ptr::copy_nonoverlapping(
                    base.add(superblock_offset(r, 2)),
                    block.as_mut_ptr().add(2),
                    2,
                );
                std::ptr::copy_nonoverlapping(
                    base.add(superblock_offset(r, 4)),
                    block.as_mut_ptr().add(4),
                    16,
                );
            }
        } else {
            // SAFETY: rows past the groups are stored plainly, inside the stored bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    stored.add(row * layout.row_bytes + k * Q4_1_BYTES),
                    block.as_mut_ptr(),
                    Q4_1_BYTES,
                );
            }
        }
    }
}

/// The products of the 8 rows of one group (`group`: its `8 · row_bytes` stored bytes) with
/// the q8_1 row `y`, over `nb` blocks; result `r` is bit for bit
/// [`dot_legacy`]'s q4_1 · q8_1 product of row `r`.
///
/// # Panics
/// If `group` or `y` is shorter than `nb` blocks need.
pub fn dot_group(group: &[u8], y: &[u8], nb: usize) -> [f32; GROUP] {
    assert!(group.len() >= nb * SUPERBLOCK && y.len() >= nb * Q8_1_BYTES);
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: the CPU has AVX2, FMA and F16C; the lengths were checked above.
        return unsafe { x86::dot_group(group.as_ptr(), y.as_ptr(), nb) };
    }
    dot_group_portable(group, y, nb)
}

/// The products of the 8 rows of one group (`group`: its `8 · row_bytes` stored bytes) with
/// each of the `C` q8_1 rows `ys`, over `nb` blocks: result `[c][r]` is bit for bit
/// [`dot_legacy`]'s q4_1 · q8_1 product of row `r` with `ys[c]` (and [`dot_group`]'s). Each
/// superblock's nibbles are split once for all the columns; each column runs the same
/// operations in the same order whatever `C` is. For one column [`dot_group`] is the faster
/// kernel (its one-column instance measured ~2% slower per decoding step).
///
/// # Panics
/// If `group` or a row of `ys` is shorter than `nb` blocks need.
pub fn dot_group_cols<const C: usize>(
    group: &[u8],
    ys: [&[u8]; C],
    nb: usize,
) -> [[f32; GROUP]; C] {
    assert!(group.len() >= nb * SUPERBLOCK && ys.iter().all(|y| y.len() >= nb * Q8_1_BYTES));
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: the CPU has AVX2, FMA and F16C; the lengths were checked above.
        return unsafe { x86::dot_group_cols(group.as_ptr(), ys.map(<[u8]>::as_ptr), nb) };
    }
    ys.map(|y| dot_group_portable(group, y, nb))
}

/// One column of [`dot_group_cols`] by the definition: each row's block rebuilt and fed to
/// the single-row product's step.
pub fn dot_group_portable(group: &[u8], y: &[u8], nb: usize) -> [f32; GROUP] {
    std::array::from_fn(|r| {
        let mut row = vec![0u8; nb * Q4_1_BYTES];
        for (k, block) in row.chunks_exact_mut(Q4_1_BYTES).enumerate() {
            for (e, byte) in block.iter_mut().enumerate() {
                *byte = group[k * SUPERBLOCK + superblock_offset(r, e)];
            }
        }
        dot_legacy::dot_q4_1_q8_1_portable(&row, &y[..nb * Q8_1_BYTES])
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{GROUP, LANES, SUPERBLOCK};
    use crate::quant::legacy::Q8_1_BYTES;

    /// Whether this CPU runs [`dot_group`] and [`dot_group_cols`] (AVX2, FMA and F16C).
    pub fn available() -> bool {
        super::super::dot_legacy::dot_fn(
            crate::dtype::DType::Q4_1,
            super::super::block_dot::Isa::Avx2,
        )
        .is_some()
    }

    /// See [`super::dot_group`].
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; `group` must be valid for `nb` superblocks and
    /// `y` for `nb` q8_1 blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_group(group: *const u8, y: *const u8, nb: usize) -> [f32; GROUP] {
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); LANES];
        for i in 0..nb {
            // SAFETY: superblock i and activation block i lie inside the ranges the caller
            // guarantees; every load is unaligned and inside its block.
            unsafe {
                let sb = group.add(i * SUPERBLOCK);
                let yb = y.add(i * Q8_1_BYTES);
                // The next superblocks (past the group: the next group's).
                super::super::simd::prefetch_ahead(sb, SUPERBLOCK);
                let ylo = _mm256_broadcastsi128_si256(_mm_loadu_si128(yb.add(4).cast()));
                let yhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(yb.add(20).cast()));
                // Rows p and p + 4: 8 i32 partial sums, the first four row p's. (A macro, not
                // a closure: a closure would not inherit this function's target features.)
                macro_rules! pair {
                    ($p:expr) => {{
                        let v = _mm256_loadu_si256(sb.add(32 + 32 * $p).cast());
                        let lo = _mm256_and_si256(v, low);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                        let s = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, ylo),
                            _mm256_maddubs_epi16(hi, yhi),
                        );
                        _mm256_madd_epi16(s, ones)
                    }};
                }
                let q01 = _mm256_hadd_epi32(pair!(0), pair!(1));
                let q23 = _mm256_hadd_epi32(pair!(2), pair!(3));
                // Lane r: row r's exact block sum (rows 0..4 from the low halves, 4..8 from
                // the high halves).
                let sums = _mm256_cvtepi32_ps(_mm256_hadd_epi32(q01, q23));
                let d = _mm256_cvtph_ps(_mm_loadu_si128(sb.cast()));
                let m = _mm256_cvtph_ps(_mm_loadu_si128(sb.add(16).cast()));
                let yd = _mm_set1_epi16(yb.cast::<i16>().read_unaligned());
                let ys = _mm_set1_epi16(yb.add(2).cast::<i16>().read_unaligned());
                let dy = _mm256_cvtph_ps(yd);
                let sy = _mm256_cvtph_ps(ys);
                let lane = &mut acc[i % LANES];
                *lane = _mm256_fmadd_ps(sums, _mm256_mul_ps(d, dy), *lane);
                *lane = _mm256_fmadd_ps(m, sy, *lane);
            }
        }
        reduce(&acc)
    }

    /// The single-row reduction of one column's accumulators, for all 8 rows at once.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn reduce(acc: &[__m256; LANES]) -> [f32; GROUP] {
        let h: [__m256; 4] = std::array::from_fn(|i| _mm256_add_ps(acc[i], acc[i + 4]));
        let r = _mm256_add_ps(_mm256_add_ps(h[0], h[2]), _mm256_add_ps(h[1], h[3]));
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(r, r);
        let r = _mm256_blendv_ps(r, _mm256_set1_ps(f32::NAN), nan);
        let mut out = [0f32; GROUP];
        // SAFETY: `out` holds 8 f32.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), r) };
        out
    }

    /// See [`super::dot_group_cols`]: per superblock, four 32-byte loads split into
    /// nibbles (rows p and p + 4 of the group side by side), then per column the exact block
    /// sums of all 8 rows (`maddubs` against the broadcast activations, pairs and rows
    /// folded by `madd` and `hadd`) and the single-row product's two f32 steps into
    /// accumulator `i % LANES`, reduced as the single-row product reduces.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; `group` must be valid for `nb` superblocks and
    /// every row of `ys` for `nb` q8_1 blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_group_cols<const C: usize>(
        group: *const u8,
        ys: [*const u8; C],
        nb: usize,
    ) -> [[f32; GROUP]; C] {
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); LANES]; C];
        for i in 0..nb {
            // SAFETY: superblock i and activation block i of every column lie inside the
            // ranges the caller guarantees; every load is unaligned and inside its block.
            unsafe {
                let sb = group.add(i * SUPERBLOCK);
                super::super::simd::prefetch_ahead(sb, SUPERBLOCK);
                // Rows p and p + 4's nibbles, split once.
                macro_rules! split {
                    ($p:expr) => {{
                        let v = _mm256_loadu_si256(sb.add(32 + 32 * $p).cast());
                        (
                            _mm256_and_si256(v, low),
                            _mm256_and_si256(_mm256_srli_epi16::<4>(v), low),
                        )
                    }};
                }
                let nibbles = [split!(0), split!(1), split!(2), split!(3)];
                let d = _mm256_cvtph_ps(_mm_loadu_si128(sb.cast()));
                let m = _mm256_cvtph_ps(_mm_loadu_si128(sb.add(16).cast()));
                for (c, y) in ys.iter().enumerate() {
                    let yb = y.add(i * Q8_1_BYTES);
                    let ylo = _mm256_broadcastsi128_si256(_mm_loadu_si128(yb.add(4).cast()));
                    let yhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(yb.add(20).cast()));
                    // (A macro, not a closure: a closure would not inherit this function's
                    // target features.)
                    macro_rules! pair {
                        ($p:expr) => {{
                            let (lo, hi) = nibbles[$p];
                            let s = _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo, ylo),
                                _mm256_maddubs_epi16(hi, yhi),
                            );
                            _mm256_madd_epi16(s, ones)
                        }};
                    }
                    let q01 = _mm256_hadd_epi32(pair!(0), pair!(1));
                    let q23 = _mm256_hadd_epi32(pair!(2), pair!(3));
                    let sums = _mm256_cvtepi32_ps(_mm256_hadd_epi32(q01, q23));
                    let yd = _mm_set1_epi16(yb.cast::<i16>().read_unaligned());
                    let ysum = _mm_set1_epi16(yb.add(2).cast::<i16>().read_unaligned());
                    let dy = _mm256_cvtph_ps(yd);
                    let sy = _mm256_cvtph_ps(ysum);
                    let lane = &mut acc[c][i % LANES];
                    *lane = _mm256_fmadd_ps(sums, _mm256_mul_ps(d, dy), *lane);
                    *lane = _mm256_fmadd_ps(m, sy, *lane);
                }
            }
        }
        acc.map(|a| reduce(&a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    /// Random q4_1 bytes with moderate scales, and now and then an odd one (zero, infinity,
    /// NaN, subnormal).
    fn weights(rng: &mut Rng, rows: usize, nb: usize) -> Vec<u8> {
        let mut w = rng.bytes(rows * nb * Q4_1_BYTES);
        for b in w.chunks_exact_mut(Q4_1_BYTES) {
            for s in 0..2 {
                let bits: u16 = match rng.next() % 40 {
                    0 => 0x7C00,
                    1 => 0x7E01,
                    2 => 0x0003,
                    3 => 0,
                    _ => half::f16::from_f32((rng.next() % 2000) as f32 / 1000.0 - 1.0).to_bits(),
                };
                b[2 * s..2 * s + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        w
    }

    fn activations(rng: &mut Rng, nb: usize) -> Vec<u8> {
        let x: Vec<f32> = (0..nb * QK)
            .map(|_| (rng.next() % 20001) as f32 / 10000.0 - 1.0)
            .collect();
        let mut y = vec![0u8; nb * Q8_1_BYTES];
        DType::Q8_1.row_from_f32(&x, &mut y).unwrap();
        y
    }

    fn pack(layout: &Layout, plain: &[u8]) -> Vec<u8> {
        let mut stored = vec![0u8; layout.bytes()];
        copy_in(layout, &mut stored, 0, plain);
        stored
    }

    #[test]
    fn layout_is_a_permutation_and_ranges_map_exactly() {
        let mut rng = Rng(7);
        for (rows, nb) in [(8, 1), (16, 3), (19, 2), (5, 4), (24, 18)] {
            let layout = Layout::new(DType::Q4_1, nb * QK, rows).unwrap();
            let plain = rng.bytes(layout.bytes());
            let stored = pack(&layout, &plain);
            let mut sorted_a = plain.clone();
            let mut sorted_b = stored.clone();
            sorted_a.sort_unstable();
            sorted_b.sort_unstable();
            assert_eq!(sorted_a, sorted_b);
            // The remainder rows stay plain.
            let tail = layout.grouped_rows() * layout.row_bytes;
            assert_eq!(stored[tail..], plain[tail..]);
            let mut back = vec![0u8; layout.bytes()];
            copy_out(&layout, &stored, 0, &mut back);
            assert_eq!(back, plain);
            // Plain rows from every group start to every end.
            let rb = layout.row_bytes;
            for start in (0..=rows).step_by(GROUP) {
                for end in start..=rows {
                    let mut got = vec![0u8; (end - start) * rb];
                    plain_rows(&layout, &stored, start..end, &mut got);
                    assert_eq!(got, plain[start * rb..end * rb], "rows {start}..{end}");
                }
            }
            // Arbitrary ranges, in and out.
            for _ in 0..200 {
                let a = rng.next() as usize % layout.bytes();
                let b = a + rng.next() as usize % (layout.bytes() - a + 1);
                let mut piece = vec![0u8; b - a];
                copy_out(&layout, &stored, a, &mut piece);
                assert_eq!(piece, plain[a..b]);
                let fresh = rng.bytes(b - a);
                let mut s2 = stored.clone();
                copy_in(&layout, &mut s2, a, &fresh);
                let mut whole = vec![0u8; layout.bytes()];
                copy_out(&layout, &s2, 0, &mut whole);
                let mut expect = plain.clone();
                expect[a..b].copy_from_slice(&fresh);
                assert_eq!(whole, expect);
            }
        }
    }

    #[test]
    fn group_products_equal_single_row_products_bit_for_bit() {
        let mut rng = Rng(11);
        for nb in [1, 2, 7, 8, 9, 18, 48] {
            let layout = Layout::new(DType::Q4_1, nb * QK, 8).unwrap();
            for _ in 0..20 {
                let plain = weights(&mut rng, 8, nb);
                let stored = pack(&layout, &plain);
                let y = activations(&mut rng, nb);
                let got = dot_group(&stored, &y, nb);
                let portable = dot_group_portable(&stored, &y, nb);
                for r in 0..8 {
                    let row = &plain[r * layout.row_bytes..(r + 1) * layout.row_bytes];
                    let single = dot_legacy::dot_q4_1_q8_1_portable(row, &y);
                    assert_eq!(got[r].to_bits(), single.to_bits(), "nb {nb} row {r}");
                    assert_eq!(portable[r].to_bits(), single.to_bits());
                }
            }
        }
    }

    /// Several columns at once give each column's single-column bits, portable or SIMD.
    #[test]
    fn column_groups_equal_single_column_products_bit_for_bit() {
        let mut rng = Rng(12);
        for nb in [1, 3, 8, 9, 18] {
            let layout = Layout::new(DType::Q4_1, nb * QK, 8).unwrap();
            for _ in 0..10 {
                let stored = pack(&layout, &weights(&mut rng, 8, nb));
                let ys: [Vec<u8>; 4] = std::array::from_fn(|_| activations(&mut rng, nb));
                let two = dot_group_cols(&stored, [&ys[0][..], &ys[1][..]], nb);
                let four = dot_group_cols(&stored, ys.each_ref().map(|y| &y[..]), nb);
                for (c, y) in ys.iter().enumerate() {
                    let single = dot_group(&stored, y, nb);
                    let portable = dot_group_portable(&stored, y, nb);
                    let bits = |v: [f32; GROUP]| v.map(f32::to_bits);
                    assert_eq!(bits(four[c]), bits(single), "nb {nb} column {c}");
                    assert_eq!(bits(four[c]), bits(portable), "nb {nb} column {c}");
                    if c < 2 {
                        assert_eq!(bits(two[c]), bits(single));
                    }
                }
            }
        }
    }

    #[test]
    fn slots_and_rows_are_inverse() {
        for (t, &r) in SLOT_ROWS.iter().enumerate() {
            assert_eq!(slot_of(r), t);
        }
    }

    #[test]
    fn only_q4_1_rows_of_whole_blocks_interleave() {
        assert!(Layout::new(DType::Q4_1, 64, 3).is_some());
        assert!(Layout::new(DType::Q4_1, 48, 8).is_none());
        assert!(Layout::new(DType::Q8_0, 64, 8).is_none());
        assert!(Layout::new(DType::F32, 64, 8).is_none());
    }
}
