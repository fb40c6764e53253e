//! ggml's 32-value block types beyond q8_0/q4_0: q4_1, q5_0, q5_1, q8_1 and iq4_nl.
//!
//! Every type cuts a row into blocks of 32 values and stores each block as a few little-endian
//! `f16` numbers followed by packed integers. The byte layouts are ggml's (`ggml-common.h`);
//! offsets are in bytes from the start of a block:
//!
//! | type   | bytes | layout                                              | value `j`            |
//! |--------|-------|-----------------------------------------------------|----------------------|
//! | q4_1   | 20    | `d` f16 @0, `m` f16 @2, nibbles @4..20              | `q·d + m`, q 0..=15  |
//! | q5_0   | 22    | `d` f16 @0, `qh` u32 @2..6, nibbles @6..22          | `(q − 16)·d`, q 0..=31 |
//! | q5_1   | 24    | `d` f16 @0, `m` f16 @2, `qh` u32 @4..8, nibbles @8..24 | `q·d + m`, q 0..=31 |
//! | q8_1   | 36    | `d` f16 @0, `s` f16 @2, 32 × i8 @4..36               | `q·d`, q −128..=127  |
//! | iq4_nl | 18    | `d` f16 @0, nibbles @2..18                          | `d·T[q]`, q 0..=15   |
//!
//! *Nibbles*: the 16 bytes hold value `j < 16` in the low nibble of byte `j` and value `j + 16`
//! in the high nibble of byte `j`. *qh*: bit `j` of the little-endian `u32` is bit 4 (the fifth
//! bit) of value `j`'s `q`. *q8_1's `s`* is `d · Σq`, kept so that products with q4_1/q5_1 get
//! the minimum's contribution `m · Σy` for free; decoding ignores it. *iq4_nl's table* `T` is
//! [`KVALUES_IQ4NL`], 16 signed levels spaced more densely near zero.
//!
//! # Decoding
//!
//! The scales are widened from `f16` exactly; each value is one `f32` product, then (q4_1,
//! q5_1) one `f32` addition, rounded separately (never fused): exactly the arithmetic of gguf-py's
//! `dequantize`, whose results the tests compare bit for bit. Any bit pattern decodes without
//! panicking (NaN or infinite scales give NaN or infinite values).
//!
//! # Encoding (ggml's reference quantizers)
//!
//! Scales are computed in `f32` and only *stored* rounded to nearest-even `f16`; the integers
//! are computed with the `f32` scale. "Truncate" below is a conversion toward zero of a
//! non-negative number.
//!
//! * **q4_1 / q5_1** (`n` = 15 / 31): `min`, `max` of the block; `d = (max − min)/n`;
//!   `id = 1/d` (0 when `d = 0`); `q = min(n, trunc((x − min)·id + 0.5))`. The minimum is
//!   stored as `m`, so the smallest value maps to `q = 0` and the largest to `q = n`.
//! * **q5_0**: like q4_0 with five bits: `mx` is the first value of largest magnitude *with its
//!   sign*, `d = mx / −16`, `q = min(31, trunc(x·id + 16.5))`. `mx` itself maps to `q = 0`
//!   (value `−16·d = mx`). An all-zero block gets `d = −0.0` (f16 bits `0x8000`), as in ggml.
//! * **q8_1**: `d = max|x| / 127`, `q = round(x·id)` with halves away from zero (`roundf`),
//!   `s = f16((Σq as f32) · d)` with the *unrounded* `f32` `d`.
//! * **iq4_nl**: ggml's non-linear quantizer without importance weights (`quantize_iq4_nl`
//!   with no weights, `ntry = 7`), per block: weights `w = x²`; `mx` the first value of largest
//!   magnitude (a block with `|mx| < 1e−15` gets `d = 0`); start from `d = mx/127` and each of
//!   the 15 candidate inverse scales `id = (t − 127)/mx`, `t = −7..=7`: map every `x·id` to the
//!   nearest table level (a tie goes to the upper level), and for that assignment take the
//!   weighted least-squares scale `d = Σwqx / Σwq²`; keep the candidate with the largest
//!   `(Σwqx)²/Σwq²` (strictly larger wins, the start first). Finally every value is mapped
//!   again with `1/d` (the `f32` `d`) to its nearest level. Sums run in index order with
//!   separate `f32` multiplies and adds. (ggml's `quantize_row_iq4_nl_ref`, which its CPU
//!   backend uses to convert activations, is the same code with `ntry = −1`: no candidate
//!   search and no final re-mapping. The codec follows the search, the model-file quantizer.)
//!
//! These rules produce the same bytes as ggml's C quantizers (`quantize_row_{q4_1,q5_0,q5_1,
//! q8_1}_ref`, `quantize_iq4_nl` without weights) and as gguf-py's `quantize` for q4_1, q5_0
//! and q5_1 (gguf-py has no q8_1 and no iq4_nl quantizer): the tests compare against fixtures
//! made with both (`tests/data/legacy_blocks.bin`, `scripts/make_block_fixtures.py`). The one
//! known divergence from gguf-py: a q5_0 block of zeros whose first value is `−0.0` (gguf-py
//! stores `+0.0` as its scale, ggml `−0.0`; both decode to zeros). Non-finite input is
//! accepted without panicking, but the bytes it produces are unspecified.
//!
//! # Error bounds
//!
//! For a finite block, `d` the `f32` scale, `d̃` the stored `f16` scale and `m̃` the stored
//! minimum, every decoded value `x̂` satisfies (plus `f32` rounding, below `1e−5` of the block's
//! largest magnitude):
//!
//! * q4_1: `|x − x̂| ≤ |d|/2 + 15·|d − d̃| + |min − m̃|`
//! * q5_1: `|x − x̂| ≤ |d|/2 + 31·|d − d̃| + |min − m̃|`
//! * q5_0: `|x − x̂| ≤ |d| + 16·|d − d̃|` (values of the sign opposite to `mx` with
//!   `x·id ≥ 15.5` clamp to `q = 31`, up to one full step; all others round to nearest)
//! * q8_1: `|x − x̂| ≤ |d|/2 + 127·|d − d̃|`
//! * iq4_nl: `|x − x̂| ≤ max(12·|d|, |x| − 113·|d|) + 127·|d − d̃|`. Inside the table's range
//!   (`x/d` between `−127` and `113`) the nearest level is at most half the widest gap away
//!   (89 to 113: 12 steps of `|d|`); beyond it `x` clips to an end level, at least 113 steps
//!   from zero (the table is asymmetric, so values of one sign can clip while the extreme of
//!   the other sign fits). Most errors are far smaller, since the scale search minimises the
//!   squared error weighted by `x²`.
//!
//! For a normal `f16` scale `|d − d̃| ≤ 2⁻¹¹·|d|`.

