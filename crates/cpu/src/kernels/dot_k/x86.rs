//! AVX2 + FMA + F16C versions of the K-quant dot products.
//!
//! Each kernel computes the portable definition's exact integer sums of a super-block with
//! `vpmaddubsw` (unsigned bytes × signed bytes, adjacent pairs summed to i16) and
//! `vpmaddwd` (i16 × group scale, adjacent pairs summed to i32), reduces them to scalars,
//! and then runs the very same f32 steps ([`super::step`], [`super::step_min`]) on them, so
//! the results are bit-identical to the portable functions.
//!
//! # Why the i16 stages are exact
//!
//! `vpmaddubsw` saturates each pair sum `a₀·b₀ + a₁·b₁` to i16 (`a` unsigned, `b` signed);
//! the bounds below (with `|y| ≤ 128`, any q8_K byte) keep every pair inside `±32767`:
//!
//! | kernel | unsigned operand `a`                | signed `b` | worst pair          |
//! |--------|-------------------------------------|------------|---------------------|
//! | q2_K   | 2-bit quant, `0..=3`                | `y`        | `2·3·128 = 768`     |
//! | q3_K   | low bits `0..=3`; offset `0` or `4` | `y`        | `2·4·128 = 1024`    |
//! | q4_K   | nibble `0..=15`                     | `y`        | `2·15·128 = 3840`   |
//! | q5_K   | `0..=31`                            | `y`        | `2·31·128 = 7936`   |
//! | q6_K   | `0..=63`; the offset `32`           | `y`        | `2·63·128 = 16128`  |
//! | iq4_xs | `|y|`, `0..=128`                    | `±kvalue`  | `2·128·127 = 32512` |
//!
//! q3_K and q6_K subtract their offsets as a second `vpmaddubsw` of the same activations
//! (`(ql − 4·(1 − h))·y` as `ql·y − (4·(1 − h))·y`; `(q − 32)·y` as `q·y − 32·y`); the i16
//! difference is exact because the true pair sums `|(q − o)·y|` stay below `2·32·128 = 8192`.
//! iq4_xs has signed table values on both sides; the sign moves onto the table value
//! (`vpsignb(k, y)`, `|k| ≤ 127` so the negation is exact) and the magnitude of `y` becomes
//! the unsigned operand (`vpabsb(−128)` is the byte `0x80`, read as 128 by `vpmaddubsw`).
//! `vpmaddwd` with group scales (`|sc| ≤ 128`) then forms exact i32 pairs, and every i32
//! partial sum is bounded by the definition's bounds (module docs of [`super`]).
//!
//! The group sums `bsum` of q2_K, q4_K and q5_K are widened with `vpmaddwd` against the
//! minimums (never added as i16, which could wrap for inconsistent bsums).
//!
//! # Throughput
//!
//! A mat-vec product streams each weight row once, so the kernels aim at the memory
//! bandwidth of one core: the weight row is prefetched 1 KiB ahead (without
//! it the loads of a super-block waited on memory between bursts of arithmetic, about 75% of
//! a plain streaming read), group scales reach the lanes by one `vpshufb` each, and the
//! per-super-block reduction to scalars is one `vphaddd` tree. Measured on one Zen 3 core of
//! a shared 2-core VM (`bench_mat_vec_bandwidth`, 4096 × 14336 weights, GB/s of weight bytes
//! against a plain read of the same bytes at about 7–8 GB/s): q4_K, q5_K, q6_K and iq4_xs
//! run at 85–95% of the read, q2_K and q3_K (the densest layouts, about one instruction per
//! weight byte) at 70–85%; from cache the kernels do 8.5 (q2_K, q3_K, iq4_xs) to 15 GB/s.

use std::arch::x86_64::*;

use super::super::block_dot::common_blocks;
use super::super::block_x86::{hsum, iq4nl_levels, ld128, ld256, q8_d, u32_at};
use super::super::simd::f16_to_f32;
use super::{step, step_min};
use crate::quant::kquants::{
    IQ4_XS_BYTES, Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, Q8_K_BYTES,
};

/// Prefetches the weights a super-block's worth of lines ahead of `bx`
/// ([`crate::kernels::simd::prefetch_ahead`]).
#[inline(always)]
fn prefetch_ahead<const N: usize>(bx: &[u8; N]) {
    super::super::simd::prefetch_ahead(bx.as_ptr(), N);
}

/// Two adjacent f16 values (the low and high halves of `bits`) as f32, exactly.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_pair(bits: u32) -> (f32, f32) {
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

