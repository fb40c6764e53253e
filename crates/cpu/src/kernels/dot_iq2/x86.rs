//! AVX2 + FMA + F16C versions of the 2-bit i-quant dot products.
//!
//! Per 32-value sub-block, the four lattice points (8 magnitude bytes each, `0..=43`) are
//! read from the tables into one vector (four 64-bit loads, two unpacks and one 128-bit
//! insert), the four sign bytes expanded to `±1` bytes (iq2_xxs, iq2_xs: tables of the 7-bit sign
//! indices computed at compile time, assembled the same way; iq2_s: its stored sign bytes
//! spread by `vpshufb` and compared with the bit masks), and the exact integer sums of the portable definition formed with
//! `vpmaddubsw` (unsigned bytes × signed bytes, adjacent pairs summed to i16) and `vpmaddwd`
//! (i16 × odd scale, adjacent pairs summed to i32). The fields of a super-block are read with
//! whole-word loads (one 64-bit load per iq2_xxs sub-block, one per four iq2_xs indices), the
//! odd scales of iq2_xs and iq2_s are formed once per super-block as 16 bytes and each
//! sub-block's pair picked out with one `vpshufb`, and the eight sub-blocks are written out
//! (so their constants fold), alternating between two accumulators. The i32 lanes are summed to `isum` and the very same f32 steps
//! as the portable code ([`super::step`], [`super::finish`]) run on it, so the results are
//! bit-identical.
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

use super::super::block_x86::{bit_mask, hsum, lanes, ld256, q8_d, scale_at0, u32_at, u64_at};
use super::super::simd::prefetch_ahead;
use super::{finish, step};
use crate::quant::iq2::grids::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID};
use crate::quant::iq2::{sign_byte, IQ2_S_BYTES, IQ2_XS_BYTES, IQ2_XXS_BYTES};
use crate::quant::kquants::Q8_K_BYTES;

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

/// `Σ w·y` as 16 i16 pair sums over 32 values, given the 32 magnitudes, their ±1 signs and
/// the activations (see the module docs for exactness).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signed_pairs(mags: __m256i, signs: __m256i, y: __m256i) -> __m256i {
    let sy = _mm256_sign_epi8(signs, y);
    _mm256_maddubs_epi16(_mm256_abs_epi8(y), _mm256_sign_epi8(mags, sy))
}

/// The odd scales `2·s + 1` of the 16 nibbles of `packed` (low nibble first), as 16 bytes in
/// both 128-bit lanes: byte `g` (of each lane) is the odd scale of 16-value group `g`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn odd_scale_bytes(packed: u64) -> __m256i {
    let v = _mm_cvtsi64_si128(packed as i64);
    let nib = _mm_set1_epi8(15);
    let lo = _mm_and_si128(v, nib);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), nib);
    let s = _mm_unpacklo_epi8(lo, hi);
    let odd = _mm_or_si128(_mm_add_epi8(s, s), _mm_set1_epi8(1));
    _mm256_broadcastsi128_si256(odd)
}

/// The i16 multipliers of sub-block `k` from [`odd_scale_bytes`]: the odd scale of group `2k`
/// in every i16 of the low 128-bit lane (the sub-block's first 16 values), that of group
/// `2k + 1` in the high lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sub_scales(bytes: __m256i, k: usize) -> __m256i {
    let (a, b) = ((2 * k) as i8, (2 * k + 1) as i8);
    let z = -128i8;
    let pick = _mm256_setr_epi8(
        a, z, a, z, a, z, a, z, a, z, a, z, a, z, a, z, //
        b, z, b, z, b, z, b, z, b, z, b, z, b, z, b, z,
    );
    _mm256_shuffle_epi8(bytes, pick)
}

/// Byte `j` of each 64-bit lane is `0xFF` when bit `j` of the lane's byte of `signs` (lane
/// `l` takes byte `l`) is set, else `+1`: the ±1 signs of four runs given their sign bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn spread_signs(signs: u32) -> __m256i {
    _mm256_or_si256(bit_mask(signs), _mm256_set1_epi8(1))
}

