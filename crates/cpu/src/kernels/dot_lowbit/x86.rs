//! AVX2 + FMA + F16C versions of the low-bit dot products (TQ1_0, TQ2_0, MXFP4, NVFP4, Q1_0,
//! Q2_0).
//!
//! Each kernel forms the definition's exact integer sums with `vpmaddubsw` (unsigned bytes
//! × signed bytes, adjacent pairs summed to i16, saturating) and `vpmaddwd` against ones
//! (pairs of i16 to i32), reduces them, and then runs the very same f32 steps as the portable
//! functions ([`super::step`], [`super::q1_0_step`], or for NVFP4 and Q1_0 the same roundings
//! on vector lanes: one rounded product per scale pair, one fused multiply-add per step, in
//! the defined order), so the results are bit-identical.
//!
//! Why the i16 stage is exact for any activation byte `y` (`−128..=127`):
//!
//! * FP4 levels and Q1_0 signs are signed on both sides, so the sign moves onto the weight
//!   (`vpsignb(w, y)`: `|w| ≤ 12`, its negation exact) and the magnitude of `y` becomes the
//!   unsigned operand (`vpabsb(−128)` is the byte `0x80`, read as 128): pairs are at most
//!   `2·128·12 = 3072`.
//! * TQ2_0's fields `f ∈ 0..=3` are the unsigned operand against `y`, pairs at most
//!   `2·3·128 = 768`; the offset is a second `vpmaddubsw` of ones against `y` (pairs at most
//!   256), subtracted in i16: the true pair sums `|(f − 1)·y|` stay below `2·2·128`.
//!
//! The i32 sums are bounded as in the definition (module docs of [`super`]).

use std::arch::x86_64::*;

use super::super::block_x86::{hsum, ld128, ld256, q8_d};
use super::super::simd::f16_to_f32;
use super::{q1_0_step, step, Q8_0_BYTES};
use crate::quant::kquants::Q8_K_BYTES;
#[cfg(doc)]
use crate::quant::lowbit::ue4m3_half;
use crate::quant::lowbit::{
    e8m0_half, KVALUES_MXFP4, MXFP4_BYTES, NVFP4_BYTES, Q1_0_BYTES, Q2_0_BYTES, TQ1_0_BYTES,
    TQ2_0_BYTES,
};

/// The little-endian f16 at byte `at` of `b`, widened exactly.
#[inline]
#[target_feature(enable = "f16c")]
fn f16_le(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Eight i32 lanes of exact pair sums of `w_v·y_v` for 32 signed weights `w` (`|w| ≤ 127`)
/// and 32 activation bytes `y`.
#[inline]
#[target_feature(enable = "avx2")]
fn signed_dot(w: __m256i, y: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(_mm256_abs_epi8(y), _mm256_sign_epi8(w, y));
    _mm256_madd_epi16(p, _mm256_set1_epi16(1))
}

/// The four sums of the lanes of `a`, `b`, `c`, `d` (in that order).
#[inline]
#[target_feature(enable = "avx2")]
fn hsum4(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> [i32; 4] {
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    let s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
    let mut out = [0i32; 4];
    // SAFETY: `out` holds 16 bytes; unaligned store.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), s) };
    out
}

/// The FP4 level table in both 128-bit lanes, for `vpshufb`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fp4_table() -> __m256i {
    let t = KVALUES_MXFP4.map(|k| k as u8);
    _mm256_broadcastsi128_si256(ld128(&t, 0))
}

/// TQ2_0 · q8_K.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tq2_0(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<TQ2_0_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let three = _mm256_set1_epi8(3);
    let ones8 = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        let mut sum = _mm256_setzero_si256();
        for h in 0..2 {
            let q = ld256(bx, 32 * h);
            for l in 0..4 {
                let f = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * l)), three);
                let yv = ld256(by, 4 + 128 * h + 32 * l as usize);
                let p =
                    _mm256_sub_epi16(_mm256_maddubs_epi16(f, yv), _mm256_maddubs_epi16(ones8, yv));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones16));
            }
        }
        acc = step(acc, f16_le(bx, 64), q8_d(by), hsum(sum));
    }
    acc
}

