//! AVX2 + FMA + F16C versions of the iq3_xxs and iq3_s dot products.
//!
//! Per sub-block of 32 values, the 8 grid points are read from the expanded grid table
//! (one `u32` per point, bytes = unsigned coordinates) into a vector, the 32 sign bits are
//! spread to a byte mask (`0xFF` = negative) and applied (`(g ^ m) − m`), and the products
//! with the activations are formed as `vpmaddubsw(|y|, vpsignb(±g, y))`: the sign of `y`
//! moves onto the weight (`|±g| ≤ 62`, so its negation is exact) and `|y|` becomes the
//! unsigned operand (`vpabsb(−128)` is the byte `0x80`, read as 128). Each adjacent pair sum
//! is at most `2·128·62 = 15872` in magnitude, inside i16, so nothing saturates. `vpmaddwd`
//! with the sub-block's odd scale (`≤ 31`) then gives exact i32 pairs, and the lane sums over
//! the 8 sub-blocks stay below `2²⁶` (the definition's bound, module docs of [`super`]).
//! The lanes are reduced to the exact `isum` of the definition and the very same f32 step
//! ([`super::step`]) runs on it, so the results are bit-identical to the portable functions.

use std::arch::x86_64::*;

use super::super::block_x86::{bit_mask, hsum, ld256, q8_d, scale_at0, u32_at};
use super::super::simd::prefetch_ahead;
use super::{iq3_xxs_finish, step};
use crate::quant::iq3::{sign_byte, IQ3_S_BYTES, IQ3_S_GRID, IQ3_XXS_BYTES, IQ3_XXS_GRID};
use crate::quant::kquants::Q8_K_BYTES;

/// The 128 iq3_xxs sign bytes ([`sign_byte`] of every 7-bit index), computed at compile
/// time.
static SIGN_BYTES: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = sign_byte(i as u32);
        i += 1;
    }
    t
};

/// `ls·Σ (±g)·y` of one sub-block, spread over 8 i32 lanes: `grid` holds the unsigned
/// coordinates, `neg` the sign mask, `y` the 32 activation quants.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scaled_dot32(grid: __m256i, neg: __m256i, y: __m256i, ls: i16) -> __m256i {
    let q = _mm256_sub_epi8(_mm256_xor_si256(grid, neg), neg);
    let p = _mm256_maddubs_epi16(_mm256_abs_epi8(y), _mm256_sign_epi8(q, y));
    _mm256_madd_epi16(p, _mm256_set1_epi16(ls))
}

/// The 8 grid points `table[index(j)]`, `j = 0..8`, as one vector (point `j` in lanes
/// `j`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn points(table: &[u32], index: impl Fn(usize) -> usize) -> __m256i {
    let p = |j: usize| table[index(j)] as i32;
    _mm256_setr_epi32(p(0), p(1), p(2), p(3), p(4), p(5), p(6), p(7))
}

/// iq3_xxs · q8_K ([`super::dot_iq3_xxs`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn iq3_xxs(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<IQ3_XXS_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx.as_ptr(), IQ3_XXS_BYTES);
        let sub = |s: usize| {
            let w = u32_at(bx, 66 + 4 * s);
            let sb = |l: usize| u32::from(SIGN_BYTES[((w >> (7 * l)) & 0x7F) as usize]);
            let signs = sb(0) | sb(1) << 8 | sb(2) << 16 | sb(3) << 24;
            let grid = points(&IQ3_XXS_GRID, |j| usize::from(bx[2 + 8 * s + j]));
            let ls = ((w >> 27) | 1) as i16;
            scaled_dot32(grid, bit_mask(signs), ld256(by, 4 + 32 * s), ls)
        };
        // Written out (constants fold), two accumulators.
        let s0 = _mm256_add_epi32(
            _mm256_add_epi32(sub(0), sub(2)),
            _mm256_add_epi32(sub(4), sub(6)),
        );
        let s1 = _mm256_add_epi32(
            _mm256_add_epi32(sub(1), sub(3)),
            _mm256_add_epi32(sub(5), sub(7)),
        );
        acc = step(acc, scale_at0(bx), q8_d(by), hsum(_mm256_add_epi32(s0, s1)));
    }
    iq3_xxs_finish(acc)
}

/// iq3_s · q8_K ([`super::dot_iq3_s`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn iq3_s(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<IQ3_S_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx.as_ptr(), IQ3_S_BYTES);
        let mut sum = _mm256_setzero_si256();
        for s in 0..8 {
            let qh = usize::from(bx[66 + s]);
            let grid = points(&IQ3_S_GRID, |j| {
                usize::from(bx[2 + 8 * s + j]) | ((qh >> j & 1) << 8)
            });
            let ls = 2 * i16::from(bx[106 + s / 2] >> (4 * (s % 2)) & 15) + 1;
            let signs = u32_at(bx, 74 + 4 * s);
            let d = scaled_dot32(grid, bit_mask(signs), ld256(by, 4 + 32 * s), ls);
            sum = _mm256_add_epi32(sum, d);
        }
        acc = step(acc, scale_at0(bx), q8_d(by), hsum(sum));
    }
    acc
}
