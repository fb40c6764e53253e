//! AVX2 + FMA + F16C versions of the iq1_s and iq1_m dot products.
//!
//! The 32 grid indices of a super-block are assembled in i32 vector lanes (low bits from
//! `qs`, top bits shifted out of `qh` with `vpsrlvd`), taken out two per `u64` and the 4
//! grid points of 32 values read from the expanded grid table (one `u64` per point, bytes =
//! coordinates `−1..=1` as i8) into a vector. Products with the activations are
//! `vpmaddubsw(|y|, vpsignb(w, y))` (the sign of `y` moves onto the weight byte, `|y|` is
//! the unsigned operand; `vpabsb(−128)` is `0x80`, read as 128), then `vpmaddwd` with the
//! odd scales (`≤ 15`) gives exact i32 pairs.
//!
//! * iq1_s: `w = g` (pairs at most `2·128 = 256`); the shift term
//!   `ls_s·σ_s·(bsum_2s + bsum_2s+1)` is one `vpmaddwd` of the stored group sums with the
//!   signed scales, and `8·isum + msum` is formed lane-wise.
//! * iq1_m: `w = 8·g + σ_r` (in `−9..=9`, pairs at most `2·9·128 = 2304`), so one product
//!   per 32 values gives `8·isum + msum` directly; shift signs and scales are unpacked in
//!   vectors.
//!
//! The lane sums stay far inside i32 (module docs of [`super`]); the reduced total equals
//! the definition's exact `8·isum + msum` and the very same f32 step ([`super::step`]) runs
//! on it, so the results are bit-identical to the portable functions.

use std::arch::x86_64::*;

use super::super::block_x86::{hsum, ld128, ld256, q8_d, scale_at0, u64_at};
use super::super::simd::{f16_to_f32, prefetch_ahead};
use super::step;
use crate::quant::iq1::{iq1_m_scale, IQ1_GRID, IQ1_M_BYTES, IQ1_S_BYTES};
use crate::quant::kquants::Q8_K_BYTES;

/// `Σ` over adjacent pairs of `w·y` (16 i16 lanes, exact: `|w| ≤ 1`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pair_dots(w: __m256i, y: __m256i) -> __m256i {
    _mm256_maddubs_epi16(_mm256_abs_epi8(y), _mm256_sign_epi8(w, y))
}

/// The 32 grid indices of an iq1_s super-block as i32 lanes, runs `8p..8p + 8` in
/// vector `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn iq1_s_indices(bx: &[u8; IQ1_S_BYTES]) -> [__m256i; 4] {
    let qs = ld256(bx, 2);
    // qh[s] << 8 in i32 lane s.
    let qh = _mm256_slli_epi32::<8>(_mm256_cvtepu16_epi32(ld128(bx, 34)));
    let lo = _mm256_castsi256_si128(qs);
    let hi = _mm256_extracti128_si256::<1>(qs);
    let shifts = _mm256_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9);
    let m = _mm256_set1_epi32(0x700);
    let one = |low: __m128i, sel: __m256i| {
        let h = _mm256_srlv_epi32(_mm256_permutevar8x32_epi32(qh, sel), shifts);
        _mm256_or_si256(_mm256_cvtepu8_epi32(low), _mm256_and_si256(h, m))
    };
    [
        one(lo, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)),
        one(
            _mm_srli_si128::<8>(lo),
            _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
        ),
        one(hi, _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5)),
        one(
            _mm_srli_si128::<8>(hi),
            _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7),
        ),
    ]
}