/// The 32 levels of an MXFP4 block's 16 code bytes, in value order.
#[inline]
#[target_feature(enable = "avx2")]
fn mxfp4_levels(table: __m256i, qs: __m128i) -> __m256i {
    let m = _mm_set1_epi8(15);
    let lo = _mm_and_si128(qs, m);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), m);
    _mm256_shuffle_epi8(table, _mm256_set_m128i(hi, lo))
}

/// MXFP4 · q8_0.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn mxfp4(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<MXFP4_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_0_BYTES>();
    let table = fp4_table();
    let mut acc = 0f32;
    let block = |bx: &[u8; MXFP4_BYTES], by: &[u8; Q8_0_BYTES]| {
        signed_dot(mxfp4_levels(table, ld128(bx, 1)), ld256(by, 2))
    };
    let (x4, _) = xb.as_chunks::<4>();
    let (y4, _) = yb.as_chunks::<4>();
    for (bx, by) in x4.iter().zip(y4) {
        let isum = hsum4(
            block(&bx[0], &by[0]),
            block(&bx[1], &by[1]),
            block(&bx[2], &by[2]),
            block(&bx[3], &by[3]),
        );
        for k in 0..4 {
            acc = step(acc, f16_le(&by[k], 0), e8m0_half(bx[k][0]), isum[k]);
        }
    }
    let done = 4 * x4.len().min(y4.len());
    for (bx, by) in xb.iter().zip(yb).skip(done) {
        acc = step(acc, f16_le(by, 0), e8m0_half(bx[0]), hsum(block(bx, by)));
    }
    acc
}

