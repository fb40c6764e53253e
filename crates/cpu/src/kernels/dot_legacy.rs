//! Dot products of the 32-value block types q4_1, q5_0, q5_1 and iq4_nl with their partner
//! activation types (see [`super::block_dot`]): q5_0 and iq4_nl with q8_0, q4_1 and q5_1 with
//! q8_1. Byte layouts are those of [`crate::quant::legacy`] and [`crate::quant::BlockQ8_0`].
//!
//! # The arithmetic (every version computes exactly this)
//!
//! A product takes `nb = min(a.len() / weight block bytes, b.len() / partner block bytes)`
//! blocks (trailing partial blocks are ignored). For block `i`:
//!
//! 1. `isum_i = Σ_j w_j · y_j` over its 32 values, exactly in `i32`, where `y_j` is the
//!    activation's signed quant and `w_j` the weight's integer: the nibble `0..=15` (q4_1), the
//!    5-bit `q` `0..=31` (q5_1), `q − 16` (q5_0), or the table level `T[q]` (iq4_nl).
//!    `|isum_i| ≤ 32·127·128 < 2²⁴`, so converting it to `f32` is exact.
//! 2. With the f16 scales widened exactly (`dx`, `mx` of the weight block, `dy`, `sy` of the
//!    activation block) and `fma` a fused multiply-add rounded once (`f32::mul_add`):
//!    `acc[i % 8] = fma(isum_i as f32, dx · dy, acc[i % 8])`, then for q4_1/q5_1
//!    `acc[i % 8] = fma(mx, sy, acc[i % 8])`. (`dx · dy` and `mx · sy` are products of two
//!    11-bit significands and therefore exact.) Blocks feed their lanes in index order.
//! 3. The result is `((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) +
//!    (acc[3] + acc[7]))` (halves, then quarters, then the last pair: [`reduce8`]), except
//!    that a NaN result is returned as the canonical quiet NaN [`f32::NAN`]: which NaN payload
//!    survives an operation with two NaN operands depends on instruction operand order, so
//!    NaN scales (any f16 bit pattern is accepted) would otherwise leave the versions
//!    different in payload only.
//!
//! The AVX2 version processes 8 blocks per iteration, so block `8g + k` lands in vector lane
//! `k = i % 8`: the 8 integer sums come out as one `__m256i`, one `cvtepi32_ps` and one FMA
//! (two for q4_1/q5_1) with the 8 scale products update all lanes, and a tail of fewer than 8
//! blocks runs the portable step on the stored lanes. The results are therefore identical bit
//! for bit, for every input.
//!
//! # Error
//!
//! Against the exact value `S = Σ_i (dx·dy·isum_i + mx·sy)` (what the f64 dot of the decoded
//! rows gives, up to the decoded values' own f32 rounding and except that q8_1's stored `sy`
//! stands in for `dy·Σy_j`; the tests check both parts), the result is within
//! `(k + 3)·2⁻²⁴ · Σ_i (|dx·dy·isum_i| + |mx·sy|)` to first order, with `k` the number of
//! roundings a lane sees: `⌈nb/8⌉` (q5_0, iq4_nl) or `2⌈nb/8⌉` (q4_1, q5_1).

use super::block_dot::{self, avx2_lookup, DotFn, Isa};
use crate::dtype::DType;
use crate::quant::legacy::{
    f16_at, unpack_nibbles, IQ4_NL_BYTES, KVALUES_IQ4NL, Q4_1_BYTES, Q5_0_BYTES, Q5_1_BYTES,
    Q8_1_BYTES, QK,
};

#[cfg(target_arch = "x86_64")]
mod x86;

/// Bytes of one q8_0 block.
use super::quant_dot::Q8_0_BYTES;
/// Accumulator lanes of the arithmetic (block `i` feeds lane `i % LANES`).
pub const LANES: usize = 8;

/// The product of `dtype` rows in family `isa`, if `dtype` is one of this module's types
/// (`None` as well for [`Isa::Avx2`] on a CPU without AVX2, FMA and F16C).
pub fn dot_fn(dtype: DType, isa: Isa) -> Option<DotFn> {
    block_dot::family_dot_fn_wide(dtype, isa, portable, avx2, avx512)
}