use half::f16;

pub use super::f16_at;
use super::BlockCodec;
use crate::dtype::DType;

/// Values per block of every type of this module.
pub const QK: usize = 32;
/// Bytes of one q4_1 block.
pub const Q4_1_BYTES: usize = 20;
/// Bytes of one q5_0 block.
pub const Q5_0_BYTES: usize = 22;
/// Bytes of one q5_1 block.
pub const Q5_1_BYTES: usize = 24;
/// Bytes of one q8_1 block.
pub const Q8_1_BYTES: usize = 36;
/// Bytes of one iq4_nl block.
pub const IQ4_NL_BYTES: usize = 18;

/// ggml's `kvalues_iq4nl`: the 16 levels an iq4_nl nibble selects, in increasing order.
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

super::wide_decoders! {
    wide_q4_1 => dequantize_row_q4_1,
    wide_q5_0 => dequantize_row_q5_0,
    wide_q5_1 => dequantize_row_q5_1,
    wide_iq4_nl => dequantize_row_iq4_nl,
}

/// The codec of `dtype` if it is one of this module's types.
pub fn codec(dtype: DType) -> Option<BlockCodec> {
    let pair = |to_f32: fn(&[u8], &mut [f32]), from_f32: fn(&[f32], &mut [u8])| {
        Some(BlockCodec {
            to_f32,
            from_f32: Some(from_f32),
        })
    };
    match dtype {
        DType::Q4_1 => pair(wide_q4_1, quantize_row_q4_1),
        DType::Q5_0 => pair(wide_q5_0, quantize_row_q5_0),
        DType::Q5_1 => pair(wide_q5_1, quantize_row_q5_1),
        DType::Q8_1 => pair(dequantize_row_q8_1, quantize_row_q8_1),
        DType::IQ4_NL => pair(wide_iq4_nl, quantize_row_iq4_nl),
        _ => None,
    }
}

/// Stores `v` rounded to the nearest `f16` (ties to even) at byte `at` of `block`.
#[inline(always)]
fn put_f16(block: &mut [u8], at: usize, v: f32) {
    block[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// The `qh` word at byte `at` of `block`.
#[inline(always)]
fn u32_at(block: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]])
}

/// The 32 integers of a block whose values are nibbles at `qs` (16 bytes) plus, if `qh` is
/// given, a fifth bit from it.
#[inline(always)]
pub fn unpack_nibbles(qs: &[u8], qh: Option<u32>) -> [u8; QK] {
    let mut q = [0u8; QK];
    let high = qh.unwrap_or(0);
    for (j, &byte) in qs[..QK / 2].iter().enumerate() {
        q[j] = (byte & 0x0F) | ((((high >> j) & 1) as u8) << 4);
        q[j + QK / 2] = (byte >> 4) | ((((high >> (j + QK / 2)) & 1) as u8) << 4);
    }
    q
}