/// NVFP4 · q8_0.
///
/// Blocks are taken two at a time: their eight sub-block sums in one vector (f32, exact),
/// their eight scale products `dy_{s/2}·u_s` in another (each rounded once, as in
/// [`step`]), then one fused multiply-add into the eight accumulator lanes (lane
/// `4·(b mod 2) + s`, as the definition's `a_l`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn nvfp4(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<NVFP4_BYTES>();
    let (yb, _) = y.as_chunks::<{ 2 * Q8_0_BYTES }>();
    let table = fp4_table();
    let m = _mm256_set1_epi8(15);
    // The two i32 vectors whose hadd gives a block's sub-block sums (see `isum`).
    let block = |bx: &[u8; NVFP4_BYTES], by: &[u8; 2 * Q8_0_BYTES]| {
        let q = ld256(bx, 4);
        let lo = _mm256_and_si256(q, m);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m);
        // Per 128-bit lane: [lo 0..8 | hi 0..8] and [lo 8..16 | hi 8..16], i.e. sub-blocks
        // 0 and 2 (low lane of each) and 1 and 3 (high lane).
        let a = _mm256_unpacklo_epi64(lo, hi);
        let b = _mm256_unpackhi_epi64(lo, hi);
        let first = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256::<0x20>(a, b));
        let second = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256::<0x31>(a, b));
        let p = signed_dot(first, ld256(by, 2));
        let r = signed_dot(second, ld256(by, Q8_0_BYTES + 2));
        // Lanes 0..4 of p are sub-block 0, 4..8 sub-block 1; likewise r for 2 and 3.
        // Low half [p0+p1, p2+p3, r0+r1, r2+r3], high half likewise from lanes 4..8.
        _mm256_hadd_epi32(p, r)
    };
    // The q8_0 scale bits of a block pair: [dy0, dy1] of the first, then of the second.
    let dy_bits = |by: &[u8; 2 * Q8_0_BYTES]| {
        u32::from(u16::from_le_bytes([by[0], by[1]]))
            | u32::from(u16::from_le_bytes([by[Q8_0_BYTES], by[Q8_0_BYTES + 1]])) << 16
    };
    let scale_bytes = |bx: &[u8; NVFP4_BYTES]| u32::from_le_bytes([bx[0], bx[1], bx[2], bx[3]]);
    // Lane l is the definition's accumulator a_l.
    let mut acc = _mm256_setzero_ps();
    let (x2, _) = xb.as_chunks::<2>();
    let (y2, _) = yb.as_chunks::<2>();
    for (bx, by) in x2.iter().zip(y2) {
        // Low half [A0, A2, B0, B2], high half [A1, A3, B1, B3] (sub-block sums of A, B).
        let h = _mm256_hadd_epi32(block(&bx[0], &by[0]), block(&bx[1], &by[1]));
        let (l, u) = (_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        let f = _mm256_cvtepi32_ps(_mm256_setr_m128i(
            _mm_unpacklo_epi32(l, u),
            _mm_unpackhi_epi32(l, u),
        ));
        let hy = u64::from(dy_bits(&by[0])) | u64::from(dy_bits(&by[1])) << 32;
        let hy = _mm_cvtsi64_si128(hy as i64);
        let dy = _mm256_cvtph_ps(_mm_unpacklo_epi16(hy, hy));
        let sb = u64::from(scale_bytes(&bx[0])) | u64::from(scale_bytes(&bx[1])) << 32;
        let prod = _mm256_mul_ps(dy, ue4m3_half8(sb));
        acc = _mm256_fmadd_ps(prod, f, acc);
    }
    let done = 2 * x2.len().min(y2.len());
    for (bx, by) in xb.iter().zip(yb).skip(done) {
        let h = _mm256_hadd_epi32(block(bx, by), _mm256_setzero_si256());
        let (l, u) = (_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        let f = _mm_cvtepi32_ps(_mm_unpacklo_epi32(l, u));
        let hy = _mm_cvtsi32_si128(dy_bits(by) as i32);
        let dy = _mm_cvtph_ps(_mm_unpacklo_epi16(hy, hy));
        let prod = _mm256_mul_ps(
            _mm256_castps128_ps256(dy),
            ue4m3_half8(u64::from(scale_bytes(bx))),
        );
        // An even block: accumulators 0..4 only.
        let low = _mm_fmadd_ps(_mm256_castps256_ps128(prod), f, _mm256_castps256_ps128(acc));
        acc = _mm256_insertf128_ps::<0>(acc, low);
    }
    reduce8(acc)
}

/// The definition's final sum of the eight accumulator lanes
/// (`((a₀ + a₄) + (a₂ + a₆)) + ((a₁ + a₅) + (a₃ + a₇))`, see [`super::reduce8`]).
#[inline]
#[target_feature(enable = "avx2")]
fn reduce8(a: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
}

/// Half the UE4M3 values of the eight bytes of `b` (little-endian), as [`ue4m3_half`]: bit 7
/// dropped; exponent bits `x ≥ 1` with mantissa `m` give the f32 bits of
/// `(8 + m)·2^(x − 11)`, i.e. `(x + 119)·2²³ + m·2²⁰`; `x = 0` gives `m·2⁻¹⁰` (exact);
/// the byte `0x7F` (only that one: `0xFF` is 240) gives `+0`.
#[inline]
#[target_feature(enable = "avx2")]
fn ue4m3_half8(b: u64) -> __m256 {
    let raw = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(b as i64));
    let v = _mm256_and_si256(raw, _mm256_set1_epi32(0x7F));
    let normal = _mm256_castsi256_ps(_mm256_add_epi32(
        _mm256_slli_epi32::<20>(v),
        _mm256_set1_epi32(119 << 23),
    ));
    let sub = _mm256_mul_ps(
        _mm256_cvtepi32_ps(v),
        _mm256_set1_ps(f32::from_bits(0x3A80_0000)),
    );
    let is_sub = _mm256_castsi256_ps(_mm256_cmpeq_epi32(
        _mm256_and_si256(v, _mm256_set1_epi32(0x78)),
        _mm256_setzero_si256(),
    ));
    let r = _mm256_blendv_ps(normal, sub, is_sub);
    let zero = _mm256_castsi256_ps(_mm256_cmpeq_epi32(raw, _mm256_set1_epi32(0x7F)));
    _mm256_andnot_ps(zero, r)
}

