//! ggml's ternary, 4-bit float and 1-/2-bit block types: TQ1_0, TQ2_0, MXFP4, NVFP4, Q1_0 and
//! Q2_0 (byte codecs, reached through [`super::codec`]).
//!
//! # Layouts (little-endian, no padding)
//!
//! * **TQ1_0** (256 values, [`TQ1_0_BYTES`] = 54): 48 bytes `qs`, 4 bytes `qh`, f16 `d`.
//!   Every byte packs base-3 digits ("trits") `t ∈ {0,1,2}`, value `(t − 1)·d`. A byte `b`
//!   stores its trits as `b = ⌈256·T / 243⌉` where `T = Σ_k t_k·3^(4−k)` (first trit most
//!   significant), so that trit `k` is recovered as `((b·3^k mod 256)·3) >> 8`. Bytes
//!   `qs[0..32]` hold 5 trits each: trit `k` of byte `m` is value `32k + m`; bytes
//!   `qs[32..48]` likewise values `160 + 16k + m`; bytes `qh[0..4]` hold 4 trits each (the
//!   fifth, least significant, is zero): trit `k` of byte `j` is value `240 + 4k + j`.
//! * **TQ2_0** (256 values, [`TQ2_0_BYTES`] = 66): 64 bytes `qs`, f16 `d`. Value
//!   `128h + 32l + m` (`h < 2`, `l < 4`, `m < 32`) is `(((qs[32h + m] >> 2l) & 3) − 1)·d`
//!   (the 2-bit field 3 decodes to `+2·d`; the quantizer never writes it).
//! * **MXFP4** (32 values, [`MXFP4_BYTES`] = 17): one E8M0 exponent byte `e`, then 16 bytes
//!   of 4-bit codes: value `j < 16` in the low nibble of byte `1 + j`, value `j + 16` in the
//!   high nibble. A code `c` decodes to `K[c]·s(e)` with `K` = [`KVALUES_MXFP4`] (the E2M1
//!   values doubled, so that they are integers) and `s(e) = 2^(e − 128)` (half the E8M0
//!   scale `2^(e − 127)`, compensating the doubling; `e = 0` and `1` give the f32
//!   subnormals `2⁻¹²⁸`, `2⁻¹²⁷`, and no byte is NaN: `e = 255` is `2¹²⁷`).
//! * **NVFP4** (64 values, [`NVFP4_BYTES`] = 36): 4 UE4M3 scale bytes `d[s]`, then 32 bytes
//!   of codes. Sub-block `s < 4` covers values `16s..16s + 16`: value `16s + j` (`j < 8`) is
//!   the low nibble of byte `4 + 8s + j`, value `16s + j + 8` its high nibble, each decoding
//!   to `K[c]·u(d[s])`. `u` is half the unsigned E4M3 value ([`ue4m3_half`]): bit 7 is
//!   ignored, exponent bits 6..3 (bias 7), mantissa bits 2..0, exponent 0 subnormal, and
//!   the bytes `0x00` and `0x7F` (only those) decode to zero.
//! * **Q1_0** (128 values, [`Q1_0_BYTES`] = 18): f16 `d`, then 16 bytes of sign bits: bit
//!   `j % 8` of byte `2 + j / 8` set means value `j` is `+d`, clear `−d`.
//! * **Q2_0** (64 values, [`Q2_0_BYTES`] = 18): f16 `d`, then 16 bytes of 2-bit fields: value
//!   `j` is `(((qs[j / 4] >> 2·(j % 4)) & 3) − 1)·d` (the field 3 decodes to `+2·d`; the
//!   quantizer, ternary like TQ2_0's, never writes it).
//!
//! # Quantization (ggml's `quantize_row_<type>_ref` rules)
//!
//! * TQ1_0 / TQ2_0 / Q2_0: `d = max|x|` (stored as f16, nearest even), `id = 1/d` (0 if
//!   `d = 0`), trit `t = round(x·id) + 1` with halves away from zero, computed with the f32 `d`
//!   (Q2_0 per block of 64, as ggml's library quantizes it: checked against its bytes).
//! * MXFP4: with `a = max|x|`, `e = floor(log2 a) − 2 + 127` (0 if `a = 0`); then each value
//!   takes the code `c` minimising `|K[c]·s(e) − x|` in f32, the first such code on ties
//!   (so zero is code 0, never the negative zero 8). `log2 a` is rounded to f32 (as ggml's
//!   `log2f` result is) before the floor: a largest magnitude within an f32 rounding of the
//!   next power of two takes the next exponent. An `e` below 0 (only `a < 2⁻¹²⁵`) wraps
//!   modulo 256, which is what ggml's float-to-`uint8_t` conversion does on x86-64 (and
//!   what gguf-py's numpy port does).
//! * NVFP4: per sub-block of 16, `d[s] = ue4m3(max|x| / 6)` with ggml's rounding
//!   ([`f32_to_ue4m3`]: round half up on the fourth mantissa bit, saturating at `0x7E`),
//!   then codes chosen as for MXFP4 against `u(d[s])`.
//! * Q1_0: `d = (Σ|x|)/128` (the sum in f32, values in order), sign bit set iff `x ≥ 0`
//!   (so `−0.0` is `+d`).
//!
//! Non-finite input is accepted without panicking; the bytes it produces are unspecified.
//! gguf-py quantizes TQ1_0, TQ2_0 and MXFP4 with the same rules; the tests compare bytes
//! with it, and round-trip NVFP4 and Q1_0 (which gguf-py does not quantize).
//!
//! # Error of a round trip
//!
//! For finite `x` (decoded `x̂`):
//!
//! * TQ1_0/TQ2_0/Q2_0: `|x − x̂| ≤ d/2 + |d − d̃|` with `d = max|x|` and `d̃` its f16 value.
//! * MXFP4: `|x − x̂| ≤ 2s + max(0, |x| − 12s)` with `s = s(e)`: the levels' gaps are at
//!   most `4s`, and the largest level `12s` is at least `3/4·max|x|` (so the clamp beyond it
//!   costs less than `4s`).
//! * NVFP4: `|x − x̂| ≤ 2u + max(0, |x| − 12u)` with `u = u(d[s])`; for scales in UE4M3's
//!   normal range `12u` is within `1/16` of `max|x|`.
//! * Q1_0 keeps no magnitude per value: `x̂ = ±d̃` with the sign of `x` (`+` for `±0`).
//!
//! The tests check these bounds.

