//! The integer GEMM's sources whose stored blocks are not one 32-value block: the low-bit and
//! grid types (tq1_0, tq2_0, mxfp4, q1_0, q2_0, iq2_xxs, iq3_xxs, iq3_s). Each 32-value group
//! of their blocks is exactly 32 small signed integers times one f32 scale, as for q8_0 (the
//! table of [`super::Source`]), so they are packed into the same panels and multiplied by the
//! same kernels once the group is decoded:
//!
//! | type | block | 32 bytes of group `g` | scale |
//! | --- | --- | --- | --- |
//! | tq1_0 | 256 values | trits − 1 | `d` |
//! | tq2_0 | 256 | 2-bit codes − 1 | `d` |
//! | mxfp4 | 32 | doubled FP4 levels (`−12..=12`) | half the E8M0 scale |
//! | q1_0 | 128 | `±1` | `d` |
//! | q2_0 | 64 | 2-bit codes − 1 | `d` |
//! | iq2_xxs | 256 | signed lattice points (`±8, ±25, ±43`) | `(d·(0.5 + s))·0.25` |
//! | iq3_xxs | 256 | signed grid points (`±4..±62`) | `(d·(0.5 + s))·0.5` |
//! | iq3_s | 256 | signed grid points (`±1..±15`) | `d·(2s + 1)` |
//!
//! Every scale is computed with the type's decoder's f32 operations, and each is a product of
//! an f16 (11 significant bits) and a small integer, so the value times the scale is the
//! decoded value bit for bit (tested). The portable functions here define the bytes; the AVX2
//! ones ([`x86::group`], used by the SIMD packers) give the same.

use super::{Source, QK};
use crate::quant::f16_at;
use crate::quant::iq2::unpack_iq2_xxs;
use crate::quant::iq3::{iq3_s_quants, iq3_xxs_quants, IQ3_S_BYTES, IQ3_XXS_BYTES};
use crate::quant::lowbit::{
    e8m0_half, mxfp4_levels, q1_0_signs, q2_0_quants, tq1_0_quants, tq2_0_quants,
};