/// Q1_0 · q8_0.
///
/// Per q8_0 block `k`, the 32 sign bits are spread to bytes (`vpshufb`, then one bit tested
/// per byte), `w = ±1`, and [`signed_dot`]'s pairs (at most 256) are reduced in i16 by two
/// rounds of `vphaddw` (sums of at most 8 pairs, below 2¹¹, no wrap) and `vpmaddwd`, giving
/// the four exact `isum_k` in one vector. Blocks are taken two at a time: the eight scale
/// products `dx·dy_k` (each rounded once) and one fused multiply-add into the eight
/// accumulator lanes (lane `4·(b mod 2) + k`, as the definition's `a_l`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q1_0(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q1_0_BYTES>();
    let (yb, _) = y.as_chunks::<{ 4 * Q8_0_BYTES }>();
    // Byte i of group k reads bit i % 8 of the block's bit byte 4k + i / 8.
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let spreads: [__m256i; 4] =
        std::array::from_fn(|k| _mm256_add_epi8(spread, _mm256_set1_epi8(4 * k as i8)));
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let ones = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    // The four exact isum_k of a block, as f32 lanes.
    let block = |bx: &[u8; Q1_0_BYTES], by: &[u8; 4 * Q8_0_BYTES]| {
        let bits = _mm256_broadcastsi128_si256(ld128(bx, 2));
        let group = |k: usize| {
            let bytes = _mm256_shuffle_epi8(bits, spreads[k]);
            // −1 where the bit is clear, 0 where set; or 1 → −1 clear, +1 set.
            let clear = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), _mm256_setzero_si256());
            let w = _mm256_or_si256(clear, ones);
            let yv = ld256(by, k * Q8_0_BYTES + 2);
            _mm256_maddubs_epi16(_mm256_abs_epi8(yv), _mm256_sign_epi8(w, yv))
        };
        // Per 128-bit half: two partial sums of each group, in group order.
        let h = _mm256_hadd_epi16(
            _mm256_hadd_epi16(group(0), group(1)),
            _mm256_hadd_epi16(group(2), group(3)),
        );
        let h = _mm256_madd_epi16(h, ones16);
        _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
    };
    // The four q8_0 scale bits of a block, as one u64.
    let dyb = |by: &[u8; 4 * Q8_0_BYTES]| {
        (0..4).fold(0u64, |a, k| {
            a | u64::from(u16::from_le_bytes([
                by[k * Q8_0_BYTES],
                by[k * Q8_0_BYTES + 1],
            ])) << (16 * k)
        })
    };
    let dxb = |bx: &[u8; Q1_0_BYTES]| _mm_set1_epi16(i16::from_le_bytes([bx[0], bx[1]]));
    // Lane l is the definition's accumulator a_l.
    let mut acc = _mm256_setzero_ps();
    let (x2, _) = xb.as_chunks::<2>();
    let (y2, _) = yb.as_chunks::<2>();
    for (bx, by) in x2.iter().zip(y2) {
        let f = _mm256_cvtepi32_ps(_mm256_setr_m128i(
            block(&bx[0], &by[0]),
            block(&bx[1], &by[1]),
        ));
        let dy = _mm256_cvtph_ps(_mm_set_epi64x(dyb(&by[1]) as i64, dyb(&by[0]) as i64));
        let dx = _mm256_cvtph_ps(_mm_unpacklo_epi64(dxb(&bx[0]), dxb(&bx[1])));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(dx, dy), f, acc);
    }
    let done = 2 * x2.len().min(y2.len());
    for (bx, by) in xb.iter().zip(yb).skip(done) {
        // An even block: accumulators 0..4 only.
        let f = _mm_cvtepi32_ps(block(bx, by));
        let dy = _mm_cvtph_ps(_mm_cvtsi64_si128(dyb(by) as i64));
        let dx = _mm_cvtph_ps(dxb(bx));
        let low = _mm_fmadd_ps(_mm_mul_ps(dx, dy), f, _mm256_castps256_ps128(acc));
        acc = _mm256_insertf128_ps::<0>(acc, low);
    }
    reduce8(acc)
}

/// `b·p mod 256` for every byte `b` of `v`, with `p` the multiplier of its 16-bit lane
/// (`vpmullw` keeps the low bytes' products exactly; the high bytes', multiplied with their
/// low bytes cleared, come out in the high bytes with zeros below).
#[inline]
#[target_feature(enable = "avx2")]
fn bytes_mul(v: __m256i, p: __m256i) -> __m256i {
    let high = _mm256_set1_epi16(0xFF00u16 as i16);
    let lo = _mm256_andnot_si256(high, _mm256_mullo_epi16(v, p));
    let hi = _mm256_mullo_epi16(_mm256_and_si256(v, high), p);
    _mm256_or_si256(lo, hi)
}

