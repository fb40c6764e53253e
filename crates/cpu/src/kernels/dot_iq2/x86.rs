//! AVX2 + FMA + F16C versions of the 2-bit i-quant dot products.
//!
//! Per 32-value sub-block, the four lattice points (8 magnitude bytes each, `0..=43`) are
//! gathered from the tables into one vector, the four sign bytes expanded to `±1` bytes by a
//! table computed at compile time, and the exact integer sums of the portable definition
//! formed with `vpmaddubsw` (unsigned bytes × signed bytes, adjacent pairs summed to i16) and
//! `vpmaddwd` (i16 × odd scale, adjacent pairs summed to i32). The i32 lanes are summed to
//! `isum` and the very same f32 steps as the portable code ([`super::step`],
//! [`super::finish`]) run on it, so the results are bit-identical.
//!
//! # Why the byte and i16 stages are exact
//!
//! The signed weight `w = ±m` and the activation `y` (`−128..=127`) are both signed, and
//! `vpmaddubsw` needs one unsigned operand. Negating `y` in bytes would wrap for `−128`, so
//! instead the unsigned operand is `|y|` (`vpabsb(−128)` is the byte `0x80`, read as 128) and
//! the signed one is `m·σ·sgn(y)` (`σ` the ±1 sign), formed by two `vpsignb`: first
//! `σ·sgn(y)` (in `−1..=1`), then `m` with that sign (`m ≤ 43`, so no wrap). Their product is
//! `|y|·m·σ·sgn(y) = w·y` exactly, and a pair sum is at most `2·128·43 = 11008 < 2¹⁵`, so
//! `vpmaddubsw` never saturates. `vpmaddwd` with `ls ≤ 31` gives pair sums up to
//! `2·11008·31 = 682 496`, and every i32 lane is a partial sum of `isum`, whose magnitude is
//! below `2²⁶` (module docs of [`super`]): the wrapping i32 adds never wrap.

use std::arch::x86_64::*;

use super::super::simd::prefetch_ahead;
use super::{finish, step};
use crate::quant::f16_at;
use crate::quant::iq2::grids::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID};
use crate::quant::iq2::{sign_byte, IQ2_S_BYTES, IQ2_XS_BYTES, IQ2_XXS_BYTES};
use crate::quant::kquants::Q8_K_BYTES;

/// Whether this CPU runs the kernels of this module (AVX2, FMA and F16C).
pub(super) fn supported() -> bool {
    crate::isa::get().avx2_fma_f16c()
}

/// Byte `j` of the result is `−1` (`0xFF`) if bit `j` of `bits` is set, else `+1`.
const fn sign_mask(bits: u8) -> u64 {
    let mut out = 0u64;
    let mut j = 0;
    while j < 8 {
        let byte: u64 = if (bits >> j) & 1 != 0 { 0xFF } else { 0x01 };
        out |= byte << (8 * j);
        j += 1;
    }
    out
}

/// The ±1 bytes of every sign byte (iq2_s stores sign bytes directly).
static SIGN_MASKS: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = sign_mask(i as u8);
        i += 1;
    }
    t
};

/// The ±1 bytes of every 7-bit sign index (iq2_xxs, iq2_xs): the mask of its sign byte with
/// the parity bit.
static INDEX_SIGN_MASKS: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = sign_mask(sign_byte(i as u32));
        i += 1;
    }
    t
};

/// The 32 bytes of `b` at `at` (checked; `at` is a constant or loop-bounded at every call).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld256<const N: usize>(b: &[u8; N], at: usize) -> __m256i {
    assert!(at + 32 <= N);
    // SAFETY: the 32 bytes at `at` lie inside `b` (checked above); loadu has no alignment
    // requirement.
    unsafe { _mm256_loadu_si256(b.as_ptr().add(at).cast()) }
}

/// The little-endian u16 at byte `at` of `b`.
#[inline(always)]
fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The little-endian u32 at byte `at` of `b`.
#[inline(always)]
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The q8_K scale of a super-block.
#[inline(always)]
fn q8_d(by: &[u8; Q8_K_BYTES]) -> f32 {
    f32::from_le_bytes([by[0], by[1], by[2], by[3]])
}