/// The definition: group `g` of the stored block at byte `at` of `row` (a source of this
/// module) as 32 signed bytes and its scale, from the base crate's unpackers (a whole block
/// unpacked per group: the portable packer and the tests use it, the SIMD packers
/// [`x86::group`]).
pub(super) fn group_ints(src: Source, row: &[u8], at: usize, g: usize) -> ([i8; QK], f32) {
    let b = &row[at..];
    let part = |all: &[i8]| -> [i8; QK] { all[QK * g..QK * (g + 1)].try_into().expect("32") };
    match src {
        Source::Tq1_0 => (part(&tq1_0_quants(b)), f16_at(b, 52)),
        Source::Tq2_0 => (part(&tq2_0_quants(&b[..64])), f16_at(b, 64)),
        Source::Mxfp4 => (mxfp4_levels(&b[1..17]), e8m0_half(b[0])),
        Source::Q1_0 => (part(&q1_0_signs(&b[2..18])), f16_at(b, 0)),
        Source::Q2_0 => (part(&q2_0_quants(&b[2..18])), f16_at(b, 0)),
        Source::Iq2Xxs => {
            let u = unpack_iq2_xxs(b);
            let s = f32::from(u.scales[2 * g]);
            (part(&u.values), f16_at(b, 0) * (0.5 + s) * 0.25)
        }
        Source::Iq3Xxs => {
            let (q, odd) = iq3_xxs_quants(b[..IQ3_XXS_BYTES].try_into().expect("a block"));
            let s = f32::from(odd[g] >> 1);
            (part(&q), f16_at(b, 0) * (0.5 + s) * 0.5)
        }
        Source::Iq3S => {
            let (q, odd) = iq3_s_quants(b[..IQ3_S_BYTES].try_into().expect("a block"));
            (part(&q), f16_at(b, 0) * f32::from(odd[g]))
        }
        Source::Q8_0 | Source::Q4_0 | Source::Q5_0 | Source::Iq4Nl | Source::Iq4Xs => {
            unreachable!("{src:?} is a one-block source")
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::Source;
    use crate::kernels::block_x86::bit_mask;
    use crate::kernels::simd::f16_to_f32;
    use crate::quant::iq1::IQ1_GRID;
    use crate::quant::iq2::grids::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID};
    use crate::quant::iq2::sign_byte;
    use crate::quant::iq3::{IQ3_S_GRID, IQ3_XXS_GRID};
    use crate::quant::lowbit::{e8m0_half, KVALUES_MXFP4};
    use std::arch::x86_64::*;

    /// The f16 at `at` as f32 (exactly).
    ///
    /// # Safety
    /// Two bytes at `at`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn f16_scale(at: *const u8) -> f32 {
        // SAFETY: the caller's two bytes.
        f16_to_f32(unsafe { at.cast::<u16>().read_unaligned() })
    }

    /// `v` negated where `negative` is `0xFF` (`(v ^ m) − m`; magnitudes stay below 128).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn signed(v: __m256i, negative: __m256i) -> __m256i {
        _mm256_sub_epi8(_mm256_xor_si256(v, negative), negative)
    }

    /// The 32 sign bits of four runs of 8 given by 7-bit sign indices (bits `7l..7l + 7` of
    /// `word`, parity completing each byte).
    #[inline(always)]
    fn run_signs(word: u32) -> u32 {
        (0..4).fold(0, |acc, l| {
            acc | u32::from(sign_byte(word >> (7 * l))) << (8 * l)
        })
    }

    /// Eight grid points of four bytes (`table[index(i)]`, `i` in `0..8`) as one vector.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn quads(table: &[u32], index: impl Fn(usize) -> usize) -> __m256i {
        let p = |i: usize| table[index(i)] as i32;
        _mm256_setr_epi32(p(0), p(1), p(2), p(3), p(4), p(5), p(6), p(7))
    }

    /// Byte `j` of `x` shifted right by `2 · (j % 4)` bits (the codes of a 2-bit field
    /// spread four times; bits above the code are left for the caller to mask).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn by_position(x: __m256i) -> __m256i {
        let pick = |p: i8| {
            let m = |j: i8| if j % 4 == p { -1 } else { 0 };
            _mm256_setr_epi8(
                m(0),
                m(1),
                m(2),
                m(3),
                m(4),
                m(5),
                m(6),
                m(7),
                m(8),
                m(9),
                m(10),
                m(11),
                m(12),
                m(13),
                m(14),
                m(15),
                m(16),
                m(17),
                m(18),
                m(19),
                m(20),
                m(21),
                m(22),
                m(23),
                m(24),
                m(25),
                m(26),
                m(27),
                m(28),
                m(29),
                m(30),
                m(31),
            )
        };
        // 16-bit shifts carry the next byte's bits into the top of each byte, above the code
        let v = _mm256_blendv_epi8(x, _mm256_srli_epi16::<2>(x), pick(1));
        let v = _mm256_blendv_epi8(v, _mm256_srli_epi16::<4>(x), pick(2));
        _mm256_blendv_epi8(v, _mm256_srli_epi16::<6>(x), pick(3))
    }

    /// Bytes `x · m` (mod 256) for per-byte multipliers `m`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn mul_bytes(x: __m256i, m: __m256i) -> __m256i {
        let low = _mm256_set1_epi16(0x00FF);
        let even = _mm256_and_si256(_mm256_mullo_epi16(x, _mm256_and_si256(m, low)), low);
        let odd = _mm256_mullo_epi16(_mm256_andnot_si256(low, x), _mm256_srli_epi16::<8>(m));
        _mm256_or_si256(even, odd)
    }

    /// Group `g` of the tq1_0 block at `at` (values `32 g..32 g + 32` of
    /// [`tq1_0_quants`](crate::quant::lowbit::tq1_0_quants)): each value's byte and
    /// power of three gathered in place, then ggml's digit `(b · 3^k mod 256) · 3 >> 8`,
    /// which is 0 below 86, 1 below 171 and 2 from there.
    ///
    /// # Safety
    /// `at` points at a whole tq1_0 block; `g < 8`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn tq1_0_group(at: *const u8, g: usize) -> __m256i {
        let pow = |k: usize| [1i8, 3, 9, 27, 81][k];
        // SAFETY: bytes 0..52 of the block hold the digits (caller).
        let (bytes, mult) = unsafe {
            if g < 5 {
                (_mm256_loadu_si256(at.cast()), _mm256_set1_epi8(pow(g)))
            } else {
                let mid = _mm_loadu_si128(at.add(32).cast());
                let (lo_k, hi_k) = (2 * (g - 5), 2 * (g - 5) + 1);
                if g < 7 {
                    let m = _mm256_set_m128i(_mm_set1_epi8(pow(hi_k)), _mm_set1_epi8(pow(lo_k)));
                    (_mm256_set_m128i(mid, mid), m)
                } else {
                    // values 240..256: digit m / 4 of byte 48 + m % 4
                    let tail = _mm_set1_epi32(at.add(48).cast::<i32>().read_unaligned());
                    let m = _mm_setr_epi8(1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27);
                    (
                        _mm256_set_m128i(tail, mid),
                        _mm256_set_m128i(m, _mm_set1_epi8(pow(4))),
                    )
                }
            }
        };
        let q = mul_bytes(bytes, mult);
        let at_least = |t: i8| {
            let t = _mm256_set1_epi8(t);
            _mm256_cmpeq_epi8(_mm256_max_epu8(q, t), q)
        };
        // −1 + [q ≥ 86] + [q ≥ 171], the masks being −1 where set
        let v = _mm256_sub_epi8(_mm256_set1_epi8(-1), at_least(86));
        _mm256_sub_epi8(v, at_least(171u8 as i8))
    }

    /// Values `32 i..32 i + 32` of the iq2_xs super-block at `at` (`i < 8`): four runs of
    /// 8, each a 16-bit code of a 9-bit lattice index and a 7-bit sign index (for
    /// [`super::super::affine`], whose scales come per 16).
    ///
    /// # Safety
    /// `at` points at a whole iq2_xs super-block.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn iq2_xs_values(at: *const u8, i: usize) -> __m256i {
        // SAFETY: the codes lie at bytes 2..66 (caller).
        let code = |l: usize| unsafe { at.add(2 + 8 * i + 2 * l).cast::<u16>().read_unaligned() };
        let p = |l: usize| IQ2XS_GRID[usize::from(code(l) & 511)] as i64;
        let s = |l: usize| u32::from(sign_byte(u32::from(code(l) >> 9))) << (8 * l);
        let mags = _mm256_setr_epi64x(p(0), p(1), p(2), p(3));
        signed(mags, bit_mask(s(0) | s(1) | s(2) | s(3)))
    }

    /// Values `32 i..32 i + 32` of the iq2_s super-block at `at` (`i < 8`): four runs of 8,
    /// each a 10-bit lattice index (8 bits, then 2 from `qh`) and a sign byte.
    ///
    /// # Safety
    /// `at` points at a whole iq2_s super-block.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn iq2_s_values(at: *const u8, i: usize) -> __m256i {
        // SAFETY: indices at 2..34, signs at 34..66, high bits at 66..74 (caller).
        unsafe {
            let high = *at.add(66 + i);
            let p = |l: usize| {
                let index =
                    usize::from(*at.add(2 + 4 * i + l)) | usize::from(high >> (2 * l) & 3) << 8;
                IQ2S_GRID[index] as i64
            };
            let mags = _mm256_setr_epi64x(p(0), p(1), p(2), p(3));
            let signs = at.add(34 + 4 * i).cast::<u32>().read_unaligned();
            signed(mags, bit_mask(signs))
        }
    }

    /// Values `32 i..32 i + 32` of the iq1_s super-block at `at` (`i < 8`): four grid points
    /// of 8 coordinates in −1..=1, each an 11-bit index (8 bits, then 3 from the group's
    /// `qh` word); the group's shift is [`super::super::affine`]'s minimum.
    ///
    /// # Safety
    /// `at` points at a whole iq1_s super-block.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn iq1_s_values(at: *const u8, i: usize) -> __m256i {
        // SAFETY: indices at 2..34, the `qh` words at 34..50 (caller).
        unsafe {
            let h = at.add(34 + 2 * i).cast::<u16>().read_unaligned();
            let p = |l: usize| {
                let index =
                    usize::from(*at.add(2 + 4 * i + l)) | usize::from(h >> (3 * l) & 7) << 8;
                IQ1_GRID[index] as i64
            };
            _mm256_setr_epi64x(p(0), p(1), p(2), p(3))
        }
    }

    /// Values `32 i..32 i + 32` of the nvfp4 block at `at` (`i < 2`): two sub-blocks of 16,
    /// each 8 code bytes whose low nibbles are its first 8 values and high nibbles the rest.
    ///
    /// # Safety
    /// `at` points at a whole nvfp4 block.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn nvfp4_values(at: *const u8, i: usize) -> __m256i {
        // SAFETY: the codes lie at bytes 4..36 (caller); the table is 16 bytes.
        let (x, levels) = unsafe {
            (
                _mm_loadu_si128(at.add(4 + 16 * i).cast()),
                _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_MXFP4.as_ptr().cast())),
            )
        };
        let low = _mm_set1_epi8(15);
        let (lo, hi) = (
            _mm_and_si128(x, low),
            _mm_and_si128(_mm_srli_epi16::<4>(x), low),
        );
        let codes = _mm256_set_m128i(_mm_unpackhi_epi64(lo, hi), _mm_unpacklo_epi64(lo, hi));
        _mm256_shuffle_epi8(levels, codes)
    }

    /// [`super::group_ints`] as a vector: group `g` of the stored block at `at`.
    ///
    /// # Safety
    /// `at` points at a whole stored block of `src` (one of this module's sources) and `g` is
    /// one of its groups.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(crate) unsafe fn group(src: Source, at: *const u8, g: usize) -> (__m256i, f32) {
        // SAFETY: every arm reads inside the stored block (its layout, see the module table),
        // which the caller guarantees.
        unsafe {
            match src {
                Source::Tq2_0 => {
                    let x = _mm256_loadu_si256(at.add(32 * (g / 4)).cast());
                    let shifted = _mm256_srl_epi16(x, _mm_cvtsi32_si128(2 * (g % 4) as i32));
                    let codes = _mm256_and_si256(shifted, _mm256_set1_epi8(3));
                    let v = _mm256_sub_epi8(codes, _mm256_set1_epi8(1));
                    (v, f16_scale(at.add(64)))
                }
                Source::Mxfp4 => {
                    let levels =
                        _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_MXFP4.as_ptr().cast()));
                    let codes = super::super::unpack_nibbles(_mm_loadu_si128(at.add(1).cast()));
                    (_mm256_shuffle_epi8(levels, codes), e8m0_half(*at))
                }
                Source::Q1_0 => {
                    let bits = at.add(2 + 4 * g).cast::<u32>().read_unaligned();
                    // set bit: +1, clear: −1
                    let v = _mm256_or_si256(
                        _mm256_andnot_si256(bit_mask(bits), _mm256_set1_epi8(-1)),
                        _mm256_set1_epi8(1),
                    );
                    (v, f16_scale(at))
                }
                Source::Iq2Xxs => {
                    let base = at.add(2 + 8 * g);
                    let word = base.add(4).cast::<u32>().read_unaligned();
                    let p = |l: usize| IQ2XXS_GRID[usize::from(*base.add(l))] as i64;
                    let mags = _mm256_setr_epi64x(p(0), p(1), p(2), p(3));
                    let s = f32::from((word >> 28) as u8);
                    let d = f16_scale(at) * (0.5 + s) * 0.25;
                    (signed(mags, bit_mask(run_signs(word))), d)
                }
                Source::Iq3Xxs => {
                    let word = at.add(66 + 4 * g).cast::<u32>().read_unaligned();
                    let mags = quads(&IQ3_XXS_GRID, |i| usize::from(*at.add(2 + 8 * g + i)));
                    let s = f32::from((word >> 28) as u8);
                    let d = f16_scale(at) * (0.5 + s) * 0.5;
                    (signed(mags, bit_mask(run_signs(word))), d)
                }
                Source::Iq3S => {
                    let high = *at.add(66 + g);
                    let mags = quads(&IQ3_S_GRID, |i| {
                        usize::from(*at.add(2 + 8 * g + i)) | (usize::from(high >> i & 1) << 8)
                    });
                    let signs = at.add(74 + 4 * g).cast::<u32>().read_unaligned();
                    let a = (*at.add(106 + g / 2) >> (4 * (g % 2))) & 15;
                    let d = f16_scale(at) * f32::from(2 * a + 1);
                    (signed(mags, bit_mask(signs)), d)
                }
                Source::Q2_0 => {
                    // byte j of the group is code j % 4 of byte j / 4 of its 8 bytes
                    let x = _mm256_set1_epi64x(at.add(2 + 8 * g).cast::<i64>().read_unaligned());
                    let spread = _mm256_shuffle_epi8(
                        x,
                        _mm256_setr_epi8(
                            0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, //
                            4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7,
                        ),
                    );
                    let v = _mm256_and_si256(by_position(spread), _mm256_set1_epi8(3));
                    (_mm256_sub_epi8(v, _mm256_set1_epi8(1)), f16_scale(at))
                }
                Source::Tq1_0 => (tq1_0_group(at, g), f16_scale(at.add(52))),
                Source::Q8_0 | Source::Q4_0 | Source::Q5_0 | Source::Iq4Nl | Source::Iq4Xs => {
                    unreachable!("{src:?} is a one-block source")
                }
            }
        }
    }
}
