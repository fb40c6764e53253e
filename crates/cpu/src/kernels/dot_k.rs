//! Dot products of the K-quants (q2_K..q6_K) and iq4_xs with q8_K activations (see
//! [`super::block_dot`]; layouts in [`crate::quant::kquants`]).
//!
//! # Definition
//!
//! The portable functions here *define* every product; the AVX2 versions (`dot_k/x86.rs`)
//! return identical bits for every input whose result is not NaN (a NaN result is NaN in
//! both, with an unspecified payload).
//!
//! A weight row and a q8_K row of `n` values hold `n / 256` super-blocks each; super-block
//! `b` of the weights meets super-block `b` of the activations (if the byte lengths disagree,
//! the shorter row's count of whole super-blocks is used). Per super-block, with `q_v` the
//! weight quant of value `v`, `y_v` the q8_K quant (`−128..=127`, any byte is accepted),
//! `bsum_k` the q8_K group sums as stored (never recomputed, never assumed consistent),
//! `dy` the q8_K f32 scale, and `dot_g = Σ_{v∈g} q_v·y_v`:
//!
//! | type   | integer sums (exact `i32`)                                           |
//! |--------|----------------------------------------------------------------------|
//! | q2_K   | `isum = Σ_g sc_g·dot_g` (16 groups), `msum = Σ_g m_g·bsum_g`           |
//! | q3_K   | `isum = Σ_g sc_g·dot_g`, `q` in `−4..=3`, `sc` in `−32..=31`            |
//! | q4_K   | `isum = Σ_g sc_g·dot_g` (8 groups), `msum = Σ_g m_g·(bsum_2g + bsum_2g+1)` |
//! | q5_K   | as q4_K with `q` in `0..=31`                                          |
//! | q6_K   | `isum = Σ_g sc_g·dot_g`, `q` in `−32..=31`, `sc` the stored `i8`        |
//! | iq4_xs | `isum = Σ_g sc_g·dot_g`, `q` the table value (`−127..=113`), `sc` in `−32..=31` |
//!
//! Then, in f32 with `dx` (and `dmin`) the weight super-block's f16 scales converted exactly,
//! the accumulator `acc` (starting at `+0.0`, super-blocks in row order, one accumulator) is
//! updated by
//!
//! * q3_K, q6_K, iq4_xs: `acc = fma(dx·dy, f32(isum), acc)`;
//! * q2_K, q4_K, q5_K: `acc = fma(dx·dy, f32(isum), acc)`, then
//!   `acc = fma(−(dmin·dy), f32(msum), acc)`;
//!
//! where `·` is one rounded f32 multiplication, `f32(i)` rounds to nearest even and `fma`
//! rounds once. The result is `acc`.
//!
//! The sums cannot overflow `i32` for any bytes: the largest magnitudes are
//! `|isum| ≤ 256·128·32·128 = 2²⁷` (q6_K: `|sc| ≤ 128`, `|q| ≤ 32`, `|y| ≤ 128`) and
//! `|msum| ≤ 8·63·2·32768 < 2²⁵` (q4_K/q5_K).
//!
//! With consistent bsums (`bsum_k = Σ` of its 16 quants, as the q8_K quantizer writes them)
//! the product equals the f64 dot product of the two dequantized rows up to f32 rounding:
//! each super-block step rounds `dx·dy`, `f32(isum)` and the sum, so the error is at most
//! about `(2·nb + 4)·2⁻²³·S` where `nb` is the super-block count and `S = Σ_v (|d·sc_v·q_v| +
//! |dmin·m_v|)·|dy·y_v|` (the unit tests check `(4·nb + 16)·2⁻²⁴·S`).

use super::block_dot::{self, avx2_lookup, int_dot, q8_k_parts, step, DotFn, Isa};
use crate::dtype::DType;
use crate::quant::f16_at;
use crate::quant::kquants::{
    iq4_xs_quants, iq4_xs_scales, k4_scales_mins, q3_k_quants, q3_k_scales, q5_k_quants,
    q6_k_quants, unpack_2bit, unpack_4bit, IQ4_XS_BYTES, Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES,
    Q5_K_BYTES, Q6_K_BYTES, Q8_K_BYTES,
};
use crate::quant::QK_K;

#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