/// Four u64 as the four 64-bit lanes of a vector, the first in the lowest.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lanes(a: u64, b: u64, c: u64, d: u64) -> __m256i {
    _mm256_setr_epi64x(a as i64, b as i64, c as i64, d as i64)
}

/// `Σ w·y` as 16 i16 pair sums over 32 values, given the 32 magnitudes, their ±1 signs and
/// the activations (see the module docs for exactness).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signed_pairs(mags: __m256i, signs: __m256i, y: __m256i) -> __m256i {
    let sy = _mm256_sign_epi8(signs, y);
    _mm256_maddubs_epi16(_mm256_abs_epi8(y), _mm256_sign_epi8(mags, sy))
}

/// The odd scales of two 16-value groups, as i16: `2·lo + 1` in the low 128-bit lane (the
/// first 16 values of a sub-block), `2·hi + 1` in the high lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn odd_scales(lo: u8, hi: u8) -> __m256i {
    let odd = |s: u8| 2 * i16::from(s) + 1;
    _mm256_setr_m128i(_mm_set1_epi16(odd(lo)), _mm_set1_epi16(odd(hi)))
}

/// The sum of the 8 i32 lanes (exact: the lanes are partial sums of a bounded `isum`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s));
    _mm_cvtsi128_si32(s)
}

/// iq2_xxs · q8_K ([`super::dot_iq2_xxs`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn iq2_xxs(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<IQ2_XXS_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx.as_ptr(), IQ2_XXS_BYTES);
        let mut sumi = _mm256_setzero_si256();
        for k in 0..8 {
            let at = 2 + 8 * k;
            let g = |l: usize| IQ2XXS_GRID[usize::from(bx[at + l])];
            let w = u32_at(bx, at + 4);
            let s = |l: usize| INDEX_SIGN_MASKS[((w >> (7 * l)) & 127) as usize];
            let mags = lanes(g(0), g(1), g(2), g(3));
            let signs = lanes(s(0), s(1), s(2), s(3));
            let p = signed_pairs(mags, signs, ld256(by, 4 + 32 * k));
            let ls = (2 * (w >> 28) + 1) as i16;
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_set1_epi16(ls)));
        }
        acc = step(acc, f16_at(bx, 0), q8_d(by), hsum(sumi));
    }
    finish(acc)
}

/// iq2_xs · q8_K ([`super::dot_iq2_xs`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn iq2_xs(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<IQ2_XS_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx.as_ptr(), IQ2_XS_BYTES);
        let mut sumi = _mm256_setzero_si256();
        for k in 0..8 {
            let q = |l: usize| u16_at(bx, 2 + 8 * k + 2 * l);
            let g = |l: usize| IQ2XS_GRID[usize::from(q(l) & 511)];
            let s = |l: usize| INDEX_SIGN_MASKS[usize::from(q(l) >> 9)];
            let mags = lanes(g(0), g(1), g(2), g(3));
            let signs = lanes(s(0), s(1), s(2), s(3));
            let p = signed_pairs(mags, signs, ld256(by, 4 + 32 * k));
            let sc = bx[66 + k];
            let ls = odd_scales(sc & 15, sc >> 4);
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, ls));
        }
        acc = step(acc, f16_at(bx, 0), q8_d(by), hsum(sumi));
    }
    finish(acc)
}

/// iq2_s · q8_K ([`super::dot_iq2_s`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn iq2_s(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<IQ2_S_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx.as_ptr(), IQ2_S_BYTES);
        let mut sumi = _mm256_setzero_si256();
        for k in 0..8 {
            let qh = usize::from(bx[66 + k]);
            let g = |l: usize| {
                let index = usize::from(bx[2 + 4 * k + l]) | (((qh >> (2 * l)) & 3) << 8);
                IQ2S_GRID[index]
            };
            let s = |l: usize| SIGN_MASKS[usize::from(bx[34 + 4 * k + l])];
            let mags = lanes(g(0), g(1), g(2), g(3));
            let signs = lanes(s(0), s(1), s(2), s(3));
            let p = signed_pairs(mags, signs, ld256(by, 4 + 32 * k));
            let sc = bx[74 + k];
            let ls = odd_scales(sc & 15, sc >> 4);
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, ls));
        }
        acc = step(acc, f16_at(bx, 0), q8_d(by), hsum(sumi));
    }
    finish(acc)
}