use half::f16;

use super::{f16_at, round_to_i8, BlockCodec, QK_K};
use crate::dtype::DType;

#[cfg(test)]
mod tests;

/// Bytes of one TQ1_0 block (256 values).
pub const TQ1_0_BYTES: usize = 54;
/// Bytes of one TQ2_0 block (256 values).
pub const TQ2_0_BYTES: usize = 66;
/// Bytes of one MXFP4 block ([`QK_MXFP4`] values).
pub const MXFP4_BYTES: usize = 17;
/// Bytes of one NVFP4 block ([`QK_NVFP4`] values).
pub const NVFP4_BYTES: usize = 36;
/// Bytes of one Q1_0 block ([`QK_Q1_0`] values).
pub const Q1_0_BYTES: usize = 18;
/// Values per MXFP4 block.
pub const QK_MXFP4: usize = 32;
/// Values per NVFP4 block (four sub-blocks of [`QK_NVFP4_SUB`], one scale each).
pub const QK_NVFP4: usize = 64;
/// Values per NVFP4 sub-block.
pub const QK_NVFP4_SUB: usize = 16;
/// Values per Q1_0 block.
pub const QK_Q1_0: usize = 128;
/// Bytes of one Q2_0 block ([`QK_Q2_0`] values).
pub const Q2_0_BYTES: usize = 18;
/// Values per Q2_0 block.
pub const QK_Q2_0: usize = 64;

/// The E2M1 (FP4) values doubled, indexed by the 4-bit code: codes 8..15 are the negatives
/// of 0..7 (code 8 is a negative zero, decoding to 0).
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

super::wide_decoders! {
    wide_tq1_0 => decode_tq1_0,
    wide_tq2_0 => decode_tq2_0,
    wide_mxfp4 => decode_mxfp4,
    wide_nvfp4 => decode_nvfp4,
    wide_q1_0 => decode_q1_0,
    wide_q2_0 => decode_q2_0,
}

/// The byte codec of `dtype`, if it is one of this module's types.
pub fn codec(dtype: DType) -> Option<BlockCodec> {
    type Pair = (fn(&[u8], &mut [f32]), fn(&[f32], &mut [u8]));
    let (to_f32, from_f32): Pair = match dtype {
        DType::TQ1_0 => (wide_tq1_0, encode_tq1_0),
        DType::TQ2_0 => (wide_tq2_0, encode_tq2_0),
        DType::MXFP4 => (wide_mxfp4, encode_mxfp4),
        DType::NVFP4 => (wide_nvfp4, encode_nvfp4),
        DType::Q1_0 => (wide_q1_0, encode_q1_0),
        DType::Q2_0 => (wide_q2_0, encode_q2_0),
        _ => return None,
    };
    Some(BlockCodec {
        to_f32,
        from_f32: Some(from_f32),
    })
}