/// The lane sums of `a` and of `b`, reduced together.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum2(a: __m256i, b: __m256i) -> (i32, i32) {
    // [a01 a23 b01 b23 | a45 a67 b45 b67]
    let t = _mm256_hadd_epi32(a, b);
    let s = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
    let s = _mm_hadd_epi32(s, s);
    (_mm_cvtsi128_si32(s), _mm_extract_epi32::<1>(s))
}

/// `vpshufb` patterns that broadcast i16 word `2t` of a 128-bit lane to the low lane and
/// word `2t + 1` to the high lane: the scales of the two 16-value groups covered by 32
/// consecutive values (the low 128 bits of a `vpmaddubsw` result hold the first 16 values).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pair_patterns() -> [__m256i; 4] {
    std::array::from_fn(|t| {
        let word = |k: usize| ((2 * k) | ((2 * k + 1) << 8)) as i16;
        _mm256_setr_m128i(_mm_set1_epi16(word(2 * t)), _mm_set1_epi16(word(2 * t + 1)))
    })
}

/// 16 i16 group scales (groups `0..16`) split into the two halves of a super-block, each
/// broadcast to both 128-bit lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn halves(sc16: __m256i) -> [__m256i; 2] {
    [
        _mm256_permute4x64_epi64::<0x44>(sc16),
        _mm256_permute4x64_epi64::<0xEE>(sc16),
    ]
}

/// q2_K · q8_K ([`super::dot_q2_k`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q2_k(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q2_K_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let m3 = _mm256_set1_epi8(3);
    let low = _mm_set1_epi8(0x0F);
    let pairs = pair_patterns();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx);
        let s = ld128(bx, 0);
        let sc = halves(_mm256_cvtepu8_epi16(_mm_and_si128(s, low)));
        let m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(s), low));
        // m_g · bsum_g, widened to i32 by the multiply-add.
        let mins = _mm256_madd_epi16(m16, ld256(by, 260));
        let mut sumi = _mm256_setzero_si256();
        for (h, sc_h) in sc.iter().enumerate() {
            let mut qv = ld256(bx, 16 + 32 * h);
            for (t, pattern) in pairs.iter().enumerate() {
                let q = _mm256_and_si256(qv, m3);
                qv = _mm256_srli_epi16::<2>(qv);
                let p = _mm256_maddubs_epi16(q, ld256(by, 4 + 128 * h + 32 * t));
                let s = _mm256_shuffle_epi8(*sc_h, *pattern);
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, s));
            }
        }
        let (isum, msum) = hsum2(sumi, mins);
        let (d, dmin) = f16_pair(u32_at(bx, 80));
        acc = step_min(acc, d, dmin, q8_d(by), isum, msum);
    }
    acc
}

/// q3_K · q8_K ([`super::dot_q3_k`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q3_k(x: &[u8], y: &[u8]) -> f32 {
    const K1: u32 = 0x0303_0303;
    const K2: u32 = 0x0f0f_0f0f;
    let (xb, _) = x.as_chunks::<Q3_K_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let m3 = _mm256_set1_epi8(3);
    let four = _mm256_set1_epi8(4);
    let ones = _mm256_set1_epi8(-1);
    let pairs = pair_patterns();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx);
        // The 16 six-bit scales: bytes g of s0..s3 are groups g, 4 + g, 8 + g, 12 + g.
        let (a0, a1, t) = (u32_at(bx, 96), u32_at(bx, 100), u32_at(bx, 104));
        let s0 = (a0 & K2) | ((t & K1) << 4);
        let s1 = (a1 & K2) | (((t >> 2) & K1) << 4);
        let s2 = ((a0 >> 4) & K2) | (((t >> 4) & K1) << 4);
        let s3 = ((a1 >> 4) & K2) | (((t >> 6) & K1) << 4);
        let sc8 = _mm_sub_epi8(
            _mm_setr_epi32(s0 as i32, s1 as i32, s2 as i32, s3 as i32),
            _mm_set1_epi8(32),
        );
        let sc = halves(_mm256_cvtepi8_epi16(sc8));
        // Inverted high bits: after k right shifts, bit 0 of each byte is "bit k clear".
        let mut nh = _mm256_xor_si256(ld256(bx, 0), ones);
        let mut sumi = _mm256_setzero_si256();
        for (h, sc_h) in sc.iter().enumerate() {
            let mut qv = ld256(bx, 32 + 32 * h);
            for (t, pattern) in pairs.iter().enumerate() {
                let ql = _mm256_and_si256(qv, m3);
                qv = _mm256_srli_epi16::<2>(qv);
                let offset = _mm256_and_si256(_mm256_slli_epi16::<2>(nh), four);
                nh = _mm256_srli_epi16::<1>(nh);
                let yv = ld256(by, 4 + 128 * h + 32 * t);
                let p = _mm256_sub_epi16(
                    _mm256_maddubs_epi16(ql, yv),
                    _mm256_maddubs_epi16(offset, yv),
                );
                let s = _mm256_shuffle_epi8(*sc_h, *pattern);
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, s));
            }
        }
        let d = f16_to_f32(u16::from_le_bytes([bx[108], bx[109]]));
        acc = step(acc, d, q8_d(by), hsum(sumi));
    }
    acc
}

