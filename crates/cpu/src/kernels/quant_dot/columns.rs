//! Products of one q8_0 or q4_0 weight row with several activation rows at once (a handful of
//! sequences decoding together, a short prompt): each weight block is loaded — and a q4_0
//! block unpacked — once for every column, instead of once per column.
//!
//! Every column takes exactly the steps of the single-row kernel it stands beside, so its bits
//! are that kernel's: [`q8_0_cols`] those of the AVX2 q8_0 · q8_0 product (four accumulators of
//! eight lanes, one block each per step of four, the same exact integer lane sums, the same
//! scale products and multiply-adds, the same final sum), [`q4_0_pairs_cols`] those of the
//! prepared-pairs q4_0 mat-vec ([`super::dot_q4_0_pairs`]). Both need AVX-512F/BW with VNNI
//! (and F16C, AVX2, FMA).

use std::arch::x86_64::*;

use super::x86::{hsum, q4_0_pair, reduce16};
use super::{PAIR_BYTES, Q4_0_BYTES, Q8_0_BYTES};
use crate::kernels::block_dot::common_blocks;
use crate::kernels::simd::prefetch_ahead;

/// The 32 quant bytes of q8_0 block `j` at `p` (blocks `Q8_0_BYTES` apart) in the low half of
/// a 512-bit vector, those of block `j + 1` in the high half when `both`, else zeros.
///
/// # Safety
/// Block `j` (and `j + 1` when `both`) must lie in readable memory; AVX-512F.
#[inline(always)]
unsafe fn block_pair(p: *const u8, j: usize, both: bool) -> __m512i {
    // SAFETY: forwarded from the caller.
    unsafe {
        let lo = _mm256_loadu_si256(p.add(j * Q8_0_BYTES + 2).cast());
        let hi = if both {
            _mm256_loadu_si256(p.add((j + 1) * Q8_0_BYTES + 2).cast())
        } else {
            _mm256_setzero_si256()
        };
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }
}

/// The f16 scales of the first `count` (≤ 4) q8_0 blocks at `p` as one 64-bit word, block
/// `j` in bits `16j..16j + 16` (zero for the missing blocks).
///
/// # Safety
/// The first `count` blocks at `p` must lie in readable memory.
#[inline(always)]
unsafe fn scales(p: *const u8, count: usize) -> i64 {
    let mut word = 0u64;
    for j in 0..count {
        // SAFETY: block j < count lies in readable memory (the caller's contract).
        let d = unsafe { p.add(j * Q8_0_BYTES).cast::<u16>().read_unaligned() };
        word |= u64::from(d) << (16 * j);
    }
    word as i64
}