/// `3·v mod 256` bytewise.
#[inline]
#[target_feature(enable = "avx2")]
fn times3(v: __m256i) -> __m256i {
    _mm256_add_epi8(v, _mm256_add_epi8(v, v))
}

/// The ternary weights `w = t − 1 ∈ −1..=1` of 32 bytes `q`, `t = (3·q) >> 8`, given as
/// `qx = q ⊕ 0x80` (read as `i8`, `q − 128`): `t = [q ≥ 86] + [q ≥ 171]`, so
/// `w = −[qx < −42] + [qx > 42]` (as `vpcmpgtb` masks, `−1` where true).
///
/// The offset form is kept because it is invariant under the trit recurrence: `q' = 3q mod
/// 256` gives `q' − 128 ≡ 3(q − 128) (mod 256)`, so `qx' = 3·qx mod 256` ([`times3`]).
#[inline]
#[target_feature(enable = "avx2")]
fn ternary(qx: __m256i) -> __m256i {
    let low = _mm256_cmpgt_epi8(_mm256_set1_epi8(-42), qx);
    let high = _mm256_cmpgt_epi8(qx, _mm256_set1_epi8(42));
    _mm256_sub_epi8(low, high)
}

/// TQ1_0 · q8_K.
///
/// Trit `k` of byte `b` is `t = (3·q) >> 8` with `q = b·3^k mod 256` ([`ternary`], with the
/// bytewise products [`times3`] and [`bytes_mul`]). Every group of 32 consecutive values is
/// one vector: `qs[0..32]` by `3^k` for values `32k..32k + 32`; `qs[32..48]` in both halves,
/// by `3^k` and `3^(k+1)`, for values `160 + 16k..`, `k ∈ {0, 2}`; and `qs[32..48]` by 81
/// beside the four `qh` bytes repeated, copy `k` by `3^k`, for values `224..256`. Products
/// as in [`signed_dot`] (`|w| ≤ 1`, pairs at most 256), eight summed in i16 (at most 2048),
/// then widened by `vpmaddwd` to exact i32 lanes.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tq1_0(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<TQ1_0_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let bias = _mm256_set1_epi8(-128);
    let ones16 = _mm256_set1_epi16(1);
    let pow_pair = |a: i16, b: i16| _mm256_setr_m128i(_mm_set1_epi16(a), _mm_set1_epi16(b));
    let (p01, p23) = (pow_pair(1, 3), pow_pair(9, 27));
    let pow_tail = _mm256_setr_epi16(81, 81, 81, 81, 81, 81, 81, 81, 1, 1, 3, 3, 9, 9, 27, 27);
    let block = |bx: &[u8; TQ1_0_BYTES], by: &[u8; Q8_K_BYTES]| {
        let mut sum = _mm256_setzero_si256();
        let mut add = |qx: __m256i, at: usize| {
            let yv = ld256(by, 4 + at);
            let w = _mm256_sign_epi8(ternary(qx), yv);
            sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(_mm256_abs_epi8(yv), w));
        };
        let mut a = _mm256_xor_si256(ld256(bx, 0), bias);
        add(a, 0);
        for k in 1..5 {
            a = times3(a);
            add(a, 32 * k);
        }
        let q = ld128(bx, 32);
        let b = _mm256_setr_m128i(q, q);
        add(_mm256_xor_si256(bytes_mul(b, p01), bias), 160);
        add(_mm256_xor_si256(bytes_mul(b, p23), bias), 192);
        let qh = u32::from_le_bytes([bx[48], bx[49], bx[50], bx[51]]);
        let c = _mm256_setr_m128i(q, _mm_set1_epi32(qh as i32));
        add(_mm256_xor_si256(bytes_mul(c, pow_tail), bias), 224);
        _mm256_madd_epi16(sum, ones16)
    };
    let mut acc = 0f32;
    let (x2, _) = xb.as_chunks::<2>();
    let (y2, _) = yb.as_chunks::<2>();
    for (bx, by) in x2.iter().zip(y2) {
        let s = hsum2(block(&bx[0], &by[0]), block(&bx[1], &by[1]));
        acc = step(acc, f16_le(&bx[0], 52), q8_d(&by[0]), s[0]);
        acc = step(acc, f16_le(&bx[1], 52), q8_d(&by[1]), s[1]);
    }
    let done = 2 * x2.len().min(y2.len());
    for (bx, by) in xb.iter().zip(yb).skip(done) {
        acc = step(acc, f16_le(bx, 52), q8_d(by), hsum(block(bx, by)));
    }
    acc
}