/// The family's 512-bit products (VNNI), where the CPU runs them.
fn avx512(dtype: DType) -> Option<DotFn> {
    #[cfg(target_arch = "x86_64")]
    return x86::wide(dtype);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = dtype;
        None
    }
}

fn portable(dtype: DType) -> Option<DotFn> {
    Some(match dtype {
        DType::Q4_1 => dot_q4_1_q8_1_portable,
        DType::Q5_0 => dot_q5_0_q8_0_portable,
        DType::Q5_1 => dot_q5_1_q8_1_portable,
        DType::IQ4_NL => dot_iq4_nl_q8_0_portable,
        _ => return None,
    })
}

avx2_lookup!(x86 {
    Q4_1 => dot_q4_1_q8_1,
    Q5_0 => dot_q5_0_q8_0,
    Q5_1 => dot_q5_1_q8_1,
    IQ4_NL => dot_iq4_nl_q8_0,
});

/// The weight types of this module, as const-generic tags.
mod kind {
    pub const Q4_1: u8 = 0;
    pub const Q5_0: u8 = 1;
    pub const Q5_1: u8 = 2;
    pub const IQ4_NL: u8 = 3;
}

/// Bytes of a weight block of kind `K`.
const fn weight_bytes(k: u8) -> usize {
    match k {
        kind::Q4_1 => Q4_1_BYTES,
        kind::Q5_0 => Q5_0_BYTES,
        kind::Q5_1 => Q5_1_BYTES,
        _ => IQ4_NL_BYTES,
    }
}

/// Whether kind `K` has a minimum (and so pairs with q8_1 and its sum `s`).
const fn has_min(k: u8) -> bool {
    matches!(k, kind::Q4_1 | kind::Q5_1)
}

/// Bytes of the partner block of kind `K` (q8_1 or q8_0).
const fn partner_bytes(k: u8) -> usize {
    if has_min(k) {
        Q8_1_BYTES
    } else {
        Q8_0_BYTES
    }
}

/// The 32 integers `w_j` of a weight block of kind `K`.
#[inline(always)]
fn weight_ints<const K: u8>(x: &[u8]) -> [i32; QK] {
    let u32_at = |at: usize| u32::from_le_bytes([x[at], x[at + 1], x[at + 2], x[at + 3]]);
    let q = match K {
        kind::Q4_1 => unpack_nibbles(&x[4..], None),
        kind::Q5_0 => unpack_nibbles(&x[6..], Some(u32_at(2))),
        kind::Q5_1 => unpack_nibbles(&x[8..], Some(u32_at(4))),
        _ => unpack_nibbles(&x[2..], None),
    };
    std::array::from_fn(|j| match K {
        kind::Q5_0 => i32::from(q[j]) - 16,
        kind::IQ4_NL => i32::from(KVALUES_IQ4NL[usize::from(q[j])]),
        _ => i32::from(q[j]),
    })
}

/// Step 1 and 2 of the arithmetic for one weight block `x` and its partner block `y`: returns
/// the new value of the block's lane `acc`.
#[inline(always)]
fn block_step<const K: u8>(x: &[u8], y: &[u8], acc: f32) -> f32 {
    let w = weight_ints::<K>(x);
    let yq = &y[partner_bytes(K) - QK..partner_bytes(K)];
    let isum: i32 = w
        .iter()
        .zip(yq)
        .map(|(&w, &q)| w * i32::from(q as i8))
        .sum();
    let acc = (isum as f32).mul_add(f16_at(x, 0) * f16_at(y, 0), acc);
    if has_min(K) {
        f16_at(x, 2).mul_add(f16_at(y, 2), acc)
    } else {
        acc
    }
}