/// `Σ_k f(k)` over a super-block's 8 sub-blocks (each spread over 8 i32 lanes), reduced to
/// one exact sum: written out so that every sub-block's constants fold, two accumulators.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sub_block_sum(f: impl Fn(usize) -> __m256i) -> i32 {
    let s0 = _mm256_add_epi32(_mm256_add_epi32(f(0), f(2)), _mm256_add_epi32(f(4), f(6)));
    let s1 = _mm256_add_epi32(_mm256_add_epi32(f(1), f(3)), _mm256_add_epi32(f(5), f(7)));
    hsum(_mm256_add_epi32(s0, s1))
}

/// `ls·Σ w·y` of iq2_xxs sub-block `k`, spread over 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn xxs_sub(bx: &[u8; IQ2_XXS_BYTES], by: &[u8; Q8_K_BYTES], k: usize) -> __m256i {
    // Four index bytes, then the word of signs and scale.
    let q = u64_at(bx, 2 + 8 * k);
    let w = (q >> 32) as u32;
    let g = |l: usize| IQ2XXS_GRID[usize::from((q >> (8 * l)) as u8)];
    let s = |l: usize| INDEX_SIGN_MASKS[((w >> (7 * l)) & 127) as usize];
    let mags = lanes(g(0), g(1), g(2), g(3));
    let signs = lanes(s(0), s(1), s(2), s(3));
    let p = signed_pairs(mags, signs, ld256(by, 4 + 32 * k));
    // `w >> 27` is `2·(w >> 28)` plus bit 27; setting bit 0 gives the odd scale.
    let ls = ((w >> 27) | 1) as i16;
    _mm256_madd_epi16(p, _mm256_set1_epi16(ls))
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
        let isum = sub_block_sum(|k| xxs_sub(bx, by, k));
        acc = step(acc, scale_at0(bx), q8_d(by), isum);
    }
    finish(acc)
}

/// `Σ_g ls_g·Σ w·y` of iq2_xs sub-block `k`, spread over 8 i32 lanes (`scales` from
/// [`odd_scale_bytes`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn xs_sub(bx: &[u8; IQ2_XS_BYTES], by: &[u8; Q8_K_BYTES], scales: __m256i, k: usize) -> __m256i {
    // The four u16 of the sub-block's runs: 9-bit lattice index, 7-bit sign index.
    let q = u64_at(bx, 2 + 8 * k);
    let g = |l: usize| IQ2XS_GRID[((q >> (16 * l)) & 511) as usize];
    let s = |l: usize| INDEX_SIGN_MASKS[((q >> (16 * l + 9)) & 127) as usize];
    let mags = lanes(g(0), g(1), g(2), g(3));
    let signs = lanes(s(0), s(1), s(2), s(3));
    let p = signed_pairs(mags, signs, ld256(by, 4 + 32 * k));
    _mm256_madd_epi16(p, sub_scales(scales, k))
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
        let scales = odd_scale_bytes(u64_at(bx, 66));
        let isum = sub_block_sum(|k| xs_sub(bx, by, scales, k));
        acc = step(acc, scale_at0(bx), q8_d(by), isum);
    }
    finish(acc)
}

/// `Σ_g ls_g·Σ w·y` of iq2_s sub-block `k`, spread over 8 i32 lanes (`scales` from
/// [`odd_scale_bytes`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn s_sub(bx: &[u8; IQ2_S_BYTES], by: &[u8; Q8_K_BYTES], scales: __m256i, k: usize) -> __m256i {
    let idx = u32_at(bx, 2 + 4 * k);
    let qh = u32::from(bx[66 + k]);
    let g = |l: usize| {
        let index = ((idx >> (8 * l)) & 255) | (((qh >> (2 * l)) & 3) << 8);
        IQ2S_GRID[index as usize]
    };
    let mags = lanes(g(0), g(1), g(2), g(3));
    let signs = spread_signs(u32_at(bx, 34 + 4 * k));
    let p = signed_pairs(mags, signs, ld256(by, 4 + 32 * k));
    _mm256_madd_epi16(p, sub_scales(scales, k))
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
        let scales = odd_scale_bytes(u64_at(bx, 74));
        let isum = sub_block_sum(|k| s_sub(bx, by, scales, k));
        acc = step(acc, scale_at0(bx), q8_d(by), isum);
    }
    finish(acc)
}