/// `C` q8_0 · q8_0 products of the weight row `a` with the activation rows `ys` (rows of the
/// same block count): column `c` has the bits of the AVX2 single-row product of `a` and
/// `ys[c]`.
///
/// That kernel keeps four accumulators of eight lanes, block `i + j` of a step of four going
/// to accumulator `j`; here accumulators 0 and 1 are the halves of one 512-bit register and 2
/// and 3 of another, so one `vpdpbusd` gives a column the exact lane sums of two blocks. The
/// signed-by-signed byte products come from the unsigned-by-signed instruction by offsetting
/// the activations by 128 (`y ^ 0x80`) and starting each lane from `−128 ·` the sum of its
/// four weight bytes, computed once per weight block for every column; the sums are exact, so
/// equal to the single-row kernel's. The scale products, multiply-adds (masked to the blocks
/// present in the last step) and the final sum (`(acc0 + acc1) + (acc2 + acc3)`, then the
/// same horizontal sum) are that kernel's operations in its order.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q8_0_cols<const C: usize>(a: &[u8], ys: [&[u8]; C]) -> [f32; C] {
    let n = common_blocks(a, Q8_0_BYTES, &ys, Q8_0_BYTES);
    let flip = _mm512_set1_epi8(i8::MIN);
    let zero = _mm512_setzero_si512();
    // Lanes of the four scale products for the two halves of each register.
    let lanes01 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let lanes23 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    let mut acc01 = [_mm512_setzero_ps(); C];
    let mut acc23 = [_mm512_setzero_ps(); C];
    let pa = a.as_ptr();
    let mut i = 0;
    while i < n {
        let count = (n - i).min(4);
        // Blocks present in this step: accumulators 0-1, then 2-3.
        let (mask01, mask23): (__mmask16, __mmask16) = match count {
            4 => (0xFFFF, 0xFFFF),
            3 => (0xFFFF, 0x00FF),
            2 => (0xFFFF, 0),
            _ => (0x00FF, 0),
        };
        // SAFETY: blocks i..i + count lie inside `a` and every row of `ys` (count ≤ n − i);
        // the features are the function's.
        unsafe {
            let xs = pa.add(i * Q8_0_BYTES);
            prefetch_ahead(xs, 4 * Q8_0_BYTES);
            let w01 = block_pair(xs, 0, count >= 2);
            let w23 = if count >= 3 {
                block_pair(xs, 2, count == 4)
            } else {
                zero
            };
            // −128 · (sum of each lane's four weight bytes): the activations' offset, undone.
            let fix01 = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, flip, w01));
            let fix23 = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, flip, w23));
            let dx = _mm_cvtph_ps(_mm_cvtsi64_si128(scales(xs, count)));
            for c in 0..C {
                let yp = ys[c].as_ptr().add(i * Q8_0_BYTES);
                let dy = _mm_cvtph_ps(_mm_cvtsi64_si128(scales(yp, count)));
                let d = _mm512_castps128_ps512(_mm_mul_ps(dx, dy));
                let y01 = _mm512_xor_si512(block_pair(yp, 0, count >= 2), flip);
                let s01 = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(fix01, y01, w01));
                let d01 = _mm512_permutexvar_ps(lanes01, d);
                acc01[c] = _mm512_mask3_fmadd_ps(d01, s01, acc01[c], mask01);
                if count >= 3 {
                    let y23 = _mm512_xor_si512(block_pair(yp, 2, count == 4), flip);
                    let s23 = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(fix23, y23, w23));
                    let d23 = _mm512_permutexvar_ps(lanes23, d);
                    acc23[c] = _mm512_mask3_fmadd_ps(d23, s23, acc23[c], mask23);
                }
            }
        }
        i += count;
    }
    let mut out = [0f32; C];
    for c in 0..C {
        // SAFETY: AVX2 and FMA, which this function requires.
        out[c] = unsafe { hsum(_mm256_add_ps(halves(acc01[c]), halves(acc23[c]))) };
    }
    out
}

/// The sum of a register's two 256-bit halves, low plus high: the single-row kernel's
/// `acc0 + acc1` (or `acc2 + acc3`) in its operand order.
#[inline]
#[target_feature(enable = "avx512f,avx")]
fn halves(v: __m512) -> __m256 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    _mm256_add_ps(lo, hi)
}

/// `C` q4_0 mat-vec products of the weight row `a` with activation rows prepared by
/// [`super::prepare_q4_pairs`]: each pair of blocks is unpacked and its scales converted once,
/// then every column takes the 512-bit pairs kernel's steps (one `vpdpbusd` from the prepared
/// offset corrections, one multiply-add by the scale products, the same 16-lane sum), so
/// column `c` has the bits of [`super::dot_q4_0_pairs`] with `ys[c]`.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VNNI, AVX2 and F16C; every row of `ys` holds
/// `ceil(nb / 2)` prepared pairs for the `nb` blocks of `a`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) unsafe fn q4_0_pairs_cols<const C: usize>(a: &[u8], ys: [&[u8]; C]) -> [f32; C] {
    let nb = a.len() / Q4_0_BYTES;
    let low = _mm256_set1_epi8(0x0f);
    let spread = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    let mut acc = [_mm512_setzero_ps(); C];
    let pa = a.as_ptr();
    for p in 0..nb.div_ceil(2) {
        let b = 2 * p;
        let both = b + 1 < nb;
        // SAFETY: block b (and b + 1 when `both`) lies inside `a`, pair p inside every row of
        // `ys` (the caller's contract); the features are the function's.
        unsafe {
            prefetch_ahead(pa.add(b * Q4_0_BYTES), 2 * Q4_0_BYTES);
            let (lo, hi, d0, d1) = q4_0_pair!(pa, b, both, low);
            let nibbles = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            let dx2 = _mm_cvtph_ps(_mm_cvtsi32_si128((d0 | (d1 << 16)) as i32));
            let dx = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(dx2));
            for c in 0..C {
                let pair = ys[c].as_ptr().add(p * PAIR_BYTES);
                let quants = _mm512_loadu_si512(pair.cast());
                let comp = _mm512_loadu_si512(pair.add(64).cast());
                let dy = _mm512_loadu_ps(pair.add(128).cast());
                let sums = _mm512_dpbusd_epi32(comp, nibbles, quants);
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(dx, dy), acc[c]);
            }
        }
    }
    let mut out = [0f32; C];
    for c in 0..C {
        out[c] = reduce16(acc[c]);
    }
    out
}
