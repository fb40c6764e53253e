//! Dot products of the ternary, FP4 and 1-/2-bit types (layouts in [`crate::quant::lowbit`])
//! with their activation partners (see [`super::block_dot`]): TQ1_0 and TQ2_0 with q8_K,
//! MXFP4, NVFP4, Q1_0 and Q2_0 with q8_0.
//!
//! # Definition
//!
//! The portable functions here *define* every product; the AVX2 versions
//! (`dot_lowbit/x86.rs`) return identical bits for every input whose result is not NaN (a
//! NaN result is NaN in both, with an unspecified payload).
//!
//! A product walks the weight blocks in row order, block `b` meeting the activations it
//! covers: one q8_K super-block (TQ1_0, TQ2_0), one q8_0 block (MXFP4), two (NVFP4, Q2_0:
//! 64 values) or four (Q1_0: 128 values). The count of blocks is the smaller of the weight
//! row's whole blocks and the activation row's whole groups of partner blocks; trailing
//! partial blocks are ignored. Below, `y_v` is an activation quant (any byte, `−128..=127`),
//! `w_v` the weight's small integer, `·` one rounded f32 multiplication, `fma` one fused
//! multiply-add rounded once (`f32::mul_add`), `f32(i)` an exact conversion (every sum below
//! is smaller than 2²⁴ in magnitude), and `acc` the single accumulator, starting at `+0.0`.
//!
//! | type  | integer sums (exact `i32`)                              | f32 steps per block                               |
//! |-------|---------------------------------------------------------|---------------------------------------------------|
//! | TQ1_0 | `isum = Σ_v w_v·y_v`, `w = t − 1 ∈ {−1,0,1}` (256 values) | `acc = fma(dx·dy, f32(isum), acc)`                |
//! | TQ2_0 | `isum = Σ_v w_v·y_v`, `w = f − 1 ∈ {−1,0,1,2}`            | `acc = fma(dx·dy, f32(isum), acc)`                |
//! | MXFP4 | `isum = Σ_v K_v·y_v`, `K` the doubled FP4 level (32 values) | `acc = fma(dy·s, f32(isum), acc)`               |
//! | NVFP4 | `isum_s = Σ_{v∈s} K_v·y_v` per sub-block `s < 4` of 16    | for `s = 0..4`: `a_l = fma(dy_{⌊s/2⌋}·u_s, f32(isum_s), a_l)`, `l = 4·(b mod 2) + s` |
//! | Q1_0  | `isum_k = Σ_{v∈k} ±y_v` per q8_0 block `k < 4` of 32      | for `k = 0..4`: `a_l = fma(dx·dy_k, f32(isum_k), a_l)`, `l = 4·(b mod 2) + k` |
//! | Q2_0  | `isum_k = Σ_{v∈k} w_v·y_v`, `w = f − 1 ∈ {−1,0,1,2}`, per q8_0 block `k < 2` | `t = +0.0`; for `k = 0..2`: `t = fma(dy_k, f32(isum_k), t)`; then `acc = fma(dx, t, acc)` |
//!
//! with `dx` the weight block's f16 scale and `dy` the q8_0 f16 scale (both widened exactly),
//! `dy` the q8_K f32 scale for TQ, `s` the MXFP4 half E8M0 scale
//! ([`crate::quant::lowbit::e8m0_half`]) and `u_s` the NVFP4 half UE4M3 scales
//! ([`crate::quant::lowbit::ue4m3_half`]). The result is `acc`, except for NVFP4 and Q1_0:
//! these keep eight independent accumulators `a_0..a_8` (all starting at `+0.0`; block `b`,
//! counted from 0 in row order, feeds `a_{4·(b mod 2)}..a_{4·(b mod 2)+4}`, so no step waits
//! on another of its block), and the result is
//! `((a_0 + a_4) + (a_2 + a_6)) + ((a_1 + a_5) + (a_3 + a_7))` (each `+` rounded). These are
//! ggml's shapes (`ggml_vec_dot_*_generic`: integer sums per block, the scale product, then
//! the sum, Q2_0 with its inner sum over the q8_0 blocks), with each multiply-add fused; NVFP4
//! and Q1_0 only split the accumulation into lanes.
//!
//! The products never read q8_K's group sums, so inconsistent ones do not matter.
//!
//! # No overflow
//!
//! For any bytes: TQ `|isum| ≤ 256·2·128 = 65536`; MXFP4 `|isum| ≤ 32·12·128 = 49152`;
//! NVFP4 `|isum_s| ≤ 16·12·128 = 24576`; Q1_0 `|isum_k| ≤ 32·128 = 4096`; Q2_0
//! `|isum_k| ≤ 32·2·128 = 8192`. All are far inside
//! `i32` and exact in f32.
//!
//! # Error
//!
//! Let `S = Σ_v |x̂_v·ŷ_v|` over the dequantized weight and activation values, and `n` the
//! number of f32 accumulation steps (blocks, or sub-blocks for NVFP4). The integer sums
//! are exact; each step rounds the scale product and the sum (`≤ 2⁻²⁴` relative each), so
//! to first order `|result − Σ_v x̂_v·ŷ_v| ≤ (n + 2)·2⁻²⁴·S` (NVFP4 and Q1_0, whose `n` steps
//! are spread over eight accumulators and then summed in three rounds: `(n/8 + 5)·2⁻²⁴·S`;
//! Q2_0 `(n + 4)·2⁻²⁴·S`), as long as no scale product underflows into f32's subnormal range.
//! The unit tests check `(2n + 16)·2⁻²⁴·S` against the f64 dot product of the dequantized
//! rows.

