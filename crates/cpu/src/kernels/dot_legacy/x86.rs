//! AVX2 + FMA + F16C versions of the products of [`super`], bit-identical to the portable
//! definition.
//!
//! Per iteration 8 blocks: each block's 32 products are summed to 8 `i32` partial sums
//! (`maddubs` to pairs in `i16`, `madd` with ones to fours in `i32`), a `hadd` tree turns the 8
//! blocks' vectors into one vector of their 8 exact sums (lane `k` = block `8g + k`), and the
//! 8 blocks' f16 scales of both rows are fetched (broadcast loads and blends) and widened by
//! `cvtph`.
//!
//! # No saturation
//!
//! `_mm256_maddubs_epi16(u, s)` multiplies unsigned bytes `u` by signed bytes `s` and adds
//! adjacent pairs with *signed saturation* to `i16`; it is exact as long as
//! `|u₀s₀ + u₁s₁| ≤ 32767`. The activation bytes `s` are arbitrary (`−128..=127`).
//!
//! * q4_1, q5_1: `u` is the unsigned weight (`0..=15`, `0..=31`), `s` the activation:
//!   `|pair| ≤ 2·31·128 = 7936`.
//! * q5_0, iq4_nl: the weight `w` is signed (`−16..=15`, `−127..=113`). The sign goes to the
//!   weight, not to the activation: `u = |y|` (`_mm256_sign_epi8(y, y)` gives `−128` for
//!   `y = −128`, whose byte 0x80 read unsigned is exactly 128) and `s = w·sgn(y)`
//!   (`_mm256_sign_epi8(w, y)`, which cannot overflow since `w ≥ −127`). Then
//!   `u·s = |y|·sgn(y)·w = y·w` exactly, and `|pair| ≤ 2·128·127 = 32512 ≤ 32767`. (The usual
//!   order, `|w|` times `y·sgn(w)`, would negate `y = −128` back to `−128` and get the sign
//!   of the product wrong.)
//!
//! `_mm256_madd_epi16` with ones then adds pairs of exact `i16` values into `i32`, and the
//! `hadd` tree adds `i32` values bounded by `32·127·128`: nothing wraps.

use std::arch::x86_64::*;

use super::super::block_x86::{bit_mask, iq4nl_levels};
use super::super::simd::{f16_to_f32, prefetch_ahead};
use super::{block_count, kind, partner_bytes, reduce8, weight_bytes, LANES};

/// Whether this CPU runs the kernels of this module (AVX2, FMA and F16C).
pub fn available() -> bool {
    crate::isa::get().avx2_fma_f16c()
}

/// 32 nibbles in value order (low nibbles of the 16 bytes at `p`, then their high nibbles),
/// one per byte.
///
/// # Safety
/// `p` must be valid for reading 16 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes at `p`; the load is unaligned.
    let both = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(p.cast())) };
    // The upper copy shifted right by 4 (a broadcast load plus one variable shift instead of
    // a shift and an insert).
    let shifted = _mm256_srlv_epi64(both, _mm256_setr_epi64x(0, 0, 4, 4));
    _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F))
}

/// The sum of `w_j · y_j` for unsigned weights `w` (`0..=31`) and activations `y` as 8 `i32`
/// partial sums (exact, see the module docs).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_unsigned(w: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, y), _mm256_set1_epi16(1))
}

/// The sum of `w_j · y_j` for signed weights `w` (`−127..=127`) as 8 `i32` partial sums,
/// exact for every activation byte (see the module docs).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_signed(w: __m256i, y: __m256i) -> __m256i {
    let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(y, y), _mm256_sign_epi8(w, y));
    _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
}

