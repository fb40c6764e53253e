//! Small AVX2 + FMA + F16C helpers shared by the x86 block dot-product kernels
//! (`dot_k/x86.rs`, `dot_iq2/x86.rs`, `dot_iq3/x86.rs`, `dot_iq1/x86.rs`, `dot_lowbit/x86.rs`;
//! `dot_legacy/x86.rs` takes [`bit_mask`]): the feature check, bounds-checked unaligned loads
//! of fixed-size blocks, the q8_K scale, and lane reductions.
//!
//! Every helper is `#[inline]` (or `#[inline(always)]`) and, where it uses intrinsics,
//! compiled with the kernels' own `#[target_feature(enable = "avx2,fma,f16c")]`, so it
//! inlines into the kernels exactly as a local helper would. The loads take the block as a
//! `&[u8; N]` and assert the range: the offsets are constants or loop-bounded at every call,
//! so the checks fold away.

use std::arch::x86_64::*;

use super::simd::f16_to_f32;
use crate::quant::kquants::Q8_K_BYTES;

/// Whether this CPU runs the block dot-product kernels (AVX2, FMA and F16C).
pub(crate) fn supported() -> bool {
    crate::isa::get().avx2_fma_f16c()
}

/// The 32 bytes of `b` at `at` (checked; `at` is a constant or loop-bounded at every call,
/// so the check folds away).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn ld256<const N: usize>(b: &[u8; N], at: usize) -> __m256i {
    assert!(at + 32 <= N);
    // SAFETY: the 32 bytes at `at` lie inside `b` (checked above); loadu has no alignment
    // requirement.
    unsafe { _mm256_loadu_si256(b.as_ptr().add(at).cast()) }
}

/// ggml's 16 iq4_nl levels (`KVALUES_IQ4NL`) as one 128-bit table for `vpshufb`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn iq4nl_levels() -> __m128i {
    let bytes: [u8; 16] = crate::quant::legacy::KVALUES_IQ4NL.map(|v| v as u8);
    ld128(&bytes, 0)
}

/// The 16 bytes of `b` at `at` (checked as [`ld256`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn ld128<const N: usize>(b: &[u8; N], at: usize) -> __m128i {
    assert!(at + 16 <= N);
    // SAFETY: the 16 bytes at `at` lie inside `b` (checked above); loadu has no alignment
    // requirement.
    unsafe { _mm_loadu_si128(b.as_ptr().add(at).cast()) }
}

/// The little-endian u64 at byte `at` of `b` (checked; one unaligned load).
#[inline(always)]
pub(crate) fn u64_at<const N: usize>(b: &[u8; N], at: usize) -> u64 {
    assert!(at + 8 <= N);
    // SAFETY: the 8 bytes at `at` lie inside `b` (checked above); read_unaligned has no
    // alignment requirement.
    u64::from_le(unsafe { b.as_ptr().add(at).cast::<u64>().read_unaligned() })
}

/// The little-endian u32 at byte `at` of `b` (checked; one unaligned load).
#[inline(always)]
pub(crate) fn u32_at<const N: usize>(b: &[u8; N], at: usize) -> u32 {
    assert!(at + 4 <= N);
    // SAFETY: the 4 bytes at `at` lie inside `b` (checked above); read_unaligned has no
    // alignment requirement.
    u32::from_le(unsafe { b.as_ptr().add(at).cast::<u32>().read_unaligned() })
}

/// The f32 scale of a q8_K super-block (its first four bytes).
#[inline(always)]
pub(crate) fn q8_d(by: &[u8; Q8_K_BYTES]) -> f32 {
    f32::from_bits(u32_at(by, 0))
}

/// The f16 at byte 0 of a weight super-block, as f32 (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn scale_at0<const N: usize>(b: &[u8; N]) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// Four u64 as the four 64-bit lanes of a vector, the first in the lowest.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn lanes(a: u64, b: u64, c: u64, d: u64) -> __m256i {
    _mm256_setr_epi64x(a as i64, b as i64, c as i64, d as i64)
}

/// The sum of the 8 i32 lanes (wrapping adds; exact whenever the kernel's sums are bounded,
/// as they are in every caller).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// Byte `j` of the result is `0xFF` when bit `j % 8` of byte `j / 8` of `bits` is set, else
/// `0`: 32 bits spread to a byte mask (AVX2 alone, so the integer GEMM's packers use it too).
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn bit_mask(bits: u32) -> __m256i {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, //
            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        ),
    );
    let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits)
}