/// Step 3 of the arithmetic: the fixed reduction of the 8 lanes (NaN made canonical).
#[inline(always)]
pub fn reduce8(acc: &[f32; LANES]) -> f32 {
    let h: [f32; 4] = std::array::from_fn(|i| acc[i] + acc[i + 4]);
    let q = [h[0] + h[2], h[1] + h[3]];
    let r = q[0] + q[1];
    if r.is_nan() {
        f32::NAN
    } else {
        r
    }
}

/// Number of whole block pairs of a product of kind `K`.
#[inline(always)]
fn block_count<const K: u8>(a: &[u8], b: &[u8]) -> usize {
    (a.len() / weight_bytes(K)).min(b.len() / partner_bytes(K))
}

/// Runs step 2 for blocks `from..nb` into `acc` (the portable product and the SIMD tails).
#[inline(always)]
fn blocks_into<const K: u8>(a: &[u8], b: &[u8], from: usize, acc: &mut [f32; LANES]) {
    let (wb, pb) = (weight_bytes(K), partner_bytes(K));
    for i in from..block_count::<K>(a, b) {
        let lane = &mut acc[i % LANES];
        *lane = block_step::<K>(&a[i * wb..(i + 1) * wb], &b[i * pb..(i + 1) * pb], *lane);
    }
}

/// The portable product of kind `K`: the definition.
fn dot_portable<const K: u8>(a: &[u8], b: &[u8]) -> f32 {
    let mut acc = [0.0f32; LANES];
    blocks_into::<K>(a, b, 0, &mut acc);
    reduce8(&acc)
}

/// q4_1 row · q8_1 row, portable (the definition; see the module docs).
pub fn dot_q4_1_q8_1_portable(a: &[u8], b: &[u8]) -> f32 {
    dot_portable::<{ kind::Q4_1 }>(a, b)
}

/// q5_0 row · q8_0 row, portable (the definition; see the module docs).
pub fn dot_q5_0_q8_0_portable(a: &[u8], b: &[u8]) -> f32 {
    dot_portable::<{ kind::Q5_0 }>(a, b)
}

/// q5_1 row · q8_1 row, portable (the definition; see the module docs).
pub fn dot_q5_1_q8_1_portable(a: &[u8], b: &[u8]) -> f32 {
    dot_portable::<{ kind::Q5_1 }>(a, b)
}