/// The 8 scales and 8 minimums of a q4_K / q5_K super-block (scale bytes at 4..16) as
/// `(the 8 scale bytes in both 128-bit lanes, minimums as i16 each repeated twice)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k4_scales<const N: usize>(bx: &[u8; N]) -> (__m256i, __m256i) {
    let (a, b, c) = (u32_at(bx, 4), u32_at(bx, 8), u32_at(bx, 12));
    let sc_lo = a & 0x3f3f_3f3f;
    let m_lo = b & 0x3f3f_3f3f;
    let sc_hi = (c & 0x0f0f_0f0f) | ((a >> 2) & 0x3030_3030);
    let m_hi = ((c >> 4) & 0x0f0f_0f0f) | ((b >> 2) & 0x3030_3030);
    let sc8 = _mm256_set1_epi64x((u64::from(sc_hi) << 32 | u64::from(sc_lo)) as i64);
    let m16 = _mm_cvtepu8_epi16(_mm_setr_epi32(m_lo as i32, m_hi as i32, 0, 0));
    let mdup = _mm256_setr_m128i(_mm_unpacklo_epi16(m16, m16), _mm_unpackhi_epi16(m16, m16));
    (sc8, mdup)
}

/// `vpshufb` patterns that turn 8 bytes (in both 128-bit lanes) into 16 copies of byte `k`
/// zero-extended to i16 (one shuffle per group scale, where a broadcast of an i16 word would
/// cost two).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn byte_word_patterns() -> [__m256i; 8] {
    std::array::from_fn(|k| _mm256_set1_epi16((k as i16) | (0x80 << 8)))
}

/// q4_K · q8_K ([`super::dot_q4_k`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_k(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q4_K_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let low = _mm256_set1_epi8(0x0F);
    let words = byte_word_patterns();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx);
        let (scales, mdup) = k4_scales(bx);
        // m_g · (bsum_2g + bsum_2g+1), widened to i32 by the multiply-add.
        let mins = _mm256_madd_epi16(ld256(by, 260), mdup);
        let mut sumi = _mm256_setzero_si256();
        for j in 0..4 {
            let q = ld256(bx, 16 + 32 * j);
            let lo = _mm256_and_si256(q, low);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low);
            let p0 = _mm256_maddubs_epi16(lo, ld256(by, 4 + 64 * j));
            let p1 = _mm256_maddubs_epi16(hi, ld256(by, 36 + 64 * j));
            let s0 = _mm256_shuffle_epi8(scales, words[2 * j]);
            let s1 = _mm256_shuffle_epi8(scales, words[2 * j + 1]);
            sumi = _mm256_add_epi32(
                sumi,
                _mm256_add_epi32(_mm256_madd_epi16(p0, s0), _mm256_madd_epi16(p1, s1)),
            );
        }
        let (isum, msum) = hsum2(sumi, mins);
        let (d, dmin) = f16_pair(u32_at(bx, 0));
        acc = step_min(acc, d, dmin, q8_d(by), isum, msum);
    }
    acc
}

/// q5_K · q8_K ([`super::dot_q5_k`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q5_k(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q5_K_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let low = _mm256_set1_epi8(0x0F);
    let bit4 = _mm256_set1_epi8(0x10);
    let words = byte_word_patterns();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx);
        let (scales, mdup) = k4_scales(bx);
        let mins = _mm256_madd_epi16(ld256(by, 260), mdup);
        // After j right shifts by 2, bits 0 and 1 of each byte are the high bits of chunk j.
        let mut hb = ld256(bx, 16);
        let mut sumi = _mm256_setzero_si256();
        for j in 0..4 {
            let q = ld256(bx, 48 + 32 * j);
            let lo = _mm256_or_si256(
                _mm256_and_si256(q, low),
                _mm256_and_si256(_mm256_slli_epi16::<4>(hb), bit4),
            );
            let hi = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(q), low),
                _mm256_and_si256(_mm256_slli_epi16::<3>(hb), bit4),
            );
            hb = _mm256_srli_epi16::<2>(hb);
            let p0 = _mm256_maddubs_epi16(lo, ld256(by, 4 + 64 * j));
            let p1 = _mm256_maddubs_epi16(hi, ld256(by, 36 + 64 * j));
            let s0 = _mm256_shuffle_epi8(scales, words[2 * j]);
            let s1 = _mm256_shuffle_epi8(scales, words[2 * j + 1]);
            sumi = _mm256_add_epi32(
                sumi,
                _mm256_add_epi32(_mm256_madd_epi16(p0, s0), _mm256_madd_epi16(p1, s1)),
            );
        }
        let (isum, msum) = hsum2(sumi, mins);
        let (d, dmin) = f16_pair(u32_at(bx, 0));
        acc = step_min(acc, d, dmin, q8_d(by), isum, msum);
    }
    acc
}