/// Packs 32 integers (each below 32) into 16 nibble bytes at `qs` and returns their `qh` word.
#[inline(always)]
fn pack_nibbles(q: &[u8; QK], qs: &mut [u8]) -> u32 {
    let mut qh = 0u32;
    for j in 0..QK / 2 {
        let (lo, hi) = (q[j], q[j + QK / 2]);
        qs[j] = (lo & 0x0F) | ((hi & 0x0F) << 4);
        qh |= (u32::from(lo >> 4) & 1) << j;
        qh |= (u32::from(hi >> 4) & 1) << (j + QK / 2);
    }
    qh
}

/// Decodes whole q4_1 blocks (`src.len() / 20` of them, at most `dst.len() / 32`).
#[inline(always)]
pub fn dequantize_row_q4_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q4_1_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        for (v, &q) in y.iter_mut().zip(&unpack_nibbles(&b[4..], None)) {
            *v = f32::from(q) * d + m;
        }
    }
}

/// Decodes whole q5_0 blocks.
#[inline(always)]
pub fn dequantize_row_q5_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q5_0_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        let q = unpack_nibbles(&b[6..], Some(u32_at(b, 2)));
        for (v, &q) in y.iter_mut().zip(&q) {
            *v = (i32::from(q) - 16) as f32 * d;
        }
    }
}

/// Decodes whole q5_1 blocks.
#[inline(always)]
pub fn dequantize_row_q5_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q5_1_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        let q = unpack_nibbles(&b[8..], Some(u32_at(b, 4)));
        for (v, &q) in y.iter_mut().zip(&q) {
            *v = f32::from(q) * d + m;
        }
    }
}

/// Decodes whole q8_1 blocks (the stored sum `s` is not used).
pub fn dequantize_row_q8_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q8_1_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        for (v, &q) in y.iter_mut().zip(&b[4..]) {
            *v = f32::from(q as i8) * d;
        }
    }
}

/// Decodes whole iq4_nl blocks.
#[inline(always)]
pub fn dequantize_row_iq4_nl(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(IQ4_NL_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        for (v, &q) in y.iter_mut().zip(&unpack_nibbles(&b[2..], None)) {
            *v = f32::from(KVALUES_IQ4NL[usize::from(q)]) * d;
        }
    }
}