// ---------------------------------------------------------------------------------------------
// Scales.
// ---------------------------------------------------------------------------------------------

/// Half the E8M0 scale of exponent byte `e`: `2^(e − 128)`, exactly (subnormal for `e < 2`).
#[inline]
pub fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

/// Half the value of the unsigned E4M3 byte `b` (bit 7 ignored; `0x00` and `0x7F` are 0):
/// `(8 + m)·2^(x − 11)` for exponent bits `x ≥ 1`, `m·2⁻¹⁰` for `x = 0`. Exact.
#[inline]
pub fn ue4m3_half(b: u8) -> f32 {
    if b == 0 || b == 0x7F {
        return 0.0;
    }
    let exp = i32::from((b >> 3) & 0xF);
    let man = f32::from(b & 7);
    if exp == 0 {
        man * f32::from_bits(0x3A80_0000) // 2⁻¹⁰
    } else {
        // 2^(exp − 11) is a normal f32 for exp in 1..=15.
        (8.0 + man) * f32::from_bits(((exp - 11 + 127) as u32) << 23)
    }
}

/// The UE4M3 byte ggml's NVFP4 quantizer stores for the scale `x` (`max|x| / 6`): 0 for
/// `x ≤ 0` or NaN; inputs above 448 are clamped to 448; below `2⁻⁶` the subnormal code
/// `trunc(x·512 + 0.5)` (at most 7); otherwise the top three mantissa bits plus the fourth
/// as a rounding bit (half up), carrying into the exponent, and `0x7E` once the exponent
/// field would reach 15.
pub fn f32_to_ue4m3(x: f32) -> u8 {
    if x.is_nan() || x <= 0.0 {
        return 0;
    }
    let x = x.min(448.0);
    let bits = x.to_bits();
    let exp = ((bits >> 23) & 0xFF) as i32 - 127 + 7;
    if exp <= 0 {
        // x < 2⁻⁶, so x·512 + 0.5 < 8.5 and the truncation is at most 8.
        let man = ((x * 512.0 + 0.5) as i32).min(7);
        return man.max(0) as u8;
    }
    if exp >= 15 {
        return 0x7E;
    }
    let mut man = ((bits >> 20) & 7) as i32 + ((bits >> 19) & 1) as i32;
    let mut exp = exp;
    if man > 7 {
        man = 0;
        exp += 1;
        if exp >= 15 {
            return 0x7E;
        }
    }
    ((exp << 3) | man) as u8
}

/// The MXFP4 exponent byte of a block whose largest magnitude is `amax` (see the module
/// docs: the f32-rounded `log2`, floored, offset by 125, wrapped modulo 256).
pub fn mxfp4_exponent(amax: f32) -> u8 {
    if amax.is_nan() || amax <= 0.0 {
        return 0;
    }
    // f64 log2 is within an f64 rounding of the exact value, so rounding it to f32 gives the
    // correctly rounded f32 logarithm (barring a double-rounding tie, which an exact log2 of
    // a float that is not a power of two never is).
    let l = (f64::from(amax).log2() as f32).floor();
    // Saturating conversion (infinity → i32::MAX), then modulo 256 like x86-64's cvttss2si.
    (l - 2.0 + 127.0) as i32 as u8
}

/// The code of the level `K[c]·d` nearest to `x`, the first one on ties (ggml's
/// `best_index_mxfp4`: a linear scan with a strict comparison).
#[inline]
pub fn best_fp4_code(x: f32, d: f32) -> u8 {
    let mut best = 0u8;
    let mut best_err = (f32::from(KVALUES_MXFP4[0]) * d - x).abs();
    for (c, &k) in KVALUES_MXFP4.iter().enumerate().skip(1) {
        let err = (f32::from(k) * d - x).abs();
        if err < best_err {
            best = c as u8;
            best_err = err;
        }
    }
    best
}

// ---------------------------------------------------------------------------------------------
// Unpacking, shared with the dot products (values in row order, as small integers).
// ---------------------------------------------------------------------------------------------

/// Trit `k` (`0..=2`) of a TQ1_0 byte.
#[inline(always)]
fn trit(b: u8, k: usize) -> i8 {
    const POW3: [u8; 5] = [1, 3, 9, 27, 81];
    let q = b.wrapping_mul(POW3[k]);
    ((u16::from(q) * 3) >> 8) as i8
}