/// q6_K · q8_K ([`super::dot_q6_k`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6_k(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q6_K_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let low = _mm256_set1_epi8(0x0F);
    let top = _mm256_set1_epi8(0x30);
    let m32 = _mm256_set1_epi8(32);
    let pairs = pair_patterns();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx);
        let sc = halves(_mm256_cvtepi8_epi16(ld128(bx, 192)));
        let mut sumi = _mm256_setzero_si256();
        for (h, sc_h) in sc.iter().enumerate() {
            let ql0 = ld256(bx, 64 * h);
            let ql1 = ld256(bx, 64 * h + 32);
            let qh = ld256(bx, 128 + 32 * h);
            // The four runs of 32 values of this half, as 6-bit numbers (0..=63).
            let q = [
                _mm256_or_si256(
                    _mm256_and_si256(ql0, low),
                    _mm256_and_si256(_mm256_slli_epi16::<4>(qh), top),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(ql1, low),
                    _mm256_and_si256(_mm256_slli_epi16::<2>(qh), top),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low),
                    _mm256_and_si256(qh, top),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low),
                    _mm256_and_si256(_mm256_srli_epi16::<2>(qh), top),
                ),
            ];
            for (t, (qt, pattern)) in q.iter().zip(&pairs).enumerate() {
                let yv = ld256(by, 4 + 128 * h + 32 * t);
                let p =
                    _mm256_sub_epi16(_mm256_maddubs_epi16(*qt, yv), _mm256_maddubs_epi16(m32, yv));
                let s = _mm256_shuffle_epi8(*sc_h, *pattern);
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, s));
            }
        }
        let d = f16_to_f32(u16::from_le_bytes([bx[208], bx[209]]));
        acc = step(acc, d, q8_d(by), hsum(sumi));
    }
    acc
}

/// q4_K · q8_K with 512-bit vectors ([`super::dot_q4_k`], [`k4_avx512`]).
///
/// # Safety
/// The CPU must support AVX-512F/BW, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn q4_k_avx512(x: &[u8], y: &[u8]) -> f32 {
    // SAFETY: forwarded from the caller.
    unsafe { k4_avx512::<Q4_K_BYTES, false>(x, y) }
}

/// q5_K · q8_K with 512-bit vectors ([`super::dot_q5_k`], [`k4_avx512`]).
///
/// # Safety
/// The CPU must support AVX-512F/BW, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn q5_k_avx512(x: &[u8], y: &[u8]) -> f32 {
    // SAFETY: forwarded from the caller.
    unsafe { k4_avx512::<Q5_K_BYTES, true>(x, y) }
}

/// The constant vectors of the 512-bit q4_K / q5_K kernels.
struct K4Constants {
    /// Low-nibble mask.
    low: __m512i,
    /// q5_K: run `r` (32 values) takes bit `r` of each `qh` byte; the low nibbles of load `c`
    /// are runs 4c and 4c + 2, the high ones 4c + 1 and 4c + 3: `fifth[c]` are the bits of
    /// the low and high nibbles of load `c`, by 256-bit half.
    fifth: [[__m512i; 2]; 2],
    /// The fifth bit's value.
    sixteen: __m512i,
    /// Word lane `i` of the scales for values `64 s..64 s + 64`: group `2 s + i / 16`.
    groups: [__m512i; 4],
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
fn k4_constants() -> K4Constants {
    let bits = |lo_run: i32| {
        _mm512_inserti64x4::<1>(
            _mm512_set1_epi8(1 << lo_run),
            _mm256_set1_epi8((1i32 << (lo_run + 2)) as i8),
        )
    };
    K4Constants {
        low: _mm512_set1_epi8(0x0F),
        fifth: [[bits(0), bits(1)], [bits(4), bits(5)]],
        sixteen: _mm512_set1_epi8(0x10),
        groups: std::array::from_fn(|s| {
            let idx: [i16; 32] = std::array::from_fn(|i| (2 * s + i / 16) as i16);
            // SAFETY: 32 i16 are 64 bytes.
            unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
        }),
    }
}

impl K4Constants {
    /// Runs `2 c` and `2 c + 1` (64 values each) of a super-block: its 64-byte load `c` of
    /// nibbles at `nibbles` split into low and high nibbles (q5_K: plus the fifth bits out
    /// of its broadcast `qh` bytes) and regrouped by 128-bit lanes, [low | high] of each
    /// 32-byte chunk.
    ///
    /// # Safety
    /// The CPU must support AVX-512F/BW; `nibbles` points at 64 readable bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn runs(&self, nibbles: *const u8, qh: Option<__m512i>, c: usize) -> [__m512i; 2] {
        // SAFETY: 64 bytes at `nibbles` (caller).
        let q = unsafe { _mm512_loadu_si512(nibbles.cast()) };
        let mut lo = _mm512_and_si512(q, self.low);
        let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), self.low);
        if let Some(qh) = qh {
            let [lo_bits, hi_bits] = self.fifth[c];
            lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, lo_bits), lo, self.sixteen);
            hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(qh, hi_bits), hi, self.sixteen);
        }
        [
            _mm512_shuffle_i64x2::<0x44>(lo, hi),
            _mm512_shuffle_i64x2::<0xEE>(lo, hi),
        ]
    }
}

