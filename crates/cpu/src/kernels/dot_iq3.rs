//! Dot products of iq3_xxs and iq3_s with q8_K activations (see [`super::block_dot`];
//! layouts in [`crate::quant::iq3`], q8_K in [`crate::quant::kquants`]).
//!
//! # Definition
//!
//! The portable functions here *define* both products; the AVX2 versions (`dot_iq3/x86.rs`)
//! return identical bits for every input whose result is not NaN (a NaN result is NaN in
//! both, with an unspecified payload).
//!
//! A weight row and a q8_K row of `n` values hold `n / 256` super-blocks each; super-block
//! `b` of the weights meets super-block `b` of the activations (if the byte lengths disagree,
//! the shorter row's count of whole super-blocks is used). Per super-block, with `q_v` the
//! signed grid coordinate of value `v` (`±grid`), `y_v` the q8_K quant (`−128..=127`, any
//! byte is accepted), `ls_s = 2a_s + 1` the odd integer scale of sub-block `s` (32 values)
//! and `dot_s = Σ_{v∈s} q_v·y_v`, the exact integer sum is
//!
//! `isum = Σ_s ls_s·dot_s` (8 sub-blocks),
//!
//! as in ggml's `ggml_vec_dot_iq3_*_q8_K`. Then, in f32, with `dx` the weight super-block's
//! f16 scale converted exactly and `dy` the q8_K f32 scale, one accumulator `acc` (starting
//! at `+0.0`, super-blocks in row order) is updated by `acc = fma(dx·dy, f32(isum), acc)`,
//! where `·` is one rounded f32 multiplication, `f32(i)` rounds to nearest even and `fma`
//! rounds once. The result is `0.25·acc` for iq3_xxs (its values are `dx·ls·q/4`; ggml also
//! applies the quarter at the end) and `acc` for iq3_s.
//!
//! The sums cannot overflow `i32` for any bytes: `|q| ≤ 62` (iq3_xxs) or `15` (iq3_s),
//! `|y| ≤ 128`, `ls ≤ 31`, so `|isum| ≤ 8·31·32·62·128 < 2²⁶` (iq3_xxs; for iq3_s
//! `8·31·32·15·128 < 2²⁴`, so `f32(isum)` is even exact there).
//!
//! # Error bound
//!
//! The product equals the f64 dot product of the two dequantized rows up to f32 rounding:
//! each super-block step rounds `dx·dy`, `f32(isum)` and the sum, and the dequantized values
//! themselves carry up to three roundings each, so the error is at most about
//! `(2·nb + 6)·2⁻²³·S`, where `nb` is the super-block count and `S = Σ_v |x_v|·|dy·y_v|` with
//! `x_v` the exact weight value (`dx·ls·q/4` or `dx·ls·q`). The unit tests check
//! `(4·nb + 16)·2⁻²⁴·S` (plus `10⁻³⁰` for subnormal products).

use super::block_dot::{self, avx2_lookup, int_dot, q8_k_parts, step, DotFn, Isa};
use crate::dtype::DType;
use crate::quant::f16_at;
use crate::quant::iq3::{iq3_s_quants, iq3_xxs_quants, IQ3_S_BYTES, IQ3_XXS_BYTES};
use crate::quant::kquants::Q8_K_BYTES;
use crate::quant::QK_K;

#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

/// The product of `dtype` rows in family `isa`, if `dtype` is iq3_xxs or iq3_s (and, for
/// [`Isa::Avx2`], if this CPU has AVX2, FMA and F16C).
pub fn dot_fn(dtype: DType, isa: Isa) -> Option<DotFn> {
    block_dot::family_dot_fn(dtype, isa, portable, avx2)
}

fn portable(dtype: DType) -> Option<DotFn> {
    Some(match dtype {
        DType::IQ3_XXS => dot_iq3_xxs,
        DType::IQ3_S => dot_iq3_s,
        _ => return None,
    })
}

avx2_lookup!(unsafe x86 {
    IQ3_XXS => iq3_xxs,
    IQ3_S => iq3_s,
});

/// The final scaling of the iq3_xxs accumulator (its odd scales count quarters).
#[inline(always)]
fn iq3_xxs_finish(acc: f32) -> f32 {
    0.25 * acc
}

/// `isum = Σ_s ls_s·Σ_{v∈s} q_v·y_v` over the 8 sub-blocks of 32 values.
#[inline(always)]
fn scaled_sum(q: &[i8; QK_K], y: &[i8; QK_K], ls: &[u8; 8]) -> i32 {
    ls.iter()
        .zip(q.chunks_exact(32).zip(y.chunks_exact(32)))
        .map(|(&l, (qs, ys))| i32::from(l) * int_dot(qs, ys))
        .sum()
}

/// iq3_xxs · q8_K, portable (the definition).
pub fn dot_iq3_xxs(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<IQ3_XXS_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        let (dy, yq, _) = q8_k_parts(by);
        let (q, ls) = iq3_xxs_quants(bx);
        acc = step(acc, f16_at(bx, 0), dy, scaled_sum(&q, &yq, &ls));
    }
    iq3_xxs_finish(acc)
}

/// iq3_s · q8_K, portable (the definition).
pub fn dot_iq3_s(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<IQ3_S_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        let (dy, yq, _) = q8_k_parts(by);
        let (q, ls) = iq3_s_quants(bx);
        acc = step(acc, f16_at(bx, 0), dy, scaled_sum(&q, &yq, &ls));
    }
    acc
}