/// The product of `dtype` rows in family `isa`, if `dtype` is one of this module's types
/// (and, for [`Isa::Avx2`], if this CPU has AVX2, FMA and F16C).
pub fn dot_fn(dtype: DType, isa: Isa) -> Option<DotFn> {
    block_dot::family_dot_fn_wide(dtype, isa, portable, avx2, avx512)
}

/// The family's 512-bit products (AVX-512F/BW with AVX2, FMA and F16C).
fn avx512(dtype: DType) -> Option<DotFn> {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::get().avx512_bw() && super::block_x86::supported() {
        return match dtype {
            DType::Q4_K => Some(avx512_entry::q4_k),
            DType::Q5_K => Some(avx512_entry::q5_k),
            DType::Q6_K => Some(avx512_entry::q6_k),
            _ => None,
        };
    }
    let _ = dtype;
    None
}

/// The family's 512-bit products of one weight row with `C` activation rows at once (each
/// super-block decoded once for all of them; column `c` has the bits of the single-row
/// product with `ys[c]`): q4_K, q5_K and q6_K, on CPUs with AVX-512F/BW.
pub fn dot_cols_fn<const C: usize>(dtype: DType) -> Option<block_dot::DotColsFn<C>> {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::get().avx512_bw() && super::block_x86::supported() {
        return match dtype {
            DType::Q4_K => Some(avx512_entry::q4_k_cols::<C>),
            DType::Q5_K => Some(avx512_entry::q5_k_cols::<C>),
            DType::Q6_K => Some(avx512_entry::q6_k_cols::<C>),
            _ => None,
        };
    }
    let _ = dtype;
    None
}

/// Safe entry points to the 512-bit kernels, handed out only by `avx512` after its check.
#[cfg(target_arch = "x86_64")]
mod avx512_entry {
    pub(super) fn q4_k_cols<const C: usize>(x: &[u8], ys: [&[u8]; C]) -> [f32; C] {
        // SAFETY: only `dot_cols_fn` hands this out, once AVX-512F/BW, AVX2, FMA and F16C
        // are confirmed: all the kernel requires.
        unsafe { super::x86::q4_k_avx512_cols(x, ys) }
    }

    pub(super) fn q5_k_cols<const C: usize>(x: &[u8], ys: [&[u8]; C]) -> [f32; C] {
        // SAFETY: as for `q4_k_cols`.
        unsafe { super::x86::q5_k_avx512_cols(x, ys) }
    }

    pub(super) fn q6_k_cols<const C: usize>(x: &[u8], ys: [&[u8]; C]) -> [f32; C] {
        // SAFETY: as for `q4_k_cols`.
        unsafe { super::x86::q6_k_avx512_cols(x, ys) }
    }

    pub(super) fn q4_k(x: &[u8], y: &[u8]) -> f32 {
        // SAFETY: only `avx512` hands this out, once AVX-512F/BW, AVX2, FMA and F16C are
        // confirmed: all the kernel requires.
        unsafe { super::x86::q4_k_avx512(x, y) }
    }

    pub(super) fn q5_k(x: &[u8], y: &[u8]) -> f32 {
        // SAFETY: as for `q4_k`.
        unsafe { super::x86::q5_k_avx512(x, y) }
    }

    pub(super) fn q6_k(x: &[u8], y: &[u8]) -> f32 {
        // SAFETY: only `avx512` hands this out, once AVX-512F/BW, AVX2, FMA and F16C are
        // confirmed: all the kernel requires.
        unsafe { super::x86::q6_k_avx512(x, y) }
    }
}

fn portable(dtype: DType) -> Option<DotFn> {
    Some(match dtype {
        DType::Q2_K => dot_q2_k,
        DType::Q3_K => dot_q3_k,
        DType::Q4_K => dot_q4_k,
        DType::Q5_K => dot_q5_k,
        DType::Q6_K => dot_q6_k,
        DType::IQ4_XS => dot_iq4_xs,
        _ => return None,
    })
}

avx2_lookup!(unsafe x86 {
    Q2_K => q2_k,
    Q3_K => q3_k,
    Q4_K => q4_k,
    Q5_K => q5_k,
    Q6_K => q6_k,
    IQ4_XS => iq4_xs,
});