/// The 256 ternary quants `t − 1` (`−1..=1`) of a TQ1_0 block (its first 52 bytes).
pub fn tq1_0_quants(b: &[u8]) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for k in 0..5 {
        for m in 0..32 {
            q[32 * k + m] = trit(b[m], k) - 1;
        }
        for m in 0..16 {
            q[160 + 16 * k + m] = trit(b[32 + m], k) - 1;
        }
    }
    for k in 0..4 {
        for j in 0..4 {
            q[240 + 4 * k + j] = trit(b[48 + j], k) - 1;
        }
    }
    q
}

/// The 256 quants `f − 1` (`−1..=2`) of a TQ2_0 block's 64 `qs` bytes.
pub fn tq2_0_quants(qs: &[u8]) -> [i8; QK_K] {
    std::array::from_fn(|v| {
        let (h, l, m) = (v / 128, (v / 32) % 4, v % 32);
        ((qs[32 * h + m] >> (2 * l)) & 3) as i8 - 1
    })
}

/// The 32 doubled FP4 levels of an MXFP4 block's 16 code bytes.
pub fn mxfp4_levels(qs: &[u8]) -> [i8; QK_MXFP4] {
    std::array::from_fn(|j| {
        let b = qs[j % 16];
        KVALUES_MXFP4[usize::from(if j < 16 { b & 15 } else { b >> 4 })]
    })
}

/// The 64 doubled FP4 levels of an NVFP4 block's 32 code bytes.
pub fn nvfp4_levels(qs: &[u8]) -> [i8; QK_NVFP4] {
    std::array::from_fn(|v| {
        let (s, j) = (v / 16, v % 16);
        let b = qs[8 * s + j % 8];
        KVALUES_MXFP4[usize::from(if j < 8 { b & 15 } else { b >> 4 })]
    })
}

/// The 128 signs (`±1`) of a Q1_0 block's 16 bit bytes.
pub fn q1_0_signs(qs: &[u8]) -> [i8; QK_Q1_0] {
    std::array::from_fn(|j| {
        if (qs[j / 8] >> (j % 8)) & 1 != 0 {
            1
        } else {
            -1
        }
    })
}

/// The 64 quants `f − 1` (`−1..=2`) of a Q2_0 block's 16 code bytes.
pub fn q2_0_quants(qs: &[u8]) -> [i8; QK_Q2_0] {
    std::array::from_fn(|j| ((qs[j / 4] >> (2 * (j % 4))) & 3) as i8 - 1)
}

// ---------------------------------------------------------------------------------------------
// Decoders.
// ---------------------------------------------------------------------------------------------

#[inline(always)]
fn decode_tq1_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(TQ1_0_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b, 52);
        for (out, &q) in y.iter_mut().zip(&tq1_0_quants(b)) {
            *out = f32::from(q) * d;
        }
    }
}

#[inline(always)]
fn decode_tq2_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(TQ2_0_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b, 64);
        for (out, &q) in y.iter_mut().zip(&tq2_0_quants(&b[..64])) {
            *out = f32::from(q) * d;
        }
    }
}

#[inline(always)]
fn decode_mxfp4(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(MXFP4_BYTES)
        .zip(dst.chunks_exact_mut(QK_MXFP4))
    {
        let d = e8m0_half(b[0]);
        for (out, &k) in y.iter_mut().zip(&mxfp4_levels(&b[1..])) {
            *out = f32::from(k) * d;
        }
    }
}

#[inline(always)]
fn decode_nvfp4(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(NVFP4_BYTES)
        .zip(dst.chunks_exact_mut(QK_NVFP4))
    {
        let levels = nvfp4_levels(&b[4..]);
        for (v, out) in y.iter_mut().enumerate() {
            *out = f32::from(levels[v]) * ue4m3_half(b[v / QK_NVFP4_SUB]);
        }
    }
}

#[inline(always)]
fn decode_q1_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(Q1_0_BYTES)
        .zip(dst.chunks_exact_mut(QK_Q1_0))
    {
        let d = f16_at(b, 0);
        for (j, out) in y.iter_mut().enumerate() {
            *out = if (b[2 + j / 8] >> (j % 8)) & 1 != 0 {
                d
            } else {
                -d
            };
        }
    }
}