/// iq4_nl row · q8_0 row, portable (the definition; see the module docs).
pub fn dot_iq4_nl_q8_0_portable(a: &[u8], b: &[u8]) -> f32 {
    dot_portable::<{ kind::IQ4_NL }>(a, b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::block_dot;
    use crate::quant::legacy;
    use half::f16;

    /// The module's weight types: dtype, kind tag, partner dtype.
    const TYPES: [(DType, u8, DType); 4] = [
        (DType::Q4_1, kind::Q4_1, DType::Q8_1),
        (DType::Q5_0, kind::Q5_0, DType::Q8_0),
        (DType::Q5_1, kind::Q5_1, DType::Q8_1),
        (DType::IQ4_NL, kind::IQ4_NL, DType::Q8_0),
    ];

    /// xorshift32, so the tests need no randomness crate.
    struct Rng(u32);
    impl Rng {
        fn next(&mut self) -> u32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 17;
            self.0 ^= self.0 << 5;
            self.0
        }
        /// Uniform in [-1, 1).
        fn unit(&mut self) -> f32 {
            (self.next() >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        }
        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    /// How [`scale_bits`] picks scales.
    #[derive(Clone, Copy, PartialEq)]
    enum Scales {
        /// Moderate values of either sign (f16 of ±[0, 2⁴)).
        Moderate,
        /// A quarter of them any bit pattern but NaN (zeros, subnormals, the largest values,
        /// infinities); the rest moderate.
        Wild,
        /// As `Wild`, and about one in 50 a NaN.
        WithNaN,
    }

    /// f16 bits of a scale (see [`Scales`]).
    fn scale_bits(rng: &mut Rng, mode: Scales) -> [u8; 2] {
        let r = rng.next() % 64;
        let bits = if mode == Scales::WithNaN && r == 0 {
            0x7C01 | (rng.next() as u16 & 0x83FF) // a NaN of either sign, any payload
        } else if mode != Scales::Moderate && r < 16 {
            let b = rng.next() as u16;
            if b & 0x7C00 == 0x7C00 {
                b & 0xFC00 // NaN → infinity of the same sign
            } else {
                b
            }
        } else {
            let v = rng.unit() * 2f32.powi((rng.next() % 12) as i32 - 8);
            f16::from_f32(v).to_bits()
        };
        bits.to_le_bytes()
    }

    /// Random bytes for `blocks` blocks of `dtype` (a weight type, q8_0 or q8_1) with scales
    /// from [`scale_bits`]; some blocks hold extreme quants (all bits clear, all bits set,
    /// for activations −128 and 127 patterns).
    fn raw_row(rng: &mut Rng, dtype: DType, blocks: usize, mode: Scales) -> Vec<u8> {
        let size = dtype.type_size();
        let n_scales = if matches!(dtype, DType::Q4_1 | DType::Q5_1 | DType::Q8_1) {
            2
        } else {
            1
        };
        let mut row = rng.bytes(blocks * size);
        for b in row.chunks_exact_mut(size) {
            for s in 0..n_scales {
                b[2 * s..2 * s + 2].copy_from_slice(&scale_bits(rng, mode));
            }
            let body = 2 * n_scales;
            match rng.next() % 8 {
                0 => b[body..].fill(0x00),
                1 => b[body..].fill(0xFF),
                2 => b[body..].fill(0x80), // −128 for activations
                3 => {
                    for (j, v) in b[body..].iter_mut().enumerate() {
                        *v = if j % 3 == 0 { 0x80 } else { 0x7F };
                    }
                }
                _ => {}
            }
        }
        row
    }

    /// `dtype` bytes of the f32 row `x` (any type with a byte codec, q8_0 included).
    fn quantize(dtype: DType, x: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; dtype.row_size(x.len()).unwrap()];
        dtype.row_from_f32(x, &mut out).unwrap();
        out
    }

    fn dequantize(dtype: DType, bytes: &[u8]) -> Vec<f32> {
        let mut y = vec![0.0f32; bytes.len() / dtype.type_size() * QK];
        dtype.row_to_f32(bytes, &mut y).unwrap();
        y
    }

    fn random_values(rng: &mut Rng, n: usize) -> Vec<f32> {
        let mut x: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
        for c in x.chunks_exact_mut(QK) {
            let scale = 2f32.powi((rng.next() % 10) as i32 - 5);
            let offset = if rng.next().is_multiple_of(2) {
                rng.unit() * scale
            } else {
                0.0
            };
            c.iter_mut().for_each(|v| *v = *v * scale + offset);
        }
        x
    }

    /// Weight/activation row pairs of `blocks` blocks for `(dtype, partner)`, with the
    /// [`Scales`] of their raw rows: quantized by the codecs from random values, raw random
    /// bytes with moderate scales, wild ones, and wild ones with NaNs.
    fn row_pairs(
        rng: &mut Rng,
        dtype: DType,
        partner: DType,
        blocks: usize,
    ) -> Vec<(Vec<u8>, Vec<u8>, Scales)> {
        let n = blocks * QK;
        let (x, y) = (random_values(rng, n), random_values(rng, n));
        let (qx, qy) = (quantize(dtype, &x), quantize(partner, &y));
        let mut out = vec![(qx.clone(), qy.clone(), Scales::Moderate)];
        for mode in [Scales::Moderate, Scales::Wild, Scales::WithNaN] {
            let (rx, ry) = (
                raw_row(rng, dtype, blocks, mode),
                raw_row(rng, partner, blocks, mode),
            );
            out.push((qx.clone(), ry.clone(), mode));
            out.push((rx.clone(), qy.clone(), mode));
            out.push((rx, ry, mode));
        }
        out
    }

    const BLOCK_COUNTS: [usize; 17] = [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 23, 31, 33, 64, 129, 9, 3];

    #[test]
    fn every_isa_matches_portable_bit_for_bit() {
        let mut rng = Rng(0xDEC0_DE01);
        for (dtype, _, partner) in TYPES {
            for (t, blocks) in BLOCK_COUNTS.into_iter().enumerate() {
                for (a, b, _) in row_pairs(&mut rng, dtype, partner, blocks) {
                    let want = dot_fn(dtype, Isa::Portable).unwrap()(&a, &b);
                    for isa in Isa::available() {
                        let dot = block_dot::dot_fn_with(dtype, isa).unwrap();
                        let got = dot(&a, &b);
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{dtype:?} {isa:?}, {blocks} blocks (case {t}): {got:e} vs {want:e}"
                        );
                        // Any alignment of either row: same bits.
                        let mut buf_a = vec![0u8; a.len() + 1];
                        let mut buf_b = vec![0u8; b.len() + 3];
                        buf_a[1..].copy_from_slice(&a);
                        buf_b[3..].copy_from_slice(&b);
                        assert_eq!(dot(&buf_a[1..], &buf_b[3..]).to_bits(), want.to_bits());
                    }
                }
            }
        }
    }

    /// Longer rows (the sizes of real models) with quantized data only.
    #[test]
    fn long_rows_match_bit_for_bit() {
        let mut rng = Rng(77);
        for (dtype, _, partner) in TYPES {
            for n in [32, 64, 96, 288, 576, 1536, 4096 + 32, 14336] {
                let (x, y) = (random_values(&mut rng, n), random_values(&mut rng, n));
                let (a, b) = (quantize(dtype, &x), quantize(partner, &y));
                let want = dot_fn(dtype, Isa::Portable).unwrap()(&a, &b);
                for isa in Isa::available() {
                    let got = block_dot::dot_fn_with(dtype, isa).unwrap()(&a, &b);
                    assert_eq!(got.to_bits(), want.to_bits(), "{dtype:?} {isa:?} n = {n}");
                }
            }
        }
    }

    /// The portable product is within the module docs' bound of the exact per-block formula,
    /// and that formula is the f64 dot of the decoded rows up to the decode's f32 rounding
    /// and (q8_1) the difference between the stored sum `s` and the decoded block sum.
    #[test]
    fn portable_close_to_f64_dot_of_decoded_rows() {
        let mut rng = Rng(4242);
        for (dtype, k, partner) in TYPES {
            let (wb, pb) = (weight_bytes(k), partner_bytes(k));
            for blocks in BLOCK_COUNTS {
                for (a, b, mode) in row_pairs(&mut rng, dtype, partner, blocks) {
                    if mode != Scales::Moderate {
                        continue;
                    }
                    let got = f64::from(dot_fn(dtype, Isa::Portable).unwrap()(&a, &b));
                    let (xd, yd) = (dequantize(dtype, &a), dequantize(partner, &b));
                    let decoded: f64 = xd
                        .iter()
                        .zip(&yd)
                        .map(|(&u, &v)| f64::from(u) * f64::from(v))
                        .sum();
                    let decode_slack: f64 = xd
                        .iter()
                        .zip(&yd)
                        .map(|(&u, &v)| (f64::from(u) * f64::from(v)).abs())
                        .sum::<f64>()
                        * 2f64.powi(-23);
                    let (mut exact, mut magnitude, mut s_slack) = (0.0f64, 0.0f64, 0.0f64);
                    for i in 0..blocks {
                        let (x, y) = (&a[i * wb..(i + 1) * wb], &b[i * pb..(i + 1) * pb]);
                        let w = ints(x, k);
                        let isum: i64 = w
                            .iter()
                            .zip(&y[pb - QK..])
                            .map(|(&w, &q)| i64::from(w) * i64::from(q as i8))
                            .sum();
                        let (dx, dy) = (f64::from(f16_at(x, 0)), f64::from(f16_at(y, 0)));
                        let mut term = [dx * dy * isum as f64, 0.0];
                        if has_min(k) {
                            let (mx, sy) = (f64::from(f16_at(x, 2)), f64::from(f16_at(y, 2)));
                            term[1] = mx * sy;
                            let block_sum: f64 =
                                yd[i * QK..(i + 1) * QK].iter().map(|&v| f64::from(v)).sum();
                            s_slack += mx.abs() * (sy - block_sum).abs();
                        }
                        exact += term[0] + term[1];
                        magnitude += term[0].abs() + term[1].abs();
                    }
                    let rounds = blocks.div_ceil(LANES) * if has_min(k) { 2 } else { 1 } + 3;
                    let tol_sum = (rounds as f64) * 2f64.powi(-24) * magnitude * 1.001;
                    assert!(
                        (got - exact).abs() <= tol_sum,
                        "{dtype:?} {blocks} blocks: {got} vs exact {exact} (tolerance {tol_sum})"
                    );
                    let tol_decode = decode_slack + s_slack + 1e-300;
                    assert!(
                        (exact - decoded).abs() <= tol_decode,
                        "{dtype:?} {blocks} blocks: exact {exact} vs decoded {decoded} ({tol_decode})"
                    );
                }
            }
        }
    }

    /// [`super::weight_ints`] for a kind known at run time.
    fn ints(x: &[u8], k: u8) -> [i32; QK] {
        match k {
            kind::Q4_1 => weight_ints::<{ kind::Q4_1 }>(x),
            kind::Q5_0 => weight_ints::<{ kind::Q5_0 }>(x),
            kind::Q5_1 => weight_ints::<{ kind::Q5_1 }>(x),
            _ => weight_ints::<{ kind::IQ4_NL }>(x),
        }
    }

    #[test]
    fn extreme_activations_do_not_saturate() {
        // Every weight at its integer of largest magnitude times activations of −128: large
        // products that saturating i16 pair sums would clip, and that the usual sign trick
        // (|w| times y·sgn(w)) would get wrong for the signed weights.
        let one = f16::from_f32(1.0).to_bits().to_le_bytes();
        for (dtype, k, _) in TYPES {
            for blocks in [1usize, 8, 9, 17] {
                let mut a = vec![0u8; blocks * weight_bytes(k)];
                let mut b = vec![0x80u8; blocks * partner_bytes(k)];
                for x in a.chunks_exact_mut(weight_bytes(k)) {
                    x[..2].copy_from_slice(&one);
                    if k == kind::Q4_1 || k == kind::Q5_1 {
                        x[2..4].fill(0); // m = 0
                        x[4..].fill(0xFF); // q = 15 / 31
                    }
                }
                for y in b.chunks_exact_mut(partner_bytes(k)) {
                    y[..2].copy_from_slice(&one);
                    if has_min(k) {
                        y[2..4].copy_from_slice(&f16::from_f32(-4096.0).to_bits().to_le_bytes());
                    }
                }
                // Per block: q4_1 15·(−128)·32, q5_1 31·(−128)·32, q5_0 (−16)·(−128)·32,
                // iq4_nl (−127)·(−128)·32.
                let per_block = match k {
                    kind::Q4_1 => -61440.0,
                    kind::Q5_1 => -126976.0,
                    kind::Q5_0 => 65536.0,
                    _ => 520192.0,
                };
                let want = per_block * blocks as f32;
                for isa in Isa::available() {
                    let got = block_dot::dot_fn_with(dtype, isa).unwrap()(&a, &b);
                    assert_eq!(got, want, "{dtype:?} {isa:?} {blocks} blocks");
                }
            }
        }
    }

    #[test]
    fn min_term_uses_the_stored_sum() {
        // q4_1 block: d = 1, m = 1, all nibbles 15; q8_1 block: d = 1, s = 32, all quants 1.
        // d·d·Σ15·1 + m·s = 480 + 32.
        let mut a = vec![0u8; Q4_1_BYTES];
        a[..2].copy_from_slice(&f16::ONE.to_bits().to_le_bytes());
        a[2..4].copy_from_slice(&f16::ONE.to_bits().to_le_bytes());
        a[4..].fill(0xFF);
        let mut b = vec![1u8; Q8_1_BYTES];
        b[..2].copy_from_slice(&f16::ONE.to_bits().to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(32.0).to_bits().to_le_bytes());
        for isa in Isa::available() {
            assert_eq!(
                block_dot::dot_fn_with(DType::Q4_1, isa).unwrap()(&a, &b),
                512.0
            );
        }
        // A q8_1 row from the codec: s is d·Σq of the unrounded d, as ggml stores it.
        let y: Vec<f32> = (0..QK).map(|j| j as f32 * 0.37 - 3.0).collect();
        let q = quantize(DType::Q8_1, &y);
        let d = y.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
        let sum: i32 = q[4..].iter().map(|&v| i32::from(v as i8)).sum();
        assert_eq!(
            legacy::f16_at(&q, 2),
            f16::from_f32(sum as f32 * d).to_f32()
        );
    }

    #[test]
    fn lane_order_and_reduction_are_the_documented_ones() {
        // 9 q5_0 blocks whose products (q · dy, exact) are chosen so that any other lane
        // assignment or reduction order rounds differently (2²⁰ ± small terms).
        let terms: [(i8, f32); 9] = [
            (1, 1.0),
            (1, 2f32.powi(-5)),
            (1, 2f32.powi(-5)),
            (3, 1.0),
            (64, 16384.0),
            (-64, 16384.0),
            (1, 0.5),
            (7, 1.0),
            (1, 2f32.powi(-4)),
        ];
        let mut a = Vec::new();
        let mut b = Vec::new();
        for &(q, dy) in &terms {
            // q5_0 weight: d = 1, w = q − 16 = 1 for value 0 (nibble 1 with the fifth bit
            // set) and 0 elsewhere (nibble 0, fifth bit set).
            let mut x = vec![0u8; Q5_0_BYTES];
            x[..2].copy_from_slice(&f16::ONE.to_bits().to_le_bytes());
            x[2..6].fill(0xFF);
            x[6] = 0x01;
            // q8_0 activation: scale dy, quant q at value 0.
            let mut y = vec![0u8; Q8_0_BYTES];
            y[..2].copy_from_slice(&f16::from_f32(dy).to_bits().to_le_bytes());
            y[2] = q as u8;
            a.extend_from_slice(&x);
            b.extend_from_slice(&y);
        }
        let mut acc = [0.0f32; LANES];
        for (i, &(q, dy)) in terms.iter().enumerate() {
            acc[i % LANES] += f32::from(q) * dy;
        }
        let want =
            ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
        let sequential: f32 = terms.iter().map(|&(q, dy)| f32::from(q) * dy).sum();
        assert_ne!(want, sequential, "the terms must tell the orders apart");
        for isa in Isa::available() {
            let got = block_dot::dot_fn_with(DType::Q5_0, isa).unwrap()(&a, &b);
            assert_eq!(got.to_bits(), want.to_bits(), "{isa:?}");
        }
    }

    #[test]
    fn dispatch_and_partners() {
        for (dtype, k, partner) in TYPES {
            assert_eq!(block_dot::vec_dot_type(dtype), Some(partner));
            assert_eq!(partner.type_size(), partner_bytes(k));
            assert_eq!(dtype.type_size(), weight_bytes(k));
            assert!(dot_fn(dtype, Isa::Portable).is_some());
            for isa in Isa::available() {
                assert!(dot_fn(dtype, isa).is_some(), "{dtype:?} {isa:?}");
            }
        }
        for dtype in [
            DType::Q8_0,
            DType::Q4_0,
            DType::Q8_1,
            DType::Q4_K,
            DType::F32,
        ] {
            assert!(dot_fn(dtype, Isa::Portable).is_none());
            assert!(dot_fn(dtype, Isa::Avx2).is_none());
        }
        // Empty rows and rows of different lengths (the shorter decides).
        let mut rng = Rng(5);
        for (dtype, k, partner) in TYPES {
            let x = random_values(&mut rng, 3 * QK);
            let (a, b) = (quantize(dtype, &x), quantize(partner, &x));
            for isa in Isa::available() {
                let dot = dot_fn(dtype, isa).unwrap();
                assert_eq!(dot(&[], &[]), 0.0);
                let two = dot(&a[..2 * weight_bytes(k)], &b);
                assert_eq!(
                    two.to_bits(),
                    dot(&a, &b[..2 * partner_bytes(k) + 5]).to_bits()
                );
            }
        }
    }

    /// Throughput of each AVX2 product streaming a 14336 × 4096 weight (one row after
    /// another, one thread) next to a plain read of the same bytes, and the same for 256 rows
    /// (0.7 MB, cache-resident: the kernel's compute rate). Run with
    /// `cargo test --release --lib dot_legacy::tests::throughput -- --ignored --nocapture`.
    ///
    /// Each chunk of 256 rows is timed separately and the fastest of the passes counts, so
    /// that a pass preempted by other processes on a shared machine only loses one chunk.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore]
    fn throughput() {
        use std::time::Instant;
        if !x86::available() {
            return;
        }
        let mut rng = Rng(1);
        // (rows, values per row, passes, how many of TYPES)
        for (rows, k, passes, n_types) in [
            (14336, 4096, 8, 4),
            (4096, 14336, 8, 1),
            (256, 4096, 200, 4),
            // a small model's FFN (SmolLM2-135M): 18 blocks per row, two groups and a tail
            (1536, 576, 400, 1),
        ] {
            for &(dtype, kd, partner) in &TYPES[..n_types] {
                let row_bytes = dtype.row_size(k).unwrap();
                let mut w = rng.bytes(rows * row_bytes);
                // Moderate scales (the throughput does not depend on them).
                for blk in w.chunks_exact_mut(weight_bytes(kd)) {
                    blk[..2].copy_from_slice(&f16::from_f32(0.01).to_bits().to_le_bytes());
                }
                let act = quantize(partner, &random_values(&mut rng, k));
                let chunk = (256 * 4096 / k).clamp(1, rows) * row_bytes;
                let timed = |f: &dyn Fn(&[u8]) -> f32| -> f64 {
                    let mut best = vec![f64::INFINITY; w.len() / chunk];
                    for _ in 0..passes {
                        for (c, rows) in w.chunks_exact(chunk).enumerate() {
                            let t = Instant::now();
                            let s: f32 = rows.chunks_exact(row_bytes).map(f).sum();
                            std::hint::black_box(s);
                            best[c] = best[c].min(t.elapsed().as_secs_f64());
                        }
                    }
                    best.iter().sum()
                };
                let gb = w.len() as f64 / 1e9;
                let mut line = format!("{dtype:?} {rows}x{k} ({:.1} MB):", w.len() as f64 / 1e6);
                for isa in Isa::available().into_iter().skip(1) {
                    let dot = dot_fn(dtype, isa).unwrap();
                    let t_dot = timed(&|r| dot(r, &act));
                    line += &format!(" {isa:?} {:.1} GB/s,", gb / t_dot);
                }
                // SAFETY: AVX2 was detected above.
                let t_read = timed(&|r| unsafe { stream_read(r) });
                println!("{line} plain read {:.1} GB/s", gb / t_read);
            }
        }
    }

    /// Reads every byte of `bytes` (32 at a time, four independent accumulators).
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn stream_read(bytes: &[u8]) -> f32 {
        use std::arch::x86_64::*;
        let mut acc = [_mm256_setzero_si256(); 4];
        let chunks = bytes.chunks_exact(128);
        let rest = chunks.remainder();
        for c in chunks {
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: the chunk holds 128 bytes; unaligned load of 32 of them.
                let v = unsafe { _mm256_loadu_si256(c.as_ptr().add(32 * i).cast()) };
                *a = _mm256_add_epi8(*a, v);
            }
        }
        let all = _mm256_add_epi8(
            _mm256_add_epi8(acc[0], acc[1]),
            _mm256_add_epi8(acc[2], acc[3]),
        );
        let mut out = [0u8; 32];
        // SAFETY: `out` holds 32 bytes; unaligned store.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), all) };
        let sum: u32 = out.iter().chain(rest).map(|&v| u32::from(v)).sum();
        sum as f32
    }
}
