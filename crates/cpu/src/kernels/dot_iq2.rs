//! Dot products of the 2-bit i-quants (iq2_xxs, iq2_xs, iq2_s) with q8_K activations (see
//! [`super::block_dot`]; layouts in [`crate::quant::iq2`] and [`crate::quant::kquants`]).
//!
//! # Definition
//!
//! The portable functions here *define* the three products; the AVX2 versions
//! (`dot_iq2/x86.rs`) return identical bits for every input whose result is not NaN (a NaN
//! result is NaN in both, with an unspecified payload).
//!
//! A weight row and a q8_K row of `n` values hold `n / 256` super-blocks each; super-block
//! `b` of the weights meets super-block `b` of the activations (if the byte lengths disagree,
//! the shorter row's count of whole super-blocks is used). Per super-block, with `w_v` the
//! signed lattice value of weight `v` (`±8`, `±25` or `±43`: magnitude from the lattice table,
//! sign from the sign bits, see [`crate::quant::iq2::Unpacked`]), `y_v` the q8_K quant
//! (`−128..=127`: any byte is accepted; the q8_K group sums are not used), `s_g` the 4-bit
//! scale of the 16-value group `g` and `ls_g = 2·s_g + 1` its odd form, the exact `i32` sum is
//!
//! ```text
//! isum = Σ_g ls_g · Σ_{v ∈ g} w_v·y_v        (16 groups of 16 values)
//! ```
//!
//! (iq2_xxs stores one scale per 32 values, so its two groups of a sub-block share `ls`: this
//! is ggml's per-32-value sum times `ls`.) Then, in f32, with `dx` the weight super-block's
//! f16 scale converted exactly and `dy` the q8_K f32 scale, one accumulator `acc` starting at
//! `+0.0`, super-blocks in row order:
//!
//! ```text
//! acc = fma(dx·dy, f32(isum), acc)        per super-block
//! result = 0.125 · acc
//! ```
//!
//! where `·` is one rounded f32 multiplication, `f32(i)` rounds to nearest even (exact for
//! `|i| ≤ 2²⁴`) and `fma` rounds once. This is ggml's arithmetic shape (`sumf += d·bsum`, then
//! `0.125·sumf`) with the multiply-add fused. The factor: `dx·(0.5 + s)·0.25 = dx·ls/8`, the
//! decoded scale of the group.
//!
//! # No overflow
//!
//! For any bytes: `|w_v| ≤ 43`, `|y_v| ≤ 128`, so a group's sum is at most `16·43·128 =
//! 88064` in magnitude, times `ls ≤ 31` is `2 729 984`, and the 16 groups give
//! `|isum| ≤ 43 679 744 < 2²⁶`: far inside `i32`.
//!
//! # Error bound
//!
//! Let `x̂_v = d·(0.5 + s)·0.25·w_v` and `ŷ_v = dy·y_v` be the dequantized values (as the
//! codecs decode them) and `S = Σ_v |x̂_v·ŷ_v|`. Away from f32 underflow (no subnormal
//! intermediate) and overflow, the result differs from the f64 dot product `Σ_v x̂_v·ŷ_v` by
//! at most `(nb + 6)·2⁻²⁴·S`, `nb` being the super-block count: decoding rounds each `x̂_v`
//! twice and each `ŷ_v` once (`≤ 3·2⁻²⁴` relative per term); each step rounds `dx·dy` and
//! `f32(isum)` (`≤ 2·2⁻²⁴` relative per super-block term); the `nb` additions round each
//! partial sum, whose magnitudes are at most `S` (to first order); `·0.125` is exact. The unit
//! tests check exactly this bound.

use super::block_dot::{self, as_i8, avx2_lookup, int_dot, q8_k_scale, step, DotFn, Isa};
use crate::dtype::DType;
use crate::quant::f16_at;
use crate::quant::iq2::{
    unpack_iq2_s, unpack_iq2_xs, unpack_iq2_xxs, Unpacked, IQ2_S_BYTES, IQ2_XS_BYTES, IQ2_XXS_BYTES,
};
use crate::quant::kquants::Q8_K_BYTES;
use crate::quant::QK_K;

#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

/// The product of `dtype` rows in family `isa`, if `dtype` is one of this module's types
/// (and, for [`Isa::Avx2`], if this CPU has AVX2, FMA and F16C).
pub fn dot_fn(dtype: DType, isa: Isa) -> Option<DotFn> {
    block_dot::family_dot_fn(dtype, isa, portable, avx2)
}

fn portable(dtype: DType) -> Option<DotFn> {
    Some(match dtype {
        DType::IQ2_XXS => dot_iq2_xxs,
        DType::IQ2_XS => dot_iq2_xs,
        DType::IQ2_S => dot_iq2_s,
        _ => return None,
    })
}

avx2_lookup!(unsafe x86 {
    IQ2_XXS => iq2_xxs,
    IQ2_XS => iq2_xs,
    IQ2_S => iq2_s,
});

/// The result from the accumulator: the factor 1/8 of the odd scales, `0.125·acc`.
#[inline(always)]
fn finish(acc: f32) -> f32 {
    0.125 * acc
}

/// `isum` of one unpacked weight super-block and the quants of a q8_K super-block.
#[inline(always)]
fn isum(u: &Unpacked, by: &[u8; Q8_K_BYTES]) -> i32 {
    let yq = &by[4..4 + QK_K];
    u.scales
        .iter()
        .zip(u.values.chunks_exact(16).zip(yq.chunks_exact(16)))
        .map(|(&s, (w, y))| (2 * i32::from(s) + 1) * int_dot(w, as_i8(y)))
        .sum()
}

/// The portable product over super-blocks of `BYTES` bytes unpacked by `unpack`.
#[inline(always)]
fn dot_with<const BYTES: usize>(x: &[u8], y: &[u8], unpack: fn(&[u8]) -> Unpacked) -> f32 {
    let (xb, _) = x.as_chunks::<BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        acc = step(acc, f16_at(bx, 0), q8_k_scale(by), isum(&unpack(bx), by));
    }
    finish(acc)
}

/// iq2_xxs · q8_K, portable (the definition).
pub fn dot_iq2_xxs(x: &[u8], y: &[u8]) -> f32 {
    dot_with::<IQ2_XXS_BYTES>(x, y, unpack_iq2_xxs)
}

/// iq2_xs · q8_K, portable (the definition).
pub fn dot_iq2_xs(x: &[u8], y: &[u8]) -> f32 {
    dot_with::<IQ2_XS_BYTES>(x, y, unpack_iq2_xs)
}

/// iq2_s · q8_K, portable (the definition).
pub fn dot_iq2_s(x: &[u8], y: &[u8]) -> f32 {
    dot_with::<IQ2_S_BYTES>(x, y, unpack_iq2_s)
}
