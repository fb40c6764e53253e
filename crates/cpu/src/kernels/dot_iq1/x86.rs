//! AVX2 + FMA + F16C versions of the iq1_s and iq1_m dot products.
//!
//! Per 32 values, the 4 grid points are read from the expanded grid table (one `u64` per
//! point, bytes = coordinates `−1..=1` as i8) into a vector and the products with the
//! activations formed as `vpmaddubsw(|y|, vpsignb(g, y))` (the sign of `y` moves onto the
//! coordinate, `|y|` is the unsigned operand; `vpabsb(−128)` is `0x80`, read as 128). Each
//! adjacent pair sum is at most `2·128 = 256` in magnitude, so nothing saturates, and
//! `vpmaddwd` with the odd scales (`≤ 15`) gives exact i32 pairs. iq1_m's shift sums
//! `Σ σ_r·y_v` are formed the same way with a vector of `±1` bytes in place of the grid.
//! iq1_s's shift term uses the stored q8_K group sums, in scalar code as the definition
//! does. The lane sums stay far inside i32 (module docs of [`super`]); they are reduced to
//! the definition's exact `isum` and `msum` and the very same f32 step ([`super::step`])
//! runs on them, so the results are bit-identical to the portable functions.

use std::arch::x86_64::*;

use super::super::simd::{f16_to_f32, prefetch_ahead};
use super::step;
use crate::quant::iq1::{iq1_m_scale, IQ1_GRID, IQ1_M_BYTES, IQ1_S_BYTES};
use crate::quant::kquants::Q8_K_BYTES;

/// Whether this CPU runs the kernels of this module (AVX2, FMA and F16C).
pub(super) fn supported() -> bool {
    crate::isa::get().avx2_fma_f16c()
}

/// The 32 bytes of `b` at `at` (checked).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld256<const N: usize>(b: &[u8; N], at: usize) -> __m256i {
    assert!(at + 32 <= N);
    // SAFETY: the 32 bytes at `at` lie inside `b` (checked above); loadu has no alignment
    // requirement.
    unsafe { _mm256_loadu_si256(b.as_ptr().add(at).cast()) }
}

/// The q8_K scale of a super-block.
#[inline(always)]
fn q8_d(by: &[u8; Q8_K_BYTES]) -> f32 {
    f32::from_le_bytes([by[0], by[1], by[2], by[3]])
}

/// The sum of the 8 i32 lanes (wrapping adds; exact because the sums are bounded).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// The 4 grid points of indices `i0..i3` as one vector (point `j` in bytes `8j..8j + 8`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn points(i: [usize; 4]) -> __m256i {
    let p = |j: usize| IQ1_GRID[i[j] & 2047] as i64;
    _mm256_setr_epi64x(p(0), p(1), p(2), p(3))
}

/// `Σ` over adjacent pairs of `w·y` (16 i16 lanes, exact: `|w| ≤ 1`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pair_dots(w: __m256i, y: __m256i) -> __m256i {
    _mm256_maddubs_epi16(_mm256_abs_epi8(y), _mm256_sign_epi8(w, y))
}

/// iq1_s · q8_K ([`super::dot_iq1_s`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn iq1_s(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<IQ1_S_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx.as_ptr(), IQ1_S_BYTES);
        let mut sum = _mm256_setzero_si256();
        let mut msum = 0i32;
        for s in 0..8 {
            let h = u16::from_le_bytes([bx[34 + 2 * s], bx[35 + 2 * s]]);
            let idx =
                |l: usize| usize::from(bx[2 + 4 * s + l]) | (usize::from(h >> (3 * l) & 7) << 8);
            let grid = points([idx(0), idx(1), idx(2), idx(3)]);
            let ls = 2 * ((h >> 12) & 7) as i16 + 1;
            let p = pair_dots(grid, ld256(by, 4 + 32 * s));
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, _mm256_set1_epi16(ls)));
            let bs = |k: usize| i32::from(i16::from_le_bytes([by[260 + 2 * k], by[261 + 2 * k]]));
            let pair = bs(2 * s) + bs(2 * s + 1);
            let l = i32::from(ls);
            msum += if h & 0x8000 != 0 { -l * pair } else { l * pair };
        }
        let dx = f16_to_f32(u16::from_le_bytes([bx[0], bx[1]]));
        acc = step(acc, dx, q8_d(by), hsum(sum), msum);
    }
    acc
}

/// iq1_m · q8_K ([`super::dot_iq1_m`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn iq1_m(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<IQ1_M_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx.as_ptr(), IQ1_M_BYTES);
        let mut isum = _mm256_setzero_si256();
        let mut msum = _mm256_setzero_si256();
        for c in 0..8 {
            // Runs 4c..4c + 4; their nibbles are the low and high halves of qh[2c], qh[2c + 1].
            let nib = |r: usize| bx[32 + 2 * c + r / 2] >> (4 * (r % 2));
            let idx = |r: usize| usize::from(bx[4 * c + r]) | (usize::from(nib(r) & 7) << 8);
            let grid = points([idx(0), idx(1), idx(2), idx(3)]);
            let shift = |r: usize| -> i64 {
                if nib(r) & 8 != 0 {
                    -1
                } else {
                    0x0101_0101_0101_0101
                }
            };
            let signs = _mm256_setr_epi64x(shift(0), shift(1), shift(2), shift(3));
            // Half sub-blocks 2c (low 128 bits) and 2c + 1 (high 128 bits).
            let ls = |h: usize| {
                let w = u16::from_le_bytes([bx[48 + 2 * (h / 4)], bx[49 + 2 * (h / 4)]]);
                2 * ((w >> (3 * (h % 4))) & 7) as i16 + 1
            };
            let lsv = _mm256_setr_m128i(_mm_set1_epi16(ls(2 * c)), _mm_set1_epi16(ls(2 * c + 1)));
            let yv = ld256(by, 4 + 32 * c);
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pair_dots(grid, yv), lsv));
            msum = _mm256_add_epi32(msum, _mm256_madd_epi16(pair_dots(signs, yv), lsv));
        }
        let dx = f16_to_f32(iq1_m_scale(bx).to_bits());
        acc = step(acc, dx, q8_d(by), hsum(isum), hsum(msum));
    }
    acc
}