/// q4_K (`N` = 144) or q5_K (`N` = 176, `FIVE`) · q8_K with 512-bit vectors: each 64-byte
/// load of nibbles (two runs of 64 values) is split into low and high nibbles (q5_K: plus
/// their fifth bits, tested out of the broadcast `qh` bytes into a mask) and regrouped by
/// 128-bit lanes so that each vector holds 64 consecutive values; group scales are
/// replicated by one `vpermw` each, the minimum term is the AVX2 kernels'. The same exact
/// integer sums and the same f32 steps as the AVX2 kernels.
///
/// # Safety
/// The CPU must support AVX-512F/BW, AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn k4_avx512<const N: usize, const FIVE: bool>(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<N>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let qs_at = if FIVE { 48 } else { 16 };
    let k4 = k4_constants();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx);
        let (scales, mdup) = k4_scales(bx);
        // m_g · (bsum_2g + bsum_2g+1), widened to i32 by the multiply-add.
        let mins = _mm256_madd_epi16(ld256(by, 260), mdup);
        let sc = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(scales)));
        // q5_K's `qh` bytes 16..48, in both 256-bit halves
        let qh = if FIVE {
            Some(_mm512_broadcast_i64x4(ld256(bx, 16)))
        } else {
            None
        };
        let mut sumi = _mm512_setzero_si512();
        for c in 0..2 {
            // SAFETY: nibbles `qs_at + 64 c .. + 64` of the super-block; the q8_K quants
            // 4 + 128 c .. + 128 of the 292-byte one.
            unsafe {
                let w = k4.runs(bx.as_ptr().add(qs_at + 64 * c), qh, c);
                for (t, wt) in w.iter().enumerate() {
                    let s = 2 * c + t;
                    let yv = _mm512_loadu_si512(by.as_ptr().add(4 + 64 * s).cast());
                    let p = _mm512_maddubs_epi16(*wt, yv);
                    let g = _mm512_permutexvar_epi16(k4.groups[s], sc);
                    sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(p, g));
                }
            }
        }
        let sum = _mm256_add_epi32(
            _mm512_castsi512_si256(sumi),
            _mm512_extracti64x4_epi64::<1>(sumi),
        );
        let (isum, msum) = hsum2(sum, mins);
        let (d, dmin) = f16_pair(u32_at(bx, 0));
        acc = step_min(acc, d, dmin, q8_d(by), isum, msum);
    }
    acc
}

/// [`q4_k_avx512`] for `C` activation rows at once (each super-block decoded once).
///
/// # Safety
/// As [`q4_k_avx512`].
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn q4_k_avx512_cols<const C: usize>(x: &[u8], ys: [&[u8]; C]) -> [f32; C] {
    // SAFETY: forwarded from the caller.
    unsafe { k4_avx512_cols::<Q4_K_BYTES, false, C>(x, ys) }
}

/// [`q5_k_avx512`] for `C` activation rows at once (each super-block decoded once).
///
/// # Safety
/// As [`q5_k_avx512`].
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn q5_k_avx512_cols<const C: usize>(x: &[u8], ys: [&[u8]; C]) -> [f32; C] {
    // SAFETY: forwarded from the caller.
    unsafe { k4_avx512_cols::<Q5_K_BYTES, true, C>(x, ys) }
}