use super::block_dot::{self, as_i8, avx2_lookup, int_dot, q8_k_scale, step, DotFn, Isa};
use crate::dtype::DType;
use crate::quant::f16_at;
use crate::quant::kquants::Q8_K_BYTES;
use crate::quant::lowbit::{
    e8m0_half, mxfp4_levels, nvfp4_levels, q1_0_signs, q2_0_quants, tq1_0_quants, tq2_0_quants,
    ue4m3_half, MXFP4_BYTES, NVFP4_BYTES, Q1_0_BYTES, Q2_0_BYTES, TQ1_0_BYTES, TQ2_0_BYTES,
};

#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

/// Bytes of one q8_0 block.
const Q8_0_BYTES: usize = 34;

/// The product of `dtype` rows in family `isa`, if `dtype` is one of this module's types
/// (and, for [`Isa::Avx2`], if this CPU has AVX2, FMA and F16C).
pub fn dot_fn(dtype: DType, isa: Isa) -> Option<DotFn> {
    block_dot::family_dot_fn(dtype, isa, portable, avx2)
}

fn portable(dtype: DType) -> Option<DotFn> {
    Some(match dtype {
        DType::TQ1_0 => dot_tq1_0,
        DType::TQ2_0 => dot_tq2_0,
        DType::MXFP4 => dot_mxfp4,
        DType::NVFP4 => dot_nvfp4,
        DType::Q1_0 => dot_q1_0,
        DType::Q2_0 => dot_q2_0,
        _ => return None,
    })
}

avx2_lookup!(unsafe x86 {
    TQ1_0 => tq1_0,
    TQ2_0 => tq2_0,
    MXFP4 => mxfp4,
    NVFP4 => nvfp4,
    Q1_0 => q1_0,
    Q2_0 => q2_0,
});

/// The f32 steps of one Q2_0 block (`N = 2`) given the integer sums of its `N` q8_0 blocks
/// and the scales.
#[inline(always)]
fn q1_0_step<const N: usize>(acc: f32, dx: f32, dy: [f32; N], isum: [i32; N]) -> f32 {
    let mut t = 0f32;
    for k in 0..N {
        t = dy[k].mul_add(isum[k] as f32, t);
    }
    dx.mul_add(t, acc)
}