/// The grid points of the 4 indices in the i32 lanes of `i` (point `j` in bytes `8j..8j + 8`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn points4(i: __m128i) -> __m256i {
    let a = _mm_cvtsi128_si64(i) as u64;
    let b = _mm_extract_epi64::<1>(i) as u64;
    let p = |v: u64| IQ1_GRID[(v & 2047) as usize] as i64;
    _mm256_setr_epi64x(p(a), p(a >> 32), p(b), p(b >> 32))
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
        let qh = ld128(bx, 34);
        // The odd scales 2a + 1 of the 8 sub-blocks (i16 lanes), and with their shift signs.
        let ls = _mm_or_si128(
            _mm_and_si128(_mm_srli_epi16::<11>(qh), _mm_set1_epi16(0xE)),
            _mm_set1_epi16(1),
        );
        let neg = _mm_srai_epi16::<15>(qh);
        let lss = _mm_sub_epi16(_mm_xor_si128(ls, neg), neg);
        // msum lanes: ls_s·σ_s·(bsum_2s + bsum_2s+1).
        let lss2 = _mm256_setr_m128i(_mm_unpacklo_epi16(lss, lss), _mm_unpackhi_epi16(lss, lss));
        let msum = _mm256_madd_epi16(ld256(by, 260), lss2);
        let lsb = _mm256_broadcastsi128_si256(ls);
        let idx = iq1_s_indices(bx);
        // Two accumulators (even and odd sub-blocks) of `ls_s·Σ g·y` per i32 lane.
        let mut s0 = _mm256_setzero_si256();
        let mut s1 = _mm256_setzero_si256();
        for (p, &ip) in idx.iter().enumerate() {
            let g0 = points4(_mm256_castsi256_si128(ip));
            let g1 = points4(_mm256_extracti128_si256::<1>(ip));
            // ls of sub-blocks 2p and 2p + 1 in every i16 lane.
            let b0 = 4 * p as u8;
            let b1 = b0 + 2;
            let l0 = _mm256_shuffle_epi8(lsb, _mm256_set1_epi16(i16::from_le_bytes([b0, b0 + 1])));
            let l1 = _mm256_shuffle_epi8(lsb, _mm256_set1_epi16(i16::from_le_bytes([b1, b1 + 1])));
            let d0 = pair_dots(g0, ld256(by, 4 + 64 * p));
            let d1 = pair_dots(g1, ld256(by, 36 + 64 * p));
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(d0, l0));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(d1, l1));
        }
        // 8·isum + msum, lane-wise then reduced (exact: the sums are bounded).
        let total = _mm256_add_epi32(_mm256_slli_epi32::<3>(_mm256_add_epi32(s0, s1)), msum);
        let dx = scale_at0(bx);
        acc = step(acc, dx, q8_d(by), 0, hsum(total));
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
    let shifts = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
    let m = _mm256_set1_epi32(0x700);
    let bit = _mm256_set1_epi32(0x800);
    let ones = _mm256_set1_epi8(1);
    let eight = _mm256_set1_epi8(8);
    // mullo factors moving bits 3k..3k + 3 of a scale word to bits 13..16 (k = h % 4).
    let up = _mm256_setr_epi16(
        8192, 1024, 128, 16, 8192, 1024, 128, 16, 8192, 1024, 128, 16, 8192, 1024, 128, 16,
    );
    // Scale word h / 4 into i16 lane h.
    let spread = _mm256_setr_epi8(
        0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7,
        6, 7,
    );
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx.as_ptr(), IQ1_M_BYTES);
        // The odd scales 2a + 1 of the 16 half sub-blocks, as bytes: half sub-blocks 0..8
        // in the low 128 bits (twice), 8..16 in the high 128 bits (twice).
        let w = _mm256_set1_epi64x(u64_at(bx, 48) as i64);
        let w = _mm256_shuffle_epi8(w, spread);
        let a = _mm256_srli_epi16::<13>(_mm256_mullo_epi16(w, up));
        let ls16 = _mm256_or_si256(_mm256_slli_epi16::<1>(a), _mm256_set1_epi16(1));
        let lsb = _mm256_packus_epi16(ls16, ls16);
        let lo = _mm256_permute2x128_si256::<0x00>(lsb, lsb);
        let hi = _mm256_permute2x128_si256::<0x11>(lsb, lsb);
        // Nibble of run r, shifted up by 8, in i32 lane r (runs 0..8, 8..16 per vector).
        let qh = ld128(bx, 32);
        let qh0 = _mm256_slli_epi32::<8>(_mm256_cvtepu8_epi32(qh));
        let qh1 = _mm256_slli_epi32::<8>(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(qh)));
        let qs = ld256(bx, 0);
        let qsl = _mm256_castsi256_si128(qs);
        let qsh = _mm256_extracti128_si256::<1>(qs);
        let mut sum = _mm256_setzero_si256();
        macro_rules! quarter {
            ($qhv:expr, $sel:expr, $low:expr, $p:expr, $lsv:expr) => {{
                let nib = _mm256_srlv_epi32(_mm256_permutevar8x32_epi32($qhv, $sel), shifts);
                let idx = _mm256_or_si256(_mm256_cvtepu8_epi32($low), _mm256_and_si256(nib, m));
                let neg = _mm256_cmpeq_epi32(_mm256_and_si256(nib, bit), bit);
                for half in 0..2 {
                    let c = 2 * $p + half;
                    let (i, n) = if half == 0 {
                        (_mm256_castsi256_si128(idx), _mm256_castsi256_si128(neg))
                    } else {
                        (
                            _mm256_extracti128_si256::<1>(idx),
                            _mm256_extracti128_si256::<1>(neg),
                        )
                    };
                    // Runs 4c..4c + 4: 8·g + σ per value (in −9..=9).
                    let sigma = _mm256_or_si256(_mm256_cvtepi32_epi64(n), ones);
                    let wv = _mm256_add_epi8(_mm256_sign_epi8(eight, points4(i)), sigma);
                    // Half sub-blocks 2c (low 128 bits) and 2c + 1 (high 128 bits).
                    let b = (2 * (c % 4)) as u8;
                    let sel = _mm256_setr_epi8(
                        b as i8,
                        -1,
                        b as i8,
                        -1,
                        b as i8,
                        -1,
                        b as i8,
                        -1,
                        b as i8,
                        -1,
                        b as i8,
                        -1,
                        b as i8,
                        -1,
                        b as i8,
                        -1,
                        b as i8 + 1,
                        -1,
                        b as i8 + 1,
                        -1,
                        b as i8 + 1,
                        -1,
                        b as i8 + 1,
                        -1,
                        b as i8 + 1,
                        -1,
                        b as i8 + 1,
                        -1,
                        b as i8 + 1,
                        -1,
                        b as i8 + 1,
                        -1,
                    );
                    let l = _mm256_shuffle_epi8($lsv, sel);
                    let d = pair_dots(wv, ld256(by, 4 + 32 * c));
                    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(d, l));
                }
            }};
        }
        quarter!(qh0, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), qsl, 0, lo);
        quarter!(
            qh0,
            _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7),
            _mm_srli_si128::<8>(qsl),
            1,
            lo
        );
        quarter!(qh1, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), qsh, 2, hi);
        quarter!(
            qh1,
            _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7),
            _mm_srli_si128::<8>(qsh),
            3,
            hi
        );
        let dx = f16_to_f32(iq1_m_scale(bx).to_bits());
        acc = step(acc, dx, q8_d(by), 0, hsum(sum));
    }
    acc
}