/// 8 `i32` partial sums of the products of the weight block at `x` (kind `K`) and the
/// partner block at `y`.
///
/// # Safety
/// `x` must be valid for reading one weight block of kind `K`, `y` one partner block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_sums<const K: u8>(x: *const u8, y: *const u8) -> __m256i {
    // SAFETY: the caller guarantees whole blocks at `x` and `y`; every offset below lies
    // inside them (the quants are the last 16 or 32 bytes of each block, `qh` sits at 2..6
    // or 4..8), and all loads are unaligned.
    unsafe {
        let yq = _mm256_loadu_si256(y.add(partner_bytes(K) - 32).cast());
        match K {
            kind::Q4_1 => dot_unsigned(nibbles(x.add(4)), yq),
            kind::Q5_1 => {
                let qh = x.add(4).cast::<u32>().read_unaligned();
                let fifth = _mm256_and_si256(bit_mask(u32::from_le(qh)), _mm256_set1_epi8(0x10));
                dot_unsigned(_mm256_or_si256(nibbles(x.add(8)), fifth), yq)
            }
            kind::Q5_0 => {
                // q − 16 as a signed byte: the nibble where the fifth bit is set, else the
                // nibble with the top four bits set (nibble − 16).
                let qh = x.add(2).cast::<u32>().read_unaligned();
                let off = _mm256_andnot_si256(bit_mask(u32::from_le(qh)), _mm256_set1_epi8(-16));
                dot_signed(_mm256_or_si256(nibbles(x.add(6)), off), yq)
            }
            _ => {
                // The table in both 128-bit halves; nibbles (< 16) index within their half.
                let t = iq4nl_levels();
                let table = _mm256_set_m128i(t, t);
                dot_signed(_mm256_shuffle_epi8(table, nibbles(x.add(2))), yq)
            }
        }
    }
}

/// One vector of the 8 blocks' exact sums (lane `k` = `Σ p[k]`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum_blocks(p: &[__m256i; 8]) -> __m256i {
    // hadd adds neighbours within each 128-bit half: after two levels, half h of `q0123`
    // holds [Σ half h of p0, … of p3]; adding the halves completes each block's sum.
    let q01 = _mm256_hadd_epi32(p[0], p[1]);
    let q23 = _mm256_hadd_epi32(p[2], p[3]);
    let q45 = _mm256_hadd_epi32(p[4], p[5]);
    let q67 = _mm256_hadd_epi32(p[6], p[7]);
    let q0123 = _mm256_hadd_epi32(q01, q23);
    let q4567 = _mm256_hadd_epi32(q45, q67);
    let lo = _mm256_permute2x128_si256::<0x20>(q0123, q4567);
    let hi = _mm256_permute2x128_si256::<0x31>(q0123, q4567);
    _mm256_add_epi32(lo, hi)
}

/// The 32-bit word at the start of block `k` (blocks `stride` bytes apart from `p`), in all
/// lanes.
///
/// # Safety
/// `p + k·stride` must be valid for reading 4 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn head(p: *const u8, k: usize, stride: usize) -> __m256i {
    // SAFETY: guaranteed by the caller; the read is unaligned.
    _mm256_set1_epi32(unsafe { p.add(k * stride).cast::<i32>().read_unaligned() })
}

/// The 32-bit words at the starts of 8 blocks `stride` bytes apart from `p` (lane `k` from
/// block `k`): eight broadcast loads merged by blends, which measured about twice as fast as
/// one `vpgatherdd` on Zen 3.
///
/// # Safety
/// `p` must be valid for reading 8 blocks of `stride ≥ 4` bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_heads(p: *const u8, stride: usize) -> __m256i {
    // SAFETY: word k lies at the start of block k, inside the 8 blocks.
    unsafe {
        let w01 = _mm256_blend_epi32::<0b0000_0010>(head(p, 0, stride), head(p, 1, stride));
        let w23 = _mm256_blend_epi32::<0b0000_1000>(head(p, 2, stride), head(p, 3, stride));
        let w45 = _mm256_blend_epi32::<0b0010_0000>(head(p, 4, stride), head(p, 5, stride));
        let w67 = _mm256_blend_epi32::<0b1000_0000>(head(p, 6, stride), head(p, 7, stride));
        _mm256_blend_epi32::<0b1111_0000>(
            _mm256_blend_epi32::<0b0000_1100>(w01, w23),
            _mm256_blend_epi32::<0b1100_0000>(w45, w67),
        )
    }
}