/// TQ1_0 · q8_K, portable (the definition).
pub fn dot_tq1_0(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<TQ1_0_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        let isum = int_dot(&tq1_0_quants(bx), as_i8(&by[4..260]));
        acc = step(acc, f16_at(bx, 52), q8_k_scale(by), isum);
    }
    acc
}

/// TQ2_0 · q8_K, portable (the definition).
pub fn dot_tq2_0(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<TQ2_0_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        let isum = int_dot(&tq2_0_quants(&bx[..64]), as_i8(&by[4..260]));
        acc = step(acc, f16_at(bx, 64), q8_k_scale(by), isum);
    }
    acc
}

/// MXFP4 · q8_0, portable (the definition).
pub fn dot_mxfp4(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<MXFP4_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_0_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        let isum = int_dot(&mxfp4_levels(&bx[1..]), as_i8(&by[2..]));
        acc = step(acc, f16_at(by, 0), e8m0_half(bx[0]), isum);
    }
    acc
}

/// NVFP4 · q8_0 (two q8_0 blocks per NVFP4 block), portable (the definition).
pub fn dot_nvfp4(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<NVFP4_BYTES>();
    let (yb, _) = y.as_chunks::<{ 2 * Q8_0_BYTES }>();
    let mut acc = [0f32; 8];
    for (b, (bx, by)) in xb.iter().zip(yb).enumerate() {
        let levels = nvfp4_levels(&bx[4..]);
        for s in 0..4 {
            let q8 = &by[(s / 2) * Q8_0_BYTES..];
            let ys = &q8[2 + 16 * (s % 2)..2 + 16 * (s % 2) + 16];
            let isum = int_dot(&levels[16 * s..16 * s + 16], as_i8(ys));
            let l = 4 * (b % 2) + s;
            acc[l] = step(acc[l], f16_at(q8, 0), ue4m3_half(bx[s]), isum);
        }
    }
    reduce8(acc)
}

/// Q1_0 · q8_0 (four q8_0 blocks per Q1_0 block), portable (the definition).
pub fn dot_q1_0(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q1_0_BYTES>();
    let (yb, _) = y.as_chunks::<{ 4 * Q8_0_BYTES }>();
    let mut acc = [0f32; 8];
    for (b, (bx, by)) in xb.iter().zip(yb).enumerate() {
        let signs = q1_0_signs(&bx[2..]);
        let dx = f16_at(bx, 0);
        for k in 0..4 {
            let isum = int_dot(
                &signs[32 * k..32 * k + 32],
                as_i8(&by[k * Q8_0_BYTES + 2..(k + 1) * Q8_0_BYTES]),
            );
            let l = 4 * (b % 2) + k;
            acc[l] = step(acc[l], dx, f16_at(by, k * Q8_0_BYTES), isum);
        }
    }
    reduce8(acc)
}

/// The result of NVFP4 and Q1_0 from their eight accumulators:
/// `((a₀ + a₄) + (a₂ + a₆)) + ((a₁ + a₅) + (a₃ + a₇))`, each `+` rounded.
#[inline(always)]
fn reduce8(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Q2_0 · q8_0 (two q8_0 blocks per Q2_0 block), portable (the definition; every CPU runs it).
pub fn dot_q2_0(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q2_0_BYTES>();
    let (yb, _) = y.as_chunks::<{ 2 * Q8_0_BYTES }>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        let quants = q2_0_quants(&bx[2..]);
        let dy = std::array::from_fn(|k| f16_at(by, k * Q8_0_BYTES));
        let isum = std::array::from_fn(|k| {
            int_dot(
                &quants[32 * k..32 * k + 32],
                as_i8(&by[k * Q8_0_BYTES + 2..(k + 1) * Q8_0_BYTES]),
            )
        });
        acc = q1_0_step::<2>(acc, f16_at(bx, 0), dy, isum);
    }
    acc
}