/// [`k4_avx512`] for `C` activation rows (two or four; one column is [`k4_avx512`] itself,
/// measured 2-6% faster than this code with `C` = 1): the same decoding of each super-block
/// (nibbles, q5_K's fifth bits, the runs of 64 values, the group scales by `vpermw`), done
/// once for every column; each column then takes the same exact integer sums and the same
/// f32 steps as the single-column kernel, so its bits are that kernel's.
///
/// # Safety
/// The CPU must support AVX-512F/BW, AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn k4_avx512_cols<const N: usize, const FIVE: bool, const C: usize>(
    x: &[u8],
    ys: [&[u8]; C],
) -> [f32; C] {
    let nb = common_blocks(x, N, &ys, Q8_K_BYTES);
    let qs_at = if FIVE { 48 } else { 16 };
    let k4 = k4_constants();
    let mut acc = [0f32; C];
    for b in 0..nb {
        // SAFETY: super-block `b` lies inside `x` (b < nb).
        let bx: &[u8; N] = unsafe { &*x.as_ptr().add(b * N).cast() };
        prefetch_ahead(bx);
        let (scales, mdup) = k4_scales(bx);
        let sc = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(scales)));
        // q5_K's `qh` bytes 16..48, in both 256-bit halves
        let qh = if FIVE {
            Some(_mm512_broadcast_i64x4(ld256(bx, 16)))
        } else {
            None
        };
        // The four runs of 64 values and their group scales.
        let mut w = [_mm512_setzero_si512(); 4];
        let mut g = [_mm512_setzero_si512(); 4];
        for c in 0..2 {
            // SAFETY: nibbles `qs_at + 64 c .. + 64` of the super-block.
            [w[2 * c], w[2 * c + 1]] = unsafe { k4.runs(bx.as_ptr().add(qs_at + 64 * c), qh, c) };
            for t in 0..2 {
                g[2 * c + t] = _mm512_permutexvar_epi16(k4.groups[2 * c + t], sc);
            }
        }
        let (d, dmin) = f16_pair(u32_at(bx, 0));
        for (col, y) in ys.iter().enumerate() {
            // SAFETY: super-block `b` of the activation row lies inside it (b < nb).
            let by: &[u8; Q8_K_BYTES] = unsafe { &*y.as_ptr().add(b * Q8_K_BYTES).cast() };
            // m_g · (bsum_2g + bsum_2g+1), widened to i32 by the multiply-add.
            let mins = _mm256_madd_epi16(ld256(by, 260), mdup);
            let mut sumi = _mm512_setzero_si512();
            for s in 0..4 {
                // SAFETY: the q8_K quants 4 + 64 s .. + 64 of the 292-byte super-block.
                let yv = unsafe { _mm512_loadu_si512(by.as_ptr().add(4 + 64 * s).cast()) };
                let p = _mm512_maddubs_epi16(w[s], yv);
                sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(p, g[s]));
            }
            let sum = _mm256_add_epi32(
                _mm512_castsi512_si256(sumi),
                _mm512_extracti64x4_epi64::<1>(sumi),
            );
            let (isum, msum) = hsum2(sum, mins);
            acc[col] = step_min(acc[col], d, dmin, q8_d(by), isum, msum);
        }
    }
    acc
}

/// The constant vectors of the 512-bit q6_K kernels.
struct Q6Constants {
    /// Low-nibble mask.
    low: __m512i,
    /// The two high bits' place.
    top: __m512i,
    /// The values' offset.
    m32: __m512i,
    /// The qh shifts of the four runs of 32 values: runs 0 | 1 (left by 4 | 2), runs 2 | 3
    /// (right by 0 | 2), one count per 16-bit lane.
    shl: __m512i,
    /// See `shl`.
    shr: __m512i,
    /// Word lane `i` of the scales for the 64 values starting at group `4 s`: scale
    /// `4 s + i / 8`.
    groups: [__m512i; 4],
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
fn q6_constants() -> Q6Constants {
    Q6Constants {
        low: _mm512_set1_epi8(0x0F),
        top: _mm512_set1_epi8(0x30),
        m32: _mm512_set1_epi8(32),
        shl: _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2)),
        shr: _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2)),
        groups: std::array::from_fn(|s| {
            let idx: [i16; 32] = std::array::from_fn(|i| (4 * s + i / 8) as i16);
            // SAFETY: 32 i16 are 64 bytes.
            unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
        }),
    }
}

impl Q6Constants {
    /// Half `h` (128 values) of a q6_K super-block `bx` as two vectors of 64 six-bit values:
    /// the low nibbles of its 64 `ql` bytes with their `qh` bits shifted in, and the high
    /// nibbles likewise (`qh`: the super-block's 64 `qh` bytes).
    ///
    /// # Safety
    /// The CPU must support AVX-512F/BW; `bx` points at a whole super-block.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn half(&self, bx: *const u8, qh: __m512i, h: usize) -> [__m512i; 2] {
        // SAFETY: `ql` bytes 64 h .. 64 h + 64 of the super-block (caller).
        let ql = unsafe { _mm512_loadu_si512(bx.add(64 * h).cast()) };
        let hbits = if h == 0 {
            _mm512_extracti64x4_epi64::<0>(qh)
        } else {
            _mm512_extracti64x4_epi64::<1>(qh)
        };
        let hb = _mm512_broadcast_i64x4(hbits);
        [
            _mm512_or_si512(
                _mm512_and_si512(ql, self.low),
                _mm512_and_si512(_mm512_sllv_epi16(hb, self.shl), self.top),
            ),
            _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), self.low),
                _mm512_and_si512(_mm512_srlv_epi16(hb, self.shr), self.top),
            ),
        ]
    }
}