/// `min` and `max` of a block as ggml's min/max quantizers find them (starting from ±f32::MAX;
/// NaN never replaces either).
fn min_max(x: &[f32]) -> (f32, f32) {
    let mut min = f32::MAX;
    let mut max = -f32::MAX;
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// The first value of largest magnitude, with its sign (0.0 for a block of zeros).
fn signed_absmax(x: &[f32]) -> f32 {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// The shared encoder of q4_1 (`BITS = 4`) and q5_1 (`BITS = 5`): `d`, `m`, then `qh` if
/// five bits, then the nibbles.
fn quantize_min_max<const BITS: u32>(x: &[f32], out: &mut [u8], block_bytes: usize) {
    let n = ((1u32 << BITS) - 1) as u8;
    for (xs, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(block_bytes)) {
        let (min, max) = min_max(xs);
        let d = (max - min) / f32::from(n);
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        // (x − min)·id lies in [0, n] up to rounding, so adding 0.5 and truncating rounds it
        // to the nearest integer; `as u8` saturates (NaN → 0) and `min` keeps the result in
        // range even for non-finite input.
        let q: [u8; QK] = std::array::from_fn(|j| (((xs[j] - min) * id + 0.5) as u8).min(n));
        if BITS == 4 {
            pack_nibbles(&q, &mut b[4..]);
        } else {
            let qh = pack_nibbles(&q, &mut b[8..]);
            b[4..8].copy_from_slice(&qh.to_le_bytes());
        }
    }
}

/// Encodes `x` (whole blocks of 32) as q4_1 blocks into `out` (see the module docs).
pub fn quantize_row_q4_1(x: &[f32], out: &mut [u8]) {
    quantize_min_max::<4>(x, out, Q4_1_BYTES);
}

/// Encodes `x` as q5_1 blocks into `out` (see the module docs).
pub fn quantize_row_q5_1(x: &[f32], out: &mut [u8]) {
    quantize_min_max::<5>(x, out, Q5_1_BYTES);
}

/// Encodes `x` as q5_0 blocks into `out` (see the module docs).
pub fn quantize_row_q5_0(x: &[f32], out: &mut [u8]) {
    for (xs, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(Q5_0_BYTES)) {
        let d = signed_absmax(xs) / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        // x·id lies in [−16, 16] up to rounding, so x·id + 16.5 is non-negative and truncating
        // rounds x·id to the nearest integer (halves up); 32 only occurs for x·id ≥ 15.5.
        let q: [u8; QK] = std::array::from_fn(|j| ((xs[j] * id + 16.5) as u8).min(31));
        let qh = pack_nibbles(&q, &mut b[6..]);
        b[2..6].copy_from_slice(&qh.to_le_bytes());
    }
}

/// Encodes `x` as q8_1 blocks into `out` (see the module docs).
pub fn quantize_row_q8_1(x: &[f32], out: &mut [u8]) {
    for (xs, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(Q8_1_BYTES)) {
        let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in b[4..].iter_mut().zip(xs) {
            // C's `roundf` (halves away from zero); |v·id| ≤ 127 up to rounding, and the
            // conversion saturates anyway.
            let qi = super::round_to_i8(v * id);
            sum += i32::from(qi);
            *q = qi as u8;
        }
        put_f16(b, 0, d);
        // |sum| ≤ 32·127, exact in f32.
        put_f16(b, 2, sum as f32 * d);
    }
}

/// `2·(T[k] + T[k+1])/2`: the doubled midpoints between adjacent table levels, increasing.
const IQ4NL_MID2: [f32; 15] = {
    let mut m = [0.0f32; 15];
    let mut k = 0;
    while k < 15 {
        m[k] = (KVALUES_IQ4NL[k] as i32 + KVALUES_IQ4NL[k + 1] as i32) as f32;
        k += 1;
    }
    m
};

/// The index of the table level nearest to `x` (a tie goes to the upper level; NaN → 0):
/// the number of midpoints `x` reaches, compared as `2x ≥ T[k] + T[k+1]` (both sides exact).
#[inline(always)]
fn nearest_iq4nl(x: f32) -> u8 {
    let x2 = x + x;
    IQ4NL_MID2.iter().map(|&m| u8::from(x2 >= m)).sum()
}

/// `(Σ w·q·x, Σ w·q²)` over the block for the levels chosen with inverse scale `id` (each term
/// `(w·q)·x` and `(w·q)·q`, summed in index order).
fn iq4nl_sums(xs: &[f32], w: &[f32; QK], id: f32) -> (f32, f32) {
    let mut sumqx = 0.0f32;
    let mut sumq2 = 0.0f32;
    for (&x, &w) in xs.iter().zip(w) {
        let q = f32::from(KVALUES_IQ4NL[usize::from(nearest_iq4nl(id * x))]);
        sumqx += w * q * x;
        sumq2 += w * q * q;
    }
    (sumqx, sumq2)
}

/// Half-width of ggml's candidate search around the scale `max/127` (`ntry`).
const IQ4NL_NTRY: i32 = 7;

/// The f32 scale of one iq4_nl block (see the module docs).
fn iq4nl_scale(xs: &[f32]) -> f32 {
    let w: [f32; QK] = std::array::from_fn(|j| xs[j] * xs[j]);
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in xs {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < 1e-15 {
        return 0.0;
    }
    let t0 = f32::from(KVALUES_IQ4NL[0]);
    let (sumqx, sumq2) = iq4nl_sums(xs, &w, 1.0 / (-max / t0));
    let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for t in -IQ4NL_NTRY..=IQ4NL_NTRY {
        let id = (t + i32::from(KVALUES_IQ4NL[0])) as f32 / max;
        let (sumqx, sumq2) = iq4nl_sums(xs, &w, id);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

/// Encodes `x` as iq4_nl blocks into `out` (see the module docs).
pub fn quantize_row_iq4_nl(x: &[f32], out: &mut [u8]) {
    for (xs, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(IQ4_NL_BYTES)) {
        let d = iq4nl_scale(xs);
        put_f16(b, 0, d);
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q: [u8; QK] = std::array::from_fn(|j| nearest_iq4nl(id * xs[j]));
        pack_nibbles(&q, &mut b[2..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::test_support::{f32s, sections};

    /// Every type of the module: dtype, block bytes, ggml type id.
    const TYPES: [(DType, usize, u8); 5] = [
        (DType::Q4_1, Q4_1_BYTES, 3),
        (DType::Q5_0, Q5_0_BYTES, 6),
        (DType::Q5_1, Q5_1_BYTES, 7),
        (DType::Q8_1, Q8_1_BYTES, 9),
        (DType::IQ4_NL, IQ4_NL_BYTES, 20),
    ];

    fn encode(dtype: DType, x: &[f32]) -> Vec<u8> {
        let c = codec(dtype).unwrap();
        let mut out = vec![0xA5u8; dtype.row_size(x.len()).unwrap()];
        (c.from_f32.unwrap())(x, &mut out);
        out
    }

    fn decode(dtype: DType, bytes: &[u8]) -> Vec<f32> {
        let c = codec(dtype).unwrap();
        let n = bytes.len() / dtype.type_size() * QK;
        let mut y = vec![f32::NAN; n];
        (c.to_f32)(bytes, &mut y);
        y
    }

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
    }

    /// Random blocks at random power-of-two scales from 2⁻²⁰ to 2¹⁰, some with an offset
    /// (so that the min/max types see blocks far from zero).
    fn random_row(rng: &mut Rng, blocks: usize) -> Vec<f32> {
        let mut x = Vec::with_capacity(blocks * QK);
        for _ in 0..blocks {
            let scale = 2f32.powi((rng.next() % 31) as i32 - 20);
            let offset = if rng.next().is_multiple_of(3) {
                rng.unit() * 4.0 * scale
            } else {
                0.0
            };
            x.extend((0..QK).map(|_| rng.unit() * scale + offset));
        }
        x
    }

    fn f16_err(v: f32) -> f32 {
        (v - f16::from_f32(v).to_f32()).abs()
    }

    /// The module docs' bound for block `xs` of `dtype` and its decoded values `ys`.
    fn check_bound(dtype: DType, xs: &[f32], ys: &[f32]) {
        let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (min, max) = min_max(xs);
        let (bound, d) = match dtype {
            DType::Q4_1 => {
                let d = (max - min) / 15.0;
                (d / 2.0 + 15.0 * f16_err(d) + f16_err(min), d)
            }
            DType::Q5_1 => {
                let d = (max - min) / 31.0;
                (d / 2.0 + 31.0 * f16_err(d) + f16_err(min), d)
            }
            DType::Q5_0 => {
                let d = signed_absmax(xs) / -16.0;
                (d.abs() + 16.0 * f16_err(d), d)
            }
            DType::Q8_1 => {
                let d = amax / 127.0;
                (d / 2.0 + 127.0 * f16_err(d), d)
            }
            DType::IQ4_NL => {
                let d = iq4nl_scale(xs);
                (12.0 * d.abs() + 127.0 * f16_err(d), d)
            }
            _ => unreachable!(),
        };
        let slack = 1e-5 * amax.max(min.abs()).max(max.abs());
        for (j, (&x, &y)) in xs.iter().zip(ys).enumerate() {
            let bound = if dtype == DType::IQ4_NL {
                // Clipped values (see the module docs).
                bound.max(x.abs() - 113.0 * d.abs() + 127.0 * f16_err(d))
            } else {
                bound
            };
            assert!(
                (x - y).abs() <= bound + slack,
                "{dtype:?} value {j}: {x} decoded as {y}, bound {bound} (d = {d})"
            );
        }
    }

    #[test]
    fn codec_covers_exactly_these_types() {
        for (dtype, bytes, _) in TYPES {
            assert!(codec(dtype).is_some());
            assert_eq!(dtype.type_size(), bytes);
            assert_eq!(dtype.block_size(), QK);
        }
        assert!(codec(DType::Q8_0).is_none());
        assert!(codec(DType::Q4_K).is_none());
        assert!(codec(DType::F32).is_none());
    }

    #[test]
    fn round_trips_within_bounds() {
        let mut rng = Rng(0x1234_5678);
        let x = random_row(&mut rng, 200);
        for (dtype, _, _) in TYPES {
            let y = decode(dtype, &encode(dtype, &x));
            for (xs, ys) in x.chunks_exact(QK).zip(y.chunks_exact(QK)) {
                check_bound(dtype, xs, ys);
            }
        }
    }

    #[test]
    fn iq4_nl_search_beats_plain_scale() {
        // The search starts from the assignment of d = max/127 and keeps a candidate only if
        // it fits better, so its weighted squared error (weights x², f64) is at most about
        // that of plainly mapping with d = max/127 (the final re-mapping and the f16 scale
        // can cost a little), and clearly smaller on many blocks.
        // Scales well inside f16's normal range: this is about the search, not about f16.
        let mut rng = Rng(99);
        let x: Vec<f32> = (0..64 * QK)
            .map(|i| rng.unit() * 2f32.powi((i / QK % 8) as i32 - 4))
            .collect();
        let y = decode(DType::IQ4_NL, &encode(DType::IQ4_NL, &x));
        let (mut better, mut total_search, mut total_plain) = (0, 0.0f64, 0.0f64);
        for (xs, ys) in x.chunks_exact(QK).zip(y.chunks_exact(QK)) {
            let id = 127.0 / signed_absmax(xs);
            let plain: Vec<f32> = xs
                .iter()
                .map(|&v| f32::from(KVALUES_IQ4NL[usize::from(nearest_iq4nl(v * id))]) / id)
                .collect();
            let err = |ys: &[f32]| -> f64 {
                xs.iter()
                    .zip(ys)
                    .map(|(&a, &b)| f64::from(a).powi(2) * (f64::from(a) - f64::from(b)).powi(2))
                    .sum()
            };
            let (e_search, e_plain) = (err(ys), err(&plain));
            assert!(
                e_search <= e_plain * 1.05,
                "{e_search} vs {e_plain}: {xs:?}"
            );
            better += usize::from(e_search < e_plain * 0.9);
            total_search += e_search;
            total_plain += e_plain;
        }
        assert!(
            total_search < total_plain,
            "{total_search} vs {total_plain}"
        );
        assert!(
            better > 10,
            "the search improved only {better} of 64 blocks"
        );
    }

    #[test]
    fn all_zero_block() {
        let x = [0.0f32; QK];
        // q4_1 / q5_1: d = 0, m = 0, every q = 0.
        assert_eq!(encode(DType::Q4_1, &x), vec![0; Q4_1_BYTES]);
        assert_eq!(encode(DType::Q5_1, &x), vec![0; Q5_1_BYTES]);
        // q5_0: d = 0 / −16 = −0.0 (bits 0x8000); q = 16 (nibble 0 with the fifth bit set).
        let mut want = vec![0x00, 0x80, 0xFF, 0xFF, 0xFF, 0xFF];
        want.resize(Q5_0_BYTES, 0);
        assert_eq!(encode(DType::Q5_0, &x), want);
        assert_eq!(encode(DType::Q8_1, &x), vec![0; Q8_1_BYTES]);
        // iq4_nl: d = 0, then every value maps to the level nearest zero, T[8] = 1.
        let mut want = vec![0, 0];
        want.resize(IQ4_NL_BYTES, 0x88);
        assert_eq!(encode(DType::IQ4_NL, &x), want);
        for (dtype, _, _) in TYPES {
            let y = decode(dtype, &encode(dtype, &x));
            assert!(y.iter().all(|&v| v == 0.0), "{dtype:?}: {y:?}");
        }
    }

    #[test]
    fn single_outlier() {
        let mut x = [0.0f32; QK];
        x[5] = 1000.0;
        // q4_1: min 0, d = 1000/15; the outlier is q = 15, the zeros q = 0.
        let b = encode(DType::Q4_1, &x);
        assert_eq!(f16_at(&b, 0), f16::from_f32(1000.0 / 15.0).to_f32());
        assert_eq!(f16_at(&b, 2), 0.0);
        assert_eq!(b[4 + 5], 0x0F);
        assert!(b[4..].iter().enumerate().all(|(j, &v)| j == 5 || v == 0));
        // q5_1: q = 31 for the outlier.
        let b = encode(DType::Q5_1, &x);
        assert_eq!(b[8 + 5], 0x0F);
        assert_eq!(u32_at(&b, 4), 1 << 5);
        // q5_0: d = −62.5 (exact in f16); the outlier maps to q = 0 and decodes exactly.
        let b = encode(DType::Q5_0, &x);
        assert_eq!(f16_at(&b, 0), -62.5);
        assert_eq!(u32_at(&b, 2), !(1u32 << 5));
        let y = decode(DType::Q5_0, &b);
        assert_eq!(y[5], 1000.0);
        // q8_1: q = 127 for the outlier and s = 127·d.
        let b = encode(DType::Q8_1, &x);
        assert_eq!(b[4 + 5] as i8, 127);
        assert_eq!(
            f16_at(&b, 2),
            f16::from_f32(127.0 * (1000.0 / 127.0)).to_f32()
        );
        // iq4_nl: the outlier takes the top level of its sign's side (d < 0: index 0).
        let b = encode(DType::IQ4_NL, &x);
        let d = f16_at(&b, 0);
        let y = decode(DType::IQ4_NL, &b);
        assert!((y[5] - 1000.0).abs() <= 1000.0 * 2e-3, "{y:?} (d = {d})");
        for (j, &v) in y.iter().enumerate() {
            if j != 5 {
                assert!(v.abs() <= 1000.0 / 127.0 * 1.01, "value {j}: {v}");
            }
        }
    }

    #[test]
    fn negative_max() {
        // q5_0: the largest magnitude is negative, so d > 0 and it maps to q = 0 (value −16d).
        let mut x = [0.5f32; QK];
        x[20] = -6.4;
        x[3] = 2.0;
        let b = encode(DType::Q5_0, &x);
        let d = f16::from_f32(0.4).to_f32();
        assert_eq!(f16_at(&b, 0), d);
        let y = decode(DType::Q5_0, &b);
        assert_eq!(y[20], -16.0 * d);
        // 0.5/0.4 = 1.25 → 1; 2.0/0.4 = 5 → 5.
        assert_eq!(y[0], d);
        assert_eq!(y[3], 5.0 * d);
        // q4_1 with all values negative: m is the minimum, q counts up from it.
        let x: Vec<f32> = (0..QK).map(|j| -(j as f32) - 1.0).collect();
        let b = encode(DType::Q4_1, &x);
        assert_eq!(f16_at(&b, 2), -32.0);
        assert_eq!(f16_at(&b, 0), f16::from_f32(31.0 / 15.0).to_f32());
        assert_eq!(b[4 + 15] >> 4, 0, "value 31 (the minimum) is q = 0");
        assert_eq!(b[4] & 0x0F, 15, "value 0 (the maximum) is q = 15");
        check_bound(DType::Q4_1, &x, &decode(DType::Q4_1, &b));
        // iq4_nl with a negative extreme: d > 0 and the extreme takes level T[0] = −127.
        let mut x = [0.1f32; QK];
        x[9] = -12.7;
        let b = encode(DType::IQ4_NL, &x);
        assert!(f16_at(&b, 0) > 0.0);
        assert_eq!(b[2 + 9] & 0x0F, 0);
    }

    #[test]
    fn ties() {
        // q5_0 with mx = −16 (first of the two largest magnitudes): d = −16/−16 = 1, so
        // q = trunc(x + 16.5): x = 2.5 → 19 (value 3), x = −2.5 → 14 (value −2), halves
        // round up; x = 15.7 → 32.2 and x = 16 → 32.5 clamp to q = 31 (value 15).
        let mut x = [0.0f32; QK];
        x[0] = -16.0;
        x[1] = 2.5;
        x[2] = -2.5;
        x[3] = 15.7;
        x[4] = 16.0;
        let y = decode(DType::Q5_0, &encode(DType::Q5_0, &x));
        assert_eq!(&y[..5], &[-16.0, 3.0, -2.0, 15.0, 15.0]);
        // +16 first: d = −1, so +16 is q = 0 (exact) and −16 clamps to q = 31 (value −15).
        x.swap(0, 4);
        let y = decode(DType::Q5_0, &encode(DType::Q5_0, &x));
        assert_eq!((y[0], y[1], y[4]), (16.0, 2.0, -15.0));
        // q4_1 with min 0, max 15 (d = 1): 7.5 → q = 8, 0.5 → 1, 0.49 → 0.
        let mut x = [0.0f32; QK];
        x[1] = 15.0;
        x[2] = 7.5;
        x[3] = 0.5;
        x[4] = 0.49;
        let y = decode(DType::Q4_1, &encode(DType::Q4_1, &x));
        assert_eq!(&y[..5], &[0.0, 15.0, 8.0, 1.0, 0.0]);
        // q8_1 with amax 127 (d = 1): halves round away from zero; s = d·Σq.
        let mut x = [0.0f32; QK];
        x[..5].copy_from_slice(&[127.0, -63.5, 0.5, -0.5, 2.49]);
        let b = encode(DType::Q8_1, &x);
        let mut want = vec![0x00, 0x3C, 0, 0, 0x7F, 0xC0, 0x01, 0xFF, 0x02];
        // Σq = 127 − 64 + 1 − 1 + 2 = 65 → s = 65.0 = 0x5410.
        want[2..4].copy_from_slice(&f16::from_f32(65.0).to_bits().to_le_bytes());
        want.resize(Q8_1_BYTES, 0);
        assert_eq!(b, want);
        // iq4_nl level ties go up: midway between 1 and 13 is 7.
        assert_eq!(nearest_iq4nl(7.0), 9);
        assert_eq!(nearest_iq4nl(6.99), 8);
        assert_eq!(nearest_iq4nl(-4.5), 8);
        assert_eq!(nearest_iq4nl(-4.51), 7);
        assert_eq!(nearest_iq4nl(-1e30), 0);
        assert_eq!(nearest_iq4nl(1e30), 15);
        assert_eq!(nearest_iq4nl(f32::INFINITY), 15);
        assert_eq!(nearest_iq4nl(f32::NAN), 0);
        for (k, &v) in KVALUES_IQ4NL.iter().enumerate() {
            assert_eq!(usize::from(nearest_iq4nl(f32::from(v))), k);
        }
    }

    #[test]
    fn layouts_by_hand() {
        // q5_1 with m = 0, d = 1 and q = j: low nibbles j % 16, qh = bits of values 16..31.
        let x: Vec<f32> = (0..QK).map(|j| j as f32).collect();
        let b = encode(DType::Q5_1, &x);
        assert_eq!(f16_at(&b, 0), 1.0);
        assert_eq!(f16_at(&b, 2), 0.0);
        assert_eq!(u32_at(&b, 4), 0xFFFF_0000);
        for j in 0..16 {
            assert_eq!(b[8 + j], (j as u8) | ((j as u8) << 4));
        }
        assert_eq!(decode(DType::Q5_1, &b), x);
        // Decoding hand-made iq4_nl bytes: d = 2, nibble k → 2·T[k].
        let mut b = vec![0x00, 0x40];
        b.extend((0..16u8).map(|k| k | ((15 - k) << 4)));
        let y = decode(DType::IQ4_NL, &b);
        for k in 0..16 {
            assert_eq!(y[k], 2.0 * f32::from(KVALUES_IQ4NL[k]));
            assert_eq!(y[k + 16], 2.0 * f32::from(KVALUES_IQ4NL[15 - k]));
        }
    }

    #[test]
    fn any_alignment_and_any_bits() {
        // Decode every block at every offset of a byte buffer: same values wherever they sit.
        let mut rng = Rng(7);
        for (dtype, size, _) in TYPES {
            let raw: Vec<u8> = (0..size * 64).map(|_| rng.next() as u8).collect();
            let want = decode(dtype, &raw);
            let mut buf = vec![0u8; raw.len() + 3];
            for off in 0..4 {
                buf[off..off + raw.len()].copy_from_slice(&raw);
                let got = decode(dtype, &buf[off..off + raw.len()]);
                for (g, w) in got.iter().zip(&want) {
                    assert!(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()));
                }
                // Encoding into an unaligned buffer gives the same bytes.
                let x = random_row(&mut rng, 4);
                let aligned = encode(dtype, &x);
                let mut out = vec![0u8; aligned.len() + 3];
                (codec(dtype).unwrap().from_f32.unwrap())(&x, &mut out[off..off + aligned.len()]);
                assert_eq!(&out[off..off + aligned.len()], &aligned[..]);
            }
        }
        // Non-finite input encodes without panicking.
        let mut x = random_row(&mut rng, 4);
        x[3] = f32::NAN;
        x[40] = f32::INFINITY;
        x[70] = f32::NEG_INFINITY;
        x[96..128].fill(f32::NAN);
        for (dtype, _, _) in TYPES {
            let _ = decode(dtype, &encode(dtype, &x));
        }
    }

    /// One case of `tests/data/legacy_blocks.bin` (see `scripts/make_block_fixtures.py`).
    struct Case {
        type_id: u8,
        /// 0: encode case from gguf-py (numpy for q8_1), 1: decode case, 2: encode case
        /// from ggml's C library.
        kind: u8,
        x: Option<Vec<f32>>,
        bytes: Vec<u8>,
        y: Vec<f32>,
    }

    fn fixture_cases() -> Vec<Case> {
        let data: &[u8] = include_bytes!("../../../../tests/data/legacy_blocks.bin");
        assert_eq!(
            u32::from_le_bytes(data[4..8].try_into().unwrap()),
            1,
            "fixture version"
        );
        // Header: type id (byte 0), kind (byte 1), block count (word 1); then the input
        // values (encode cases only), the block bytes and the decoded values.
        let size_of = |type_id: u8| TYPES.iter().find(|t| t.2 == type_id).expect("type id").1;
        sections(data, b"FGLB", 8, 2, |h| {
            let (type_id, kind, n) = (h[0] as u8, (h[0] >> 8) as u8, h[1] as usize);
            let mut lens = vec![n * size_of(type_id), 4 * n * QK];
            if kind != 1 {
                lens.insert(0, 4 * n * QK);
            }
            lens
        })
        .into_iter()
        .map(|mut s| {
            let y = f32s(&s.parts.pop().unwrap());
            let bytes = s.parts.pop().unwrap();
            Case {
                type_id: s.header[0] as u8,
                kind: (s.header[0] >> 8) as u8,
                x: s.parts.pop().map(|x| f32s(&x)),
                bytes,
                y,
            }
        })
        .collect()
    }

    #[test]
    fn matches_gguf_reference_bit_for_bit() {
        let mut seen = [0usize; 2];
        for case in fixture_cases() {
            let (dtype, _, _) = *TYPES.iter().find(|t| t.2 == case.type_id).unwrap();
            let y = decode(dtype, &case.bytes);
            assert_eq!(y.len(), case.y.len());
            for (j, (g, w)) in y.iter().zip(&case.y).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "{dtype:?} decode, value {j}: {g:e} vs reference {w:e}"
                );
            }
            seen[0] += 1;
            if let Some(x) = &case.x {
                let got = encode(dtype, x);
                let size = dtype.type_size();
                for (b, (g, w)) in got.chunks(size).zip(case.bytes.chunks(size)).enumerate() {
                    let xs = &x[b * QK..(b + 1) * QK];
                    assert_eq!(
                        g, w,
                        "{dtype:?} encode (case kind {}), block {b}: {xs:?}",
                        case.kind
                    );
                }
                seen[1] += 1;
            }
        }
        // Decode cases: one random-bytes case per type plus every encode case's bytes. Encode
        // cases: gguf-py's for q4_1, q5_0, q5_1 and numpy's q8_1; ggml's C quantizers for all
        // five types.
        assert_eq!(seen, [14, 9]);
    }
}