/// Two vectors of 8 f32, widened exactly from f16: the low halves of the 8 words of
/// `lo_words`, and the high (`hi_shift`) or low halves of the 8 words of `hi_words`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn widen_halves(lo_words: __m256i, hi_words: __m256i, hi_shift: bool) -> (__m256, __m256) {
    let mask = _mm256_set1_epi32(0xFFFF);
    let lo = _mm256_and_si256(lo_words, mask);
    let hi = if hi_shift {
        _mm256_srli_epi32::<16>(hi_words)
    } else {
        _mm256_and_si256(hi_words, mask)
    };
    // packus per 128-bit half: [lo0..3, hi0..3 | lo4..7, hi4..7] (values fit in u16, no
    // saturation); the permute puts the four 64-bit groups in order lo0..7, hi0..7.
    let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(lo, hi));
    (
        _mm256_cvtph_ps(_mm256_castsi256_si128(packed)),
        _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(packed)),
    )
}

/// Defines a product of kind `K` over whole rows (see [`super`]'s module docs for the
/// arithmetic) whose groups of 8 blocks go through `$group`, compiled with `$features`: a
/// macro so that the group function inlines into a driver with its own target features.
macro_rules! row_product {
    ($(#[$doc:meta])* $name:ident, $group:ident, $features:literal) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        unsafe fn $name<const K: u8>(a: &[u8], b: &[u8]) -> f32 {
            let (wb, pb) = (weight_bytes(K), partner_bytes(K));
            let nb = block_count::<K>(a, b);
            let groups = nb / LANES;
            let mut acc = _mm256_setzero_ps();
            for g in 0..groups {
                prefetch_ahead(a.as_ptr().wrapping_add(g * LANES * wb), LANES * wb);
                // SAFETY: blocks 8g .. 8g + 8 lie inside both rows (g < groups ≤ nb / 8).
                acc = unsafe {
                    $group::<K>(
                        a.as_ptr().add(g * LANES * wb),
                        b.as_ptr().add(g * LANES * pb),
                        acc,
                    )
                };
            }
            let mut lanes = [0.0f32; LANES];
            // SAFETY: `lanes` holds 8 f32; the store is unaligned.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
            // The last rest < 8 blocks one at a time into their lanes, step 2 of the
            // definition in scalar form (the exact integer sum from the vector kernel, then
            // the same two fused multiply-adds): a vector step would pay a whole group's scale
            // gathering for a couple of blocks, which rows of a few hundred values (a small
            // model's) feel.
            for (i, lane) in lanes.iter_mut().enumerate().take(nb - groups * LANES) {
                let block = groups * LANES + i;
                // SAFETY: block `block` < nb lies inside both rows.
                let (x, y) = unsafe { (a.as_ptr().add(block * wb), b.as_ptr().add(block * pb)) };
                // SAFETY: whole blocks at `x` and `y`.
                let isum = hsum_i32(unsafe { block_sums::<K>(x, y) });
                // SAFETY: each block starts with its f16 scale (and, with a minimum, a second
                // f16).
                let (dx, dy) = unsafe { (f16_scalar(x), f16_scalar(y)) };
                *lane = (isum as f32).mul_add(dx * dy, *lane);
                if super::has_min(K) {
                    // SAFETY: as above, the second f16 of each block.
                    let (mx, sy) = unsafe { (f16_scalar(x.add(2)), f16_scalar(y.add(2))) };
                    *lane = mx.mul_add(sy, *lane);
                }
            }
            reduce8(&lanes)
        }
    };
}

row_product!(
    /// The product of kind `K` with AVX2.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    dot,
    group,
    "avx2,fma,f16c"
);

row_product!(
    /// The products of kind `K` with 512-bit vectors and `vpdpbusd` (see [`group512`]): the
    /// same exact integer sums and the same f32 steps as [`dot`], hence the same bits.
    ///
    /// # Safety
    /// The CPU must support AVX-512F/BW/VNNI, AVX2, FMA and F16C.
    dot512,
    group512,
    "avx512f,avx512bw,avx512vnni,avx2,fma,f16c"
);