/// q6_K · q8_K with 512-bit vectors ([`super::dot_q6_k`]): each half super-block (128
/// values) is two vectors of 64 six-bit values — the low nibbles of its 64 `ql` bytes with
/// the `qh` bits shifted in by a per-256-bit-lane variable shift, and the high nibbles
/// likewise — whose `(q − 32)·y` pair sums (`vpmaddubsw` of `q` and of 32, subtracted; no
/// saturation) meet the group scales replicated by one `vpermw` each. The same exact integer
/// sum and the same f32 step as the AVX2 kernel.
///
/// # Safety
/// The CPU must support AVX-512F/BW, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn q6_k_avx512(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q6_K_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let q6 = q6_constants();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx);
        // SAFETY: every load lies inside the super-blocks (210 and 292 bytes): `ql` 0..128,
        // `qh` 128..192, the scales 192..208; the q8_K quants 4..260.
        unsafe {
            let sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(ld128(bx, 192)));
            let qh = _mm512_loadu_si512(bx.as_ptr().add(128).cast());
            let mut sumi = _mm512_setzero_si512();
            for h in 0..2 {
                let q = q6.half(bx.as_ptr(), qh, h);
                for (t, qt) in q.iter().enumerate() {
                    let yv = _mm512_loadu_si512(by.as_ptr().add(4 + 128 * h + 64 * t).cast());
                    let p = _mm512_sub_epi16(
                        _mm512_maddubs_epi16(*qt, yv),
                        _mm512_maddubs_epi16(q6.m32, yv),
                    );
                    let s = _mm512_permutexvar_epi16(q6.groups[2 * h + t], sc);
                    sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(p, s));
                }
            }
            let sum = _mm256_add_epi32(
                _mm512_castsi512_si256(sumi),
                _mm512_extracti64x4_epi64::<1>(sumi),
            );
            let d = f16_to_f32(u16::from_le_bytes([bx[208], bx[209]]));
            acc = step(acc, d, q8_d(by), hsum(sum));
        }
    }
    acc
}

/// [`q6_k_avx512`] for `C` activation rows (two or four; one column is [`q6_k_avx512`]
/// itself): each half super-block (128
/// values) is two vectors of 64 six-bit values — the low nibbles of its 64 `ql` bytes with
/// the `qh` bits shifted in by a per-256-bit-lane variable shift, and the high nibbles
/// likewise — whose `(q − 32)·y` pair sums (`vpmaddubsw` of `q` and of 32, subtracted; no
/// saturation) meet the group scales replicated by one `vpermw` each. The decoded values and
/// scales serve every column; each column takes the same exact integer sum and the same f32
/// step as the AVX2 kernel, whatever `C` is.
///
/// # Safety
/// The CPU must support AVX-512F/BW, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn q6_k_avx512_cols<const C: usize>(x: &[u8], ys: [&[u8]; C]) -> [f32; C] {
    let nb = common_blocks(x, Q6_K_BYTES, &ys, Q8_K_BYTES);
    let q6 = q6_constants();
    let mut acc = [0f32; C];
    for b in 0..nb {
        // SAFETY: super-block `b` lies inside `x` (b < nb).
        let bx: &[u8; Q6_K_BYTES] = unsafe { &*x.as_ptr().add(b * Q6_K_BYTES).cast() };
        prefetch_ahead(bx);
        let mut q = [_mm512_setzero_si512(); 4];
        let mut g = [_mm512_setzero_si512(); 4];
        // SAFETY: every load lies inside the 210-byte super-block: `ql` 0..128, `qh`
        // 128..192, the scales 192..208.
        unsafe {
            let sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(ld128(bx, 192)));
            let qh = _mm512_loadu_si512(bx.as_ptr().add(128).cast());
            for h in 0..2 {
                [q[2 * h], q[2 * h + 1]] = q6.half(bx.as_ptr(), qh, h);
                for t in 0..2 {
                    g[2 * h + t] = _mm512_permutexvar_epi16(q6.groups[2 * h + t], sc);
                }
            }
        }
        let d = f16_to_f32(u16::from_le_bytes([bx[208], bx[209]]));
        for (col, y) in ys.iter().enumerate() {
            // SAFETY: super-block `b` of the activation row lies inside it (b < nb).
            let by: &[u8; Q8_K_BYTES] = unsafe { &*y.as_ptr().add(b * Q8_K_BYTES).cast() };
            let mut sumi = _mm512_setzero_si512();
            for s in 0..4 {
                // SAFETY: the q8_K quants 4 + 64 s .. + 64 of the 292-byte super-block.
                let yv = unsafe { _mm512_loadu_si512(by.as_ptr().add(4 + 64 * s).cast()) };
                let p = _mm512_sub_epi16(
                    _mm512_maddubs_epi16(q[s], yv),
                    _mm512_maddubs_epi16(q6.m32, yv),
                );
                sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(p, g[s]));
            }
            let sum = _mm256_add_epi32(
                _mm512_castsi512_si256(sumi),
                _mm512_extracti64x4_epi64::<1>(sumi),
            );
            acc[col] = step(acc[col], d, q8_d(by), hsum(sum));
        }
    }
    acc
}