#[inline(always)]
fn decode_q2_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(Q2_0_BYTES)
        .zip(dst.chunks_exact_mut(QK_Q2_0))
    {
        let d = f16_at(b, 0);
        for (out, &q) in y.iter_mut().zip(&q2_0_quants(&b[2..])) {
            *out = f32::from(q) * d;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Encoders.
// ---------------------------------------------------------------------------------------------

/// `d = max|x|` and the trits `round(x/d) + 1` of a ternary block.
fn ternary(x: &[f32]) -> (f32, [u8; QK_K]) {
    let d = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    // |x·id| ≤ 1 up to rounding for finite input; the clamp only matters for NaN/inf.
    let t = std::array::from_fn(|v| (round_to_i8(x[v] * id).clamp(-1, 1) + 1) as u8);
    (d, t)
}

/// A byte holding five trits, the first most significant: `⌈256·T/243⌉`.
#[inline]
fn pack_trits(t: [u8; 5]) -> u8 {
    let v = t.iter().fold(0u16, |acc, &d| acc * 3 + u16::from(d));
    (v * 256).div_ceil(243) as u8
}

fn encode_tq1_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(TQ1_0_BYTES))
    {
        let (d, t) = ternary(x);
        for m in 0..32 {
            b[m] = pack_trits(std::array::from_fn(|k| t[32 * k + m]));
        }
        for m in 0..16 {
            b[32 + m] = pack_trits(std::array::from_fn(|k| t[160 + 16 * k + m]));
        }
        for j in 0..4 {
            // Four trits, shifted up by one position (the last digit is zero).
            b[48 + j] = pack_trits(std::array::from_fn(|k| {
                if k < 4 {
                    t[240 + 4 * k + j]
                } else {
                    0
                }
            }));
        }
        b[52..54].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    }
}

fn encode_tq2_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(TQ2_0_BYTES))
    {
        let (d, t) = ternary(x);
        for h in 0..2 {
            for m in 0..32 {
                b[32 * h + m] =
                    (0..4).fold(0u8, |acc, l| acc | (t[128 * h + 32 * l + m] << (2 * l)));
            }
        }
        b[64..66].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    }
}

/// The largest magnitude of `x` as ggml's FP4 quantizers find it (`amax < |v|` updates, so
/// NaN values are skipped).
fn fp4_amax(x: &[f32]) -> f32 {
    x.iter()
        .fold(0.0f32, |m, v| if m < v.abs() { v.abs() } else { m })
}

fn encode_mxfp4(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src
        .chunks_exact(QK_MXFP4)
        .zip(dst.chunks_exact_mut(MXFP4_BYTES))
    {
        let e = mxfp4_exponent(fp4_amax(x));
        let d = e8m0_half(e);
        b[0] = e;
        for j in 0..16 {
            b[1 + j] = best_fp4_code(x[j], d) | (best_fp4_code(x[j + 16], d) << 4);
        }
    }
}

fn encode_nvfp4(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src
        .chunks_exact(QK_NVFP4)
        .zip(dst.chunks_exact_mut(NVFP4_BYTES))
    {
        for (s, xs) in x.chunks_exact(QK_NVFP4_SUB).enumerate() {
            let code = f32_to_ue4m3(fp4_amax(xs) / 6.0);
            b[s] = code;
            let d = ue4m3_half(code);
            for j in 0..8 {
                b[4 + 8 * s + j] = best_fp4_code(xs[j], d) | (best_fp4_code(xs[j + 8], d) << 4);
            }
        }
    }
}

fn encode_q1_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src
        .chunks_exact(QK_Q1_0)
        .zip(dst.chunks_exact_mut(Q1_0_BYTES))
    {
        let sum = x.iter().fold(0.0f32, |s, v| s + v.abs());
        b[0..2].copy_from_slice(&f16::from_f32(sum / QK_Q1_0 as f32).to_le_bytes());
        for (byte, xs) in b[2..].iter_mut().zip(x.chunks_exact(8)) {
            *byte = xs
                .iter()
                .enumerate()
                .fold(0u8, |acc, (i, &v)| acc | (u8::from(v >= 0.0) << i));
        }
    }
}

fn encode_q2_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src
        .chunks_exact(QK_Q2_0)
        .zip(dst.chunks_exact_mut(Q2_0_BYTES))
    {
        let d = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[0..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        for (byte, xs) in b[2..].iter_mut().zip(x.chunks_exact(4)) {
            // |x·id| ≤ 1 up to rounding for finite input; the clamp only matters for NaN/inf.
            *byte = xs.iter().enumerate().fold(0u8, |acc, (i, &v)| {
                acc | (((round_to_i8(v * id).clamp(-1, 1) + 1) as u8) << (2 * i))
            });
        }
    }
}