/// [`group`] with two blocks per 512-bit vector: their nibbles are loaded into the four
/// 128-bit lanes as `[A, A, B, B]` and one variable shift splits low and high nibbles, the
/// 64 activation bytes are two loads, and `vpdpbusd` multiplies unsigned weights by the
/// activations directly — signed weights (q5_0, iq4_nl) as `|y| · (w · sign y)`, exact for
/// every byte (`|w| ≤ 127`, `|y| ≤ 128`). The vector's halves hold each block's partial sums.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VNNI, AVX2, FMA and F16C; `x` and `y` must point to 8
/// whole blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn group512<const K: u8>(x: *const u8, y: *const u8, acc: __m256) -> __m256 {
    let (wb, pb) = (weight_bytes(K), partner_bytes(K));
    // The nibble bytes' offset in a weight block, and `qh`'s.
    let (qs, qh_at) = match K {
        kind::Q4_1 => (4, 0),
        kind::Q5_0 => (6, 2),
        kind::Q5_1 => (8, 4),
        _ => (2, 0),
    };
    let shifts = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
    let low = _mm512_set1_epi8(0x0F);
    let table = _mm512_broadcast_i32x4(iq4nl_levels());
    let mut p = [_mm256_setzero_si256(); LANES];
    // SAFETY: 8 whole blocks at `x` and `y` (caller); every offset below lies inside block
    // `2 j` or `2 j + 1`, and all loads are unaligned.
    unsafe {
        for j in 0..LANES / 2 {
            let (xa, xb) = (x.add(2 * j * wb), x.add((2 * j + 1) * wb));
            let (ya, yb) = (y.add(2 * j * pb), y.add((2 * j + 1) * pb));
            let both = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128(
                    xa.add(qs).cast(),
                ))),
                _mm256_broadcastsi128_si256(_mm_loadu_si128(xb.add(qs).cast())),
            );
            let nib = _mm512_and_si512(_mm512_srlv_epi64(both, shifts), low);
            let yv = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(ya.add(pb - 32).cast())),
                _mm256_loadu_si256(yb.add(pb - 32).cast()),
            );
            // The fifth bits of both blocks as one 64-bit mask (block A's in the low half).
            let fifth = || {
                let a = u64::from(u32::from_le(xa.add(qh_at).cast::<u32>().read_unaligned()));
                let b = u64::from(u32::from_le(xb.add(qh_at).cast::<u32>().read_unaligned()));
                a | (b << 32)
            };
            let sums = match K {
                kind::Q4_1 => _mm512_dpbusd_epi32(_mm512_setzero_si512(), nib, yv),
                kind::Q5_1 => {
                    let w = _mm512_mask_add_epi8(nib, fifth(), nib, _mm512_set1_epi8(0x10));
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, yv)
                }
                _ => {
                    let w = if K == kind::Q5_0 {
                        // q − 16: the nibble where the fifth bit is set, else nibble − 16.
                        _mm512_mask_sub_epi8(nib, !fifth(), nib, _mm512_set1_epi8(16))
                    } else {
                        _mm512_shuffle_epi8(table, nib)
                    };
                    let negative = _mm512_movepi8_mask(yv);
                    let signed = _mm512_mask_sub_epi8(w, negative, _mm512_setzero_si512(), w);
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(yv), signed)
                }
            };
            p[2 * j] = _mm512_castsi512_si256(sums);
            p[2 * j + 1] = _mm512_extracti64x4_epi64::<1>(sums);
        }
        let isum = _mm256_cvtepi32_ps(sum_blocks(&p));
        scale_sums::<K>(isum, block_heads(x, wb), block_heads(y, pb), acc)
    }
}

/// Step 2 of the definition for 8 consecutive blocks at `x` (weights) and `y` (partner), block
/// `j` into lane `j`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x` and `y` must point to 8 whole blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group<const K: u8>(x: *const u8, y: *const u8, acc: __m256) -> __m256 {
    let (wb, pb) = (weight_bytes(K), partner_bytes(K));
    // SAFETY: 8 whole blocks at `x` and `y` (caller).
    unsafe {
        let mut p = [_mm256_setzero_si256(); LANES];
        for (k, slot) in p.iter_mut().enumerate() {
            *slot = block_sums::<K>(x.add(k * wb), y.add(k * pb));
        }
        let isum = _mm256_cvtepi32_ps(sum_blocks(&p));
        scale_sums::<K>(isum, block_heads(x, wb), block_heads(y, pb), acc)
    }
}