/// One super-block's update for the types with minimums: the scale term, then the
/// minimum term `fma(−(dmin·dy), f32(msum), ·)`.
#[inline(always)]
fn step_min(acc: f32, dx: f32, dmin: f32, dy: f32, isum: i32, msum: i32) -> f32 {
    let acc = (dx * dy).mul_add(isum as f32, acc);
    (-(dmin * dy)).mul_add(msum as f32, acc)
}

/// `isum = Σ_g sc_g·dot_g` over groups of `len` values.
#[inline(always)]
fn scaled_sum<T: Copy + Into<i32>, S: Copy + Into<i32>>(
    q: &[T; QK_K],
    y: &[i8; QK_K],
    scales: &[S],
    len: usize,
) -> i32 {
    scales
        .iter()
        .enumerate()
        .map(|(g, &s)| s.into() * int_dot(&q[len * g..len * (g + 1)], &y[len * g..]))
        .sum()
}

/// q2_K · q8_K, portable (the definition).
pub fn dot_q2_k(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q2_K_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        let (dy, yq, bsums) = q8_k_parts(by);
        let q = unpack_2bit(&bx[16..80]);
        let sc: [u8; 16] = std::array::from_fn(|g| bx[g] & 15);
        let isum = scaled_sum(&q, &yq, &sc, 16);
        let msum: i32 = (0..16)
            .map(|g| i32::from(bx[g] >> 4) * i32::from(bsums[g]))
            .sum();
        acc = step_min(acc, f16_at(bx, 80), f16_at(bx, 82), dy, isum, msum);
    }
    acc
}

/// q3_K · q8_K, portable (the definition).
pub fn dot_q3_k(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q3_K_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        let (dy, yq, _) = q8_k_parts(by);
        let q = q3_k_quants(&bx[0..32], &bx[32..96]);
        let isum = scaled_sum(&q, &yq, &q3_k_scales(&bx[96..108]), 16);
        acc = step(acc, f16_at(bx, 108), dy, isum);
    }
    acc
}

/// The q4_K / q5_K step given the super-block's quants.
#[inline(always)]
fn k4_step(acc: f32, bx: &[u8], q: &[u8; QK_K], by: &[u8; Q8_K_BYTES]) -> f32 {
    let (dy, yq, bsums) = q8_k_parts(by);
    let (sc, m) = k4_scales_mins(&bx[4..16]);
    let isum = scaled_sum(q, &yq, &sc, 32);
    let msum: i32 = (0..8)
        .map(|g| i32::from(m[g]) * (i32::from(bsums[2 * g]) + i32::from(bsums[2 * g + 1])))
        .sum();
    step_min(acc, f16_at(bx, 0), f16_at(bx, 2), dy, isum, msum)
}

/// q4_K · q8_K, portable (the definition).
pub fn dot_q4_k(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q4_K_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        acc = k4_step(acc, bx, &unpack_4bit(&bx[16..144]), by);
    }
    acc
}

/// q5_K · q8_K, portable (the definition).
pub fn dot_q5_k(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q5_K_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        acc = k4_step(acc, bx, &q5_k_quants(&bx[16..48], &bx[48..176]), by);
    }
    acc
}

/// q6_K · q8_K, portable (the definition).
pub fn dot_q6_k(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q6_K_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        let (dy, yq, _) = q8_k_parts(by);
        let q = q6_k_quants(&bx[0..128], &bx[128..192]);
        let sc: [i8; 16] = std::array::from_fn(|g| bx[192 + g] as i8);
        let isum = scaled_sum(&q, &yq, &sc, 16);
        acc = step(acc, f16_at(bx, 208), dy, isum);
    }
    acc
}

/// iq4_xs · q8_K, portable (the definition).
pub fn dot_iq4_xs(x: &[u8], y: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<IQ4_XS_BYTES>();
    let (yb, _) = y.as_chunks::<Q8_K_BYTES>();
    let mut acc = 0f32;
    for (bx, by) in xb.iter().zip(yb) {
        let (dy, yq, _) = q8_k_parts(by);
        let q = iq4_xs_quants(&bx[8..136]);
        let sc = iq4_xs_scales(u16::from_le_bytes([bx[2], bx[3]]), &bx[4..8]);
        let isum = scaled_sum(&q, &yq, &sc, 32);
        acc = step(acc, f16_at(bx, 0), dy, isum);
    }
    acc
}