/// The two sums of the lanes of `a` and `b`.
#[inline]
#[target_feature(enable = "avx2")]
fn hsum2(a: __m256i, b: __m256i) -> [i32; 2] {
    let h = _mm256_hadd_epi32(a, b);
    let s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
    let s = _mm_hadd_epi32(s, s);
    [_mm_cvtsi128_si32(s), _mm_extract_epi32::<1>(s)]
}

/// Q2_0 · q8_0.
///
/// The 16 code bytes, in both 128-bit halves, are split into nibbles and interleaved so that
/// byte `j / 2` holds the nibble of value `j` (two fields); `vpshufb` spreads them to one byte
/// per value (the bytes `j / 2`, in the high half `16 + j / 2`), the field is masked in place
/// (`0x03` for even `j`, `0x0C` for odd), and a 16-entry `vpshufb` table maps both forms
/// (`f` or `4f`) to `w = f − 1 ∈ −1..=2`. Products as [`signed_dot`]: pairs at most
/// `2·2·128 = 512`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q2_0(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q2_0_BYTES>();
    let (yb, _) = y.as_chunks::<{ 2 * Q8_0_BYTES }>();
    let nib = _mm256_set1_epi8(15);
    let field = _mm256_set1_epi16(0x0C03);
    let lut = _mm256_setr_epi8(
        -1, 0, 1, 2, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, -1, 0, 1, 2, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0,
        0, 0,
    );
    let spread = _mm256_setr_epi8(
        0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13,
        14, 14, 15, 15,
    );
    let block = |bx: &[u8; Q2_0_BYTES], by: &[u8; 2 * Q8_0_BYTES]| {
        let q = _mm256_broadcastsi128_si256(ld128(bx, 2));
        let lo = _mm256_and_si256(q, nib);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), nib);
        let w = |n: __m256i| {
            let f = _mm256_and_si256(_mm256_shuffle_epi8(n, spread), field);
            _mm256_shuffle_epi8(lut, f)
        };
        let a = signed_dot(w(_mm256_unpacklo_epi8(lo, hi)), ld256(by, 2));
        let b = signed_dot(w(_mm256_unpackhi_epi8(lo, hi)), ld256(by, Q8_0_BYTES + 2));
        (a, b)
    };
    let fstep = |acc: f32, bx: &[u8; Q2_0_BYTES], by: &[u8; 2 * Q8_0_BYTES], i: [i32; 2]| {
        let dy = [f16_le(by, 0), f16_le(by, Q8_0_BYTES)];
        q1_0_step::<2>(acc, f16_le(bx, 0), dy, i)
    };
    let mut acc = 0f32;
    let (x2, _) = xb.as_chunks::<2>();
    let (y2, _) = yb.as_chunks::<2>();
    for (bx, by) in x2.iter().zip(y2) {
        let (a0, b0) = block(&bx[0], &by[0]);
        let (a1, b1) = block(&bx[1], &by[1]);
        let s = hsum4(a0, b0, a1, b1);
        acc = fstep(acc, &bx[0], &by[0], [s[0], s[1]]);
        acc = fstep(acc, &bx[1], &by[1], [s[2], s[3]]);
    }
    let done = 2 * x2.len().min(y2.len());
    for (bx, by) in xb.iter().zip(yb).skip(done) {
        let (a, b) = block(bx, by);
        acc = fstep(acc, bx, by, [hsum(a), hsum(b)]);
    }
    acc
}