/// `acc` plus the 8 blocks' exact sums `isum` times their scales: `xh`/`yh` hold each block's
/// first word (the f16 scale, and for q4_1/q5_1 and q8_1 the min or scaled sum above it).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_sums<const K: u8>(isum: __m256, xh: __m256i, yh: __m256i, acc: __m256) -> __m256 {
    if super::has_min(K) {
        let (dx, mx) = widen_halves(xh, xh, true);
        let (dy, sy) = widen_halves(yh, yh, true);
        let acc = _mm256_fmadd_ps(isum, _mm256_mul_ps(dx, dy), acc);
        _mm256_fmadd_ps(mx, sy, acc)
    } else {
        let (dx, dy) = widen_halves(xh, yh, false);
        _mm256_fmadd_ps(isum, _mm256_mul_ps(dx, dy), acc)
    }
}

/// The exact sum of the 8 `i32` lanes of `v` (bounded by the block sums: no overflow).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_i32(v: __m256i) -> i32 {
    let s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32::<0b01>(s2)))
}

/// The f16 at `p` widened to f32 (exact).
///
/// # Safety
/// 2 bytes must be readable at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_scalar(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes; the read is unaligned.
    f16_to_f32(u16::from_le(unsafe { p.cast::<u16>().read_unaligned() }))
}

/// q4_1 row · q8_1 row with AVX2 (same bits as [`super::dot_q4_1_q8_1_portable`]).
pub fn dot_q4_1_q8_1(a: &[u8], b: &[u8]) -> f32 {
    if !available() {
        return super::dot_q4_1_q8_1_portable(a, b);
    }
    // SAFETY: AVX2, FMA and F16C were detected.
    unsafe { dot::<{ kind::Q4_1 }>(a, b) }
}

/// q5_0 row · q8_0 row with AVX2 (same bits as [`super::dot_q5_0_q8_0_portable`]).
pub fn dot_q5_0_q8_0(a: &[u8], b: &[u8]) -> f32 {
    if !available() {
        return super::dot_q5_0_q8_0_portable(a, b);
    }
    // SAFETY: AVX2, FMA and F16C were detected.
    unsafe { dot::<{ kind::Q5_0 }>(a, b) }
}

/// q5_1 row · q8_1 row with AVX2 (same bits as [`super::dot_q5_1_q8_1_portable`]).
pub fn dot_q5_1_q8_1(a: &[u8], b: &[u8]) -> f32 {
    if !available() {
        return super::dot_q5_1_q8_1_portable(a, b);
    }
    // SAFETY: AVX2, FMA and F16C were detected.
    unsafe { dot::<{ kind::Q5_1 }>(a, b) }
}

/// iq4_nl row · q8_0 row with AVX2 (same bits as [`super::dot_iq4_nl_q8_0_portable`]).
/// The 512-bit products ([`dot512`]) of `dtype`, when the CPU runs them (AVX-512F/BW/VNNI,
/// AVX2, FMA and F16C).
pub fn wide(dtype: crate::dtype::DType) -> Option<super::DotFn> {
    use crate::dtype::DType;
    if !(available() && crate::isa::get().avx512_bw_vnni()) {
        return None;
    }
    Some(match dtype {
        DType::Q4_1 => wide_entry::q4_1,
        DType::Q5_0 => wide_entry::q5_0,
        DType::Q5_1 => wide_entry::q5_1,
        DType::IQ4_NL => wide_entry::iq4_nl,
        _ => return None,
    })
}

/// Safe entry points to [`dot512`], handed out only by [`wide`] after its check.
mod wide_entry {
    use super::{dot512, kind};

    macro_rules! entries {
        ($($name:ident => $kind:ident),+) => {$(
            pub(super) fn $name(a: &[u8], b: &[u8]) -> f32 {
                // SAFETY: only `wide` hands this out, once the CPU's features are confirmed.
                unsafe { dot512::<{ kind::$kind }>(a, b) }
            }
        )+};
    }
    entries!(q4_1 => Q4_1, q5_0 => Q5_0, q5_1 => Q5_1, iq4_nl => IQ4_NL);
}

pub fn dot_iq4_nl_q8_0(a: &[u8], b: &[u8]) -> f32 {
    if !available() {
        return super::dot_iq4_nl_q8_0_portable(a, b);
    }
    // SAFETY: AVX2, FMA and F16C were detected.
    unsafe { dot::<{ kind::IQ4_NL }>(a, b) }
}
