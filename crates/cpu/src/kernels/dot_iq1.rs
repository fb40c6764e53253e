//! Dot products of iq1_s and iq1_m with q8_K activations (see [`super::block_dot`];
//! layouts in [`crate::quant::iq1`], q8_K in [`crate::quant::kquants`]).
//!
//! # Definition
//!
//! The portable functions here *define* both products; the AVX2 versions (`dot_iq1/x86.rs`)
//! return identical bits for every input whose result is not NaN (a NaN result is NaN in
//! both, with an unspecified payload).
//!
//! A weight row and a q8_K row of `n` values hold `n / 256` super-blocks each; super-block
//! `b` of the weights meets super-block `b` of the activations (if the byte lengths disagree,
//! the shorter row's count of whole super-blocks is used). A weight value is
//! `dx·ls·(g + σ/8)` with `g` its grid coordinate (`−1..=1`), `ls = 2a + 1` the odd integer
//! scale of its scale group and `σ = ±1` its shift sign. Per super-block, with `y_v` the
//! q8_K quant (`−128..=127`, any byte is accepted) and `bsum_k` the q8_K group sums as stored
//! (never recomputed, never assumed consistent), the exact integer sums are
//!
//! * iq1_s (8 scale groups `s` of 32 values, one shift sign each):
//!   `isum = Σ_s ls_s·Σ_{v∈s} g_v·y_v` and `msum = Σ_s ls_s·σ_s·(bsum_2s + bsum_2s+1)`;
//! * iq1_m (16 scale groups `h` of 16 values, one shift sign per run `r` of 8 values):
//!   `isum = Σ_h ls_h·Σ_{v∈h} g_v·y_v` and `msum = Σ_h ls_h·Σ_{r∈h} σ_r·Σ_{v∈r} y_v`. The
//!   shift here changes every 8 values while the q8_K group sums cover 16, so the run sums
//!   come from the quants (as in ggml's own iq1_m products).
//!
//! Then `t = f32(8·isum + msum)·0.125`, which is exact (`|8·isum + msum| < 2²⁴`, see below)
//! and equals ggml's `sumi + IQ1S_DELTA·sumi1` (respectively `IQ1M_DELTA`), and, in f32, with
//! `dx` the weight super-block's f16 scale converted exactly (for iq1_m gathered from its
//! scale words' top nibbles) and `dy` the q8_K f32 scale, one accumulator `acc` (starting at
//! `+0.0`, super-blocks in row order) is updated by `acc = fma(dx·dy, t, acc)`, where `·` is
//! one rounded f32 multiplication and `fma` rounds once. The result is `acc`.
//!
//! The sums cannot overflow for any bytes: `|g| ≤ 1`, `|y| ≤ 128`, `ls ≤ 15` and
//! `|bsum| ≤ 32768`, so for iq1_s `|isum| ≤ 8·15·32·128 = 491520` and
//! `|msum| ≤ 8·15·2·32768 = 7864320`, hence `|8·isum + msum| ≤ 11796480 < 2²⁴`; for iq1_m
//! both `|isum|` and `|msum|` are at most `16·15·16·128 = 491520` and
//! `|8·isum + msum| < 2²³`.
//!
//! # Error bound
//!
//! With consistent bsums (as the q8_K quantizer writes them) the product equals the f64 dot
//! product of the two dequantized rows up to f32 rounding: `t` is exact, each super-block
//! step rounds `dx·dy` and the sum, and every dequantized value carries two roundings, so the
//! error is at most about `(2·nb + 4)·2⁻²³·S`, where `nb` is the super-block count and
//! `S = Σ_v |dx·ls_v·(g_v + σ_v/8)|·|dy·y_v|`. The unit tests check `(4·nb + 16)·2⁻²⁴·S`
//! (plus `10⁻³⁰` for subnormal products).

use super::block_dot::{self, avx2_lookup, int_dot, q8_k_parts, DotFn, Isa};
use crate::dtype::DType;
use crate::quant::f16_at;
use crate::quant::iq1::{iq1_m_parts, iq1_m_scale, iq1_s_parts, IQ1_M_BYTES, IQ1_S_BYTES};
use crate::quant::kquants::Q8_K_BYTES;

#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

/// The product of `dtype` rows in family `isa`, if `dtype` is iq1_s or iq1_m (and, for
/// [`Isa::Avx2`], if this CPU has AVX2, FMA and F16C).
pub fn dot_fn(dtype: DType, isa: Isa) -> Option<DotFn> {
    block_dot::family_dot_fn(dtype, isa, portable, avx2)
}

fn portable(dtype: DType) -> Option<DotFn> {
    Some(match dtype {
        DType::IQ1_S => dot_iq1_s,
        DType::IQ1_M => dot_iq1_m,
        _ => return None,
    })
}

avx2_lookup!(unsafe x86 {
    IQ1_S => iq1_s,
    IQ1_M => iq1_m,
});

/// One super-block's update of the accumulator: `t = f32(8·isum + msum)·0.125` (exact),
/// then `fma(dx·dy, t, acc)`. Shared by every version so the f32 sequence is one.
#[inline(always)]
fn step(acc: f32, dx: f32, dy: f32, isum: i32, msum: i32) -> f32 {
    let t = (8 * isum + msum) as f32 * 0.125;
    (dx * dy).mul_add(t, acc)
}

/// iq1_s · q8_K, portable (the definition).
pub fn dot_iq1_s(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<IQ1_S_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        let (dy, yq, bsums) = q8_k_parts(by);
        let (g, ls, neg) = iq1_s_parts(bx);
        let (mut isum, mut msum) = (0i32, 0i32);
        for s in 0..8 {
            let l = i32::from(ls[s]);
            isum += l * int_dot(&g[32 * s..32 * s + 32], &yq[32 * s..32 * s + 32]);
            let pair = i32::from(bsums[2 * s]) + i32::from(bsums[2 * s + 1]);
            msum += if neg[s] { -l * pair } else { l * pair };
        }
        acc = step(acc, f16_at(bx, 0), dy, isum, msum);
    }
    acc
}

/// iq1_m · q8_K, portable (the definition).
pub fn dot_iq1_m(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<IQ1_M_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        let (dy, yq, _) = q8_k_parts(by);
        let (g, ls, neg) = iq1_m_parts(bx);
        let (mut isum, mut msum) = (0i32, 0i32);
        for h in 0..16 {
            let l = i32::from(ls[h]);
            isum += l * int_dot(&g[16 * h..16 * h + 16], &yq[16 * h..16 * h + 16]);
            let shift: i32 = (2 * h..2 * h + 2)
                .map(|r| {
                    let s: i32 = yq[8 * r..8 * r + 8].iter().map(|&v| i32::from(v)).sum();
                    if neg[r] {
                        -s
                    } else {
                        s
                    }
                })
                .sum();
            msum += l * shift;
        }
        acc = step(acc, iq1_m_scale(bx).to_f32(), dy, isum, msum);
    }
    acc
}