/// Eight unsigned 6-bit scale bytes (in `v`) minus 32, as i16 words.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn iq4_scale_words(v: u64) -> __m128i {
    _mm_cvtepi8_epi16(_mm_sub_epi8(_mm_cvtsi64_si128(v as i64), _mm_set1_epi8(32)))
}

/// iq4_xs · q8_K ([`super::dot_iq4_xs`]).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn iq4_xs(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<IQ4_XS_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let low = _mm256_set1_epi8(0x0F);
    let table = _mm256_broadcastsi128_si256(iq4nl_levels());
    let pairs: [__m256i; 4] = std::array::from_fn(|j| {
        let word = |k: usize| ((2 * k) | ((2 * k + 1) << 8)) as i16;
        _mm256_setr_m128i(
            _mm_set1_epi16(word(2 * j)),
            _mm_set1_epi16(word((2 * j + 7) % 8)),
        )
    });
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        prefetch_ahead(bx);
        // Spread the 8 low nibbles and the 8 two-bit high parts of the scales into bytes.
        let mut lo = u64::from(u32_at(bx, 4));
        lo = (lo | (lo << 16)) & 0x0000_FFFF_0000_FFFF;
        lo = (lo | (lo << 8)) & 0x00FF_00FF_00FF_00FF;
        lo = (lo | (lo << 4)) & 0x0F0F_0F0F_0F0F_0F0F;
        let mut hi = u64::from(u16::from_le_bytes([bx[2], bx[3]]));
        hi = (hi | (hi << 24)) & 0x0000_00FF_0000_00FF;
        hi = (hi | (hi << 12)) & 0x000F_000F_000F_000F;
        hi = (hi | (hi << 6)) & 0x0303_0303_0303_0303;
        // The 8 scales minus 32 as i16 words: the low lane in order, the high lane rotated
        // by two words (word w is scale (w + 2) % 8), so that one `vpshufb` per pair of groups
        // picks scale 2j in the low lane and 2j + 1 in the high lane (with the same order in
        // both lanes, the compiler turns the byte shuffle into two slower word shuffles).
        let u = lo | (hi << 4);
        let scales = _mm256_setr_m128i(iq4_scale_words(u), iq4_scale_words(u.rotate_right(16)));
        let mut sumi = _mm256_setzero_si256();
        for (j, pattern) in pairs.iter().enumerate() {
            // Groups 2j and 2j + 1, 16 bytes each: low nibbles are their values 0..16, high
            // nibbles their values 16..32. The activations are regrouped to match, so each
            // product vector holds group 2j in its low lane and group 2j + 1 in its high lane.
            let q = ld256(bx, 8 + 32 * j);
            let klo = _mm256_shuffle_epi8(table, _mm256_and_si256(q, low));
            let khi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(q), low));
            let (ya, yb) = (ld256(by, 4 + 64 * j), ld256(by, 36 + 64 * j));
            let ylo = _mm256_permute2x128_si256::<0x20>(ya, yb);
            let yhi = _mm256_permute2x128_si256::<0x31>(ya, yb);
            let plo = _mm256_maddubs_epi16(_mm256_abs_epi8(ylo), _mm256_sign_epi8(klo, ylo));
            let phi = _mm256_maddubs_epi16(_mm256_abs_epi8(yhi), _mm256_sign_epi8(khi, yhi));
            let s = _mm256_shuffle_epi8(scales, *pattern);
            sumi = _mm256_add_epi32(
                sumi,
                _mm256_add_epi32(_mm256_madd_epi16(plo, s), _mm256_madd_epi16(phi, s)),
            );
        }
        let d = f16_to_f32(u16::from_le_bytes([bx[0], bx[1]]));
        acc = step(acc, d, q8_d(by), hsum(sumi));
    }
    acc
}
