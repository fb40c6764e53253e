//! ggml's K-quants (super-blocks of 256 values): q2_K, q3_K, q4_K, q5_K, q6_K, q8_K, and
//! iq4_xs: byte codecs with ggml's layouts and reference quantizers.
//!
//! # Layouts
//!
//! Every type stores a row as whole super-blocks of [`QK_K`] = 256 values. Multi-byte fields
//! are little-endian and may sit at any alignment (fields are read byte-wise). "f16" is an
//! IEEE half; decoding converts it to f32 exactly. Value `v` (0..256) of a super-block is
//! found as follows (`g` is its group, whose scale applies):
//!
//! * **q2_K** (84 bytes): `scales[16]`, `qs[64]`, `d: f16`, `dmin: f16`. Groups of 16
//!   (`g = v / 16`); `scales[g]` holds the 4-bit scale in its low nibble and the 4-bit minimum
//!   in its high nibble. The 2-bit quant is `(qs[32·h + v % 32] >> 2·t) & 3` with `h = v / 128`,
//!   `t = (v % 128) / 32`. Value: `(d·sc)·q − dmin·m`.
//! * **q3_K** (110 bytes): `hmask[32]`, `qs[64]`, `scales[12]`, `d: f16`. Groups of 16. The
//!   low two bits come from `qs` as in q2_K; the high bit is bit `v / 32` of `hmask[v % 32]`,
//!   and the quant is `low − 4` when that bit is clear, `low` when set (`−4..=3`). The 6-bit
//!   scale of group `g` is `(scales[g] & 15)` (for `g < 8`) or `(scales[g − 8] >> 4)` (for
//!   `g ≥ 8`) as its low four bits, and `(scales[8 + g % 4] >> 2·(g / 4)) & 3` as its top two,
//!   minus 32 (`−32..=31`). Value: `(d·sc)·q`.
//! * **q4_K** (144 bytes): `d: f16`, `dmin: f16`, `scales[12]`, `qs[128]`. Groups of 32
//!   (`g = v / 32`), each with a 6-bit scale and a 6-bit minimum packed in `scales` (for
//!   `g < 4`: `scales[g] & 63` and `scales[g + 4] & 63`; for `g ≥ 4`: the low nibble /
//!   high nibble of `scales[g + 4]` with the top two bits of `scales[g − 4]` / `scales[g]`).
//!   Chunk `c = v / 64` uses bytes `qs[32c..32c + 32]`: low nibbles for its first 32 values,
//!   high nibbles for the next 32. Value: `(d·sc)·q − dmin·m`.
//! * **q5_K** (176 bytes): `d`, `dmin`, `scales[12]` as q4_K, `qh[32]`, `qs[128]`. The low
//!   four bits as q4_K; bit 4 is bit `v / 32` of `qh[v % 32]` (`q` in `0..=31`).
//! * **q6_K** (210 bytes): `ql[128]`, `qh[64]`, `scales[16]: i8`, `d: f16`. Groups of 16.
//!   With `h = v / 128`, `w = v % 128`: the low nibble is `ql[64h + w] & 15` for `w < 64`,
//!   else `ql[64h + w − 64] >> 4`; the top two bits are `(qh[32h + w % 32] >> 2·(w / 32)) & 3`;
//!   the quant is that 6-bit number minus 32 (`−32..=31`). Value: `(d·sc)·q`.
//! * **q8_K** (292 bytes): `d: f32`, `qs[256]: i8`, `bsums[16]: i16` (the sum of each run of
//!   16 quants). Value: `d·q`. Only ever an activation type (the partner of the others in dot
//!   products).
//! * **iq4_xs** (136 bytes): `d: f16`, `scales_h: u16`, `scales_l[4]`, `qs[128]`. Groups of
//!   32; the 6-bit scale of group `g` is `(scales_l[g / 2] >> 4·(g % 2)) & 15` plus
//!   `((scales_h >> 2g) & 3) << 4`, minus 32. Group `g` uses bytes `qs[16g..16g + 16]`: low
//!   nibbles for its first 16 values, high nibbles for the last 16; a nibble indexes ggml's
//!   16-entry non-linear table `kvalues_iq4nl` (`−127, −104, −83, −65, −49, −35, −22, −10, 1,
//!   13, 25, 38, 53, 69, 89, 113`). Value: `(d·sc)·kvalue`.
//!
//! # Decoding
//!
//! Decoding follows the operation order of ggml's C dequantizers and of gguf-py's numpy
//! ones, which agree: f16 → f32 exactly, then per group `dl = d·sc` (and `ml = dmin·m`) in
//! f32, then `dl·q` (and `− ml`) as separate, individually rounded f32 operations (no fused
//! multiply-add). The unit tests compare every value bit for bit with
//! `gguf.quants.dequantize` on a checked-in fixture (`tests/data/kquant_blocks.bin`, made by
//! `scripts/make_kquant_fixtures.py`). Every bit pattern decodes without panicking.
//!
//! # Encoding
//!
//! Encoding follows ggml's reference quantizers (`quantize_row_*_ref`, no importance
//! weights), written anew here:
//!
//! * Rounding to an integer is ggml's `nearest_int`: add `1.5·2²³` in f32 and read the low
//!   mantissa bits, which rounds half to even for `|x| < 2²²` (larger or non-finite
//!   arguments give some integer, which is then clamped; nothing panics).
//! * q2_K, q4_K, q5_K: per group, a weighted search for a scale and a minimum
//!   (`make_qkx2_quants`: an initial min/max fit, then `nstep + 1` trial scales
//!   `(rmin + rdelta·i + nmax)/(max − min)` each refitted by least squares, keeping the best
//!   weighted error: absolute error with weights `|x|` for q2_K; squared error with weights
//!   `rms(group) + |x|` for q4_K and q5_K). The group scales and minimums are then quantized
//!   against their maxima to 4 bits (q2_K) or 6 bits, the super-block scales rounded to f16,
//!   and every value requantized against its group's decoded scale and minimum.
//! * q3_K: per group a sign-aware scale (`make_q3_quants`: `−4/max`, then up to five passes of
//!   coordinate descent on the `x²`-weighted error), group scales quantized to 6 bits
//!   signed against the largest (`d = −max_scale/32`), values requantized.
//! * q6_K: per group `make_qx_quants` (scale `−32/max`, then 18 trial scales
//!   `−(32 + 0.1·i)/max`, keeping the best `x²`-weighted least-squares fit), group scales
//!   quantized to `i8` against the largest (`d = −max_scale/128`), values requantized. A
//!   super-block whose group scales are all below 1e-15 is stored as zeros.
//! * q8_K: `iscale = −127/m` where `m` is the first value of largest magnitude (with its
//!   sign), `q = min(127, nearest_int(iscale·x))`, `d = 1/iscale` stored as f32, and the 16
//!   bsums; an all-zero super-block is stored as zeros. This matches ggml bit for bit.
//! * iq4_xs: per group of 32, `d = max/127` and then 15 trial scales `(i − 127)/max`
//!   (`i = −7..=7`), each value mapped to the nearest table entry, keeping the best
//!   `x²`-weighted least-squares scale; group scales quantized to 6 bits signed against the
//!   largest (`d = −max_scale/32`), values remapped with the quantized group scale.
//!
//! Scales are computed in f32 and only stored as f16 (round to nearest even). Every f32
//! operation is rounded on its own, in ggml's C evaluation order (no fused multiply-add), so
//! the bytes equal those of a ggml build without FMA contraction: the unit tests compare all
//! seven encoders byte for byte with ggml's compiled `quantize_row_*_ref` on a checked-in
//! fixture (`tests/data/kquant_ggml_quantized.bin`). A ggml build that contracts
//! multiply-adds into FMAs may round a scale search differently now and then.
//!
//! # Error bounds
//!
//! q8_K: every finite value is off by at most `|d|/2` plus f32 rounding (about
//! `2⁻²³·|x|`): `q` is `x·iscale` rounded to nearest and `|x·iscale| ≤ 127`.
//!
//! The others have no per-value guarantee (values beyond a group's grid are clamped, and a
//! group's scale is a least-squares compromise). ggml's `test-quantize-fns` bounds the
//! round-trip error of its synthetic row `x[i] = 0.1 + 2·cos(i + offset)` of `n = 4096`
//! values, measured as `sqrt(Σ(x − x̂)²)/n` (its `array_rmse`, which is the RMS error divided
//! by `sqrt(n) = 64`), by 0.0075 for q2_K, 0.0040 for q3_K and 0.002 for the others. The
//! unit tests check these limits for several offsets, and also guard the plain RMS error
//! `sqrt(Σ(x − x̂)²/n)` on that row, which measures about 0.299 (q2_K), 0.161 (q3_K), 0.063
//! (q4_K), 0.034 (q5_K), 0.0167 (q6_K), 0.0048 (q8_K) and 0.081 (iq4_xs): about what a
//! uniform grid of the type's resolution over each group's range gives.
//!
//! Non-finite input never panics; the bytes it produces are unspecified.

mod search;
#[cfg(test)]
mod tests;

use half::f16;

pub use super::f16_at;
use super::{BlockCodec, QK_K};
use crate::dtype::DType;
use search::{best_index_iq4, make_q3_quants, make_qkx2_quants, make_qx_quants, nearest_int};

/// Bytes of one q2_K super-block.
pub const Q2_K_BYTES: usize = 84;
/// Bytes of one q3_K super-block.
pub const Q3_K_BYTES: usize = 110;
/// Bytes of one q4_K super-block.
pub const Q4_K_BYTES: usize = 144;
/// Bytes of one q5_K super-block.
pub const Q5_K_BYTES: usize = 176;
/// Bytes of one q6_K super-block.
pub const Q6_K_BYTES: usize = 210;
/// Bytes of one q8_K super-block.
pub const Q8_K_BYTES: usize = 292;
/// Bytes of one iq4_xs super-block.
pub const IQ4_XS_BYTES: usize = 136;

/// ggml's 16 non-linear 4-bit levels (`kvalues_iq4nl`), sorted ascending; iq4_xs nibbles
/// index this table.
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// ggml's threshold below which a group counts as all zeros.
const GROUP_MAX_EPS: f32 = 1e-15;

/// The codec of `dtype` if it is one of this module's types.
pub fn codec(dtype: DType) -> Option<BlockCodec> {
    type Pair = (fn(&[u8], &mut [f32]), fn(&[f32], &mut [u8]));
    let (to_f32, from_f32): Pair = match dtype {
        DType::Q2_K => (wide_q2_k, encode_q2_k),
        DType::Q3_K => (wide_q3_k, encode_q3_k),
        DType::Q4_K => (wide_q4_k, encode_q4_k),
        DType::Q5_K => (wide_q5_k, encode_q5_k),
        DType::Q6_K => (wide_q6_k, encode_q6_k),
        DType::Q8_K => (decode_q8_k, encode_q8_k),
        DType::IQ4_XS => (wide_iq4_xs, encode_iq4_xs),
        _ => return None,
    };
    Some(BlockCodec {
        to_f32,
        from_f32: Some(from_f32),
    })
}

// ---------------------------------------------------------------------------------------------
// Field access and unpacking, shared by the decoders and the portable dot products.
// ---------------------------------------------------------------------------------------------

/// The f32 at byte `at` of `b`.
#[inline]
pub(crate) fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Stores `v` rounded to f16 (nearest even) at byte `at` and returns the stored value as f32.
fn put_f16(b: &mut [u8], at: usize, v: f32) -> f32 {
    let h = f16::from_f32(v);
    b[at..at + 2].copy_from_slice(&h.to_bits().to_le_bytes());
    h.to_f32()
}

/// The 2-bit fields of q2_K / q3_K (`qs`, 64 bytes) in value order (`0..=3`).
#[inline]
pub fn unpack_2bit(qs: &[u8]) -> [u8; QK_K] {
    let mut out = [0u8; QK_K];
    for h in 0..2 {
        for t in 0..4 {
            for l in 0..32 {
                out[128 * h + 32 * t + l] = (qs[32 * h + l] >> (2 * t)) & 3;
            }
        }
    }
    out
}

/// The nibbles of q4_K / q5_K (`qs`, 128 bytes) in value order (`0..=15`).
#[inline]
pub fn unpack_4bit(qs: &[u8]) -> [u8; QK_K] {
    let mut out = [0u8; QK_K];
    for c in 0..4 {
        for l in 0..32 {
            let b = qs[32 * c + l];
            out[64 * c + l] = b & 15;
            out[64 * c + 32 + l] = b >> 4;
        }
    }
    out
}

/// Bit `v / 32` of `bits[v % 32]` for every value `v` (the high bits of q3_K and q5_K).
#[inline]
pub(crate) fn unpack_high_bits(bits: &[u8]) -> [u8; QK_K] {
    let mut out = [0u8; QK_K];
    for (v, o) in out.iter_mut().enumerate() {
        *o = (bits[v % 32] >> (v / 32)) & 1;
    }
    out
}

/// The 16 signed group scales of q3_K (`−32..=31`) from its 12 scale bytes.
#[inline]
pub fn q3_k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (g, o) in out.iter_mut().enumerate() {
        let low = if g < 8 { s[g] & 15 } else { s[g - 8] >> 4 };
        let high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
        *o = (low | (high << 4)) as i8 - 32;
    }
    out
}

/// The q3_K quants (`−4..=3`) of a super-block in value order.
#[inline]
pub fn q3_k_quants(hmask: &[u8], qs: &[u8]) -> [i8; QK_K] {
    let low = unpack_2bit(qs);
    let high = unpack_high_bits(hmask);
    std::array::from_fn(|v| low[v] as i8 - if high[v] != 0 { 0 } else { 4 })
}

/// The 8 (scale, minimum) pairs (6 bits each) of q4_K / q5_K from their 12 scale bytes
/// (ggml's `get_scale_min_k4`).
#[inline]
pub fn k4_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for g in 0..8 {
        if g < 4 {
            sc[g] = s[g] & 63;
            m[g] = s[g + 4] & 63;
        } else {
            sc[g] = (s[g + 4] & 15) | ((s[g - 4] >> 6) << 4);
            m[g] = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
        }
    }
    (sc, m)
}

/// The q5_K quants (`0..=31`) of a super-block in value order.
#[inline]
pub fn q5_k_quants(qh: &[u8], qs: &[u8]) -> [u8; QK_K] {
    let low = unpack_4bit(qs);
    let high = unpack_high_bits(qh);
    std::array::from_fn(|v| low[v] | (high[v] << 4))
}

/// The q6_K quants (`−32..=31`) of a super-block in value order.
#[inline]
pub fn q6_k_quants(ql: &[u8], qh: &[u8]) -> [i8; QK_K] {
    let mut out = [0i8; QK_K];
    for h in 0..2 {
        for w in 0..128 {
            let low = if w < 64 {
                ql[64 * h + w] & 15
            } else {
                ql[64 * h + w - 64] >> 4
            };
            let high = (qh[32 * h + w % 32] >> (2 * (w / 32))) & 3;
            out[128 * h + w] = (low | (high << 4)) as i8 - 32;
        }
    }
    out
}

/// The 8 signed group scales of iq4_xs (`−32..=31`).
#[inline]
pub fn iq4_xs_scales(scales_h: u16, scales_l: &[u8]) -> [i8; 8] {
    std::array::from_fn(|g| {
        let low = (scales_l[g / 2] >> (4 * (g % 2))) & 15;
        let high = ((scales_h >> (2 * g)) & 3) as u8;
        (low | (high << 4)) as i8 - 32
    })
}

/// The iq4_xs table values (`−127..=113`) of a super-block in value order.
#[inline]
pub fn iq4_xs_quants(qs: &[u8]) -> [i8; QK_K] {
    let mut out = [0i8; QK_K];
    for g in 0..8 {
        for j in 0..16 {
            let b = qs[16 * g + j];
            out[32 * g + j] = KVALUES_IQ4NL[usize::from(b & 15)];
            out[32 * g + 16 + j] = KVALUES_IQ4NL[usize::from(b >> 4)];
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Decoders.
// ---------------------------------------------------------------------------------------------

super::wide_decoders! {
    wide_q2_k => decode_q2_k,
    wide_q3_k => decode_q3_k,
    wide_q4_k => decode_q4_k,
    wide_q5_k => decode_q5_k,
    wide_q6_k => decode_q6_k,
    wide_iq4_xs => decode_iq4_xs,
}

#[inline(always)]
fn decode_q2_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q2_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let q = unpack_2bit(&b[16..80]);
        let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
        for ((&s, ys), qs) in b[..16]
            .iter()
            .zip(y.chunks_exact_mut(16))
            .zip(q.chunks_exact(16))
        {
            let dl = d * f32::from(s & 15);
            let ml = dmin * f32::from(s >> 4);
            for (out, &qv) in ys.iter_mut().zip(qs) {
                *out = dl * f32::from(qv) - ml;
            }
        }
    }
}

#[inline(always)]
fn decode_q3_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q3_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let q = q3_k_quants(&b[0..32], &b[32..96]);
        let sc = q3_k_scales(&b[96..108]);
        let d = f16_at(b, 108);
        for ((&s, ys), qs) in sc
            .iter()
            .zip(y.chunks_exact_mut(16))
            .zip(q.chunks_exact(16))
        {
            let dl = d * f32::from(s);
            for (out, &qv) in ys.iter_mut().zip(qs) {
                *out = dl * f32::from(qv);
            }
        }
    }
}

/// q4_K and q5_K share everything but where the quants come from.
#[inline(always)]
fn decode_k4(b: &[u8], q: &[u8; QK_K], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, m) = k4_scales_mins(&b[4..16]);
    for g in 0..8 {
        let dl = d * f32::from(sc[g]);
        let ml = dmin * f32::from(m[g]);
        for j in 32 * g..32 * g + 32 {
            y[j] = dl * f32::from(q[j]) - ml;
        }
    }
}

#[inline(always)]
fn decode_q4_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q4_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        decode_k4(b, &unpack_4bit(&b[16..144]), y);
    }
}

#[inline(always)]
fn decode_q5_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q5_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        decode_k4(b, &q5_k_quants(&b[16..48], &b[48..176]), y);
    }
}

#[inline(always)]
fn decode_q6_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q6_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let q = q6_k_quants(&b[0..128], &b[128..192]);
        let d = f16_at(b, 208);
        for g in 0..16 {
            let dl = d * f32::from(b[192 + g] as i8);
            for j in 16 * g..16 * g + 16 {
                y[j] = dl * f32::from(q[j]);
            }
        }
    }
}

fn decode_q8_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q8_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f32_at(b, 0);
        for (out, &q) in y.iter_mut().zip(&b[4..4 + QK_K]) {
            *out = d * f32::from(q as i8);
        }
    }
}

#[inline(always)]
fn decode_iq4_xs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(IQ4_XS_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b, 0);
        let sc = iq4_xs_scales(u16::from_le_bytes([b[2], b[3]]), &b[4..8]);
        let q = iq4_xs_quants(&b[8..136]);
        for ((&s, ys), qs) in sc
            .iter()
            .zip(y.chunks_exact_mut(32))
            .zip(q.chunks_exact(32))
        {
            let dl = d * f32::from(s);
            for (out, &qv) in ys.iter_mut().zip(qs) {
                *out = dl * f32::from(qv);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Encoders (ggml's reference quantizers).
// ---------------------------------------------------------------------------------------------

/// Packs 2-bit values (`l[v]` in `0..=3`) into the 64 bytes of q2_K / q3_K `qs`.
fn pack_2bit(l: &[u8; QK_K], qs: &mut [u8]) {
    for h in 0..2 {
        for i in 0..32 {
            let at = 128 * h + i;
            qs[32 * h + i] = l[at] | (l[at + 32] << 2) | (l[at + 64] << 4) | (l[at + 96] << 6);
        }
    }
}

fn encode_q2_k(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q2_K_BYTES)) {
        quantize_q2_k(x, b);
    }
}

fn quantize_q2_k(x: &[f32], b: &mut [u8]) {
    const Q4SCALE: f32 = 15.0;
    let mut l = [0u8; QK_K];
    let mut laux = [0u8; 16];
    let mut weights = [0f32; 16];
    let mut scales = [0f32; 16];
    let mut mins = [0f32; 16];
    let mut max_scale = 0f32;
    let mut max_min = 0f32;
    for g in 0..16 {
        let xs = &x[16 * g..16 * g + 16];
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = v.abs();
        }
        let (scale, min) = make_qkx2_quants(
            xs,
            &weights,
            3,
            &mut l[16 * g..16 * g + 16],
            &mut laux,
            -0.5,
            0.1,
            15,
            true,
        );
        scales[g] = scale;
        mins[g] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let (sc, rest) = b.split_at_mut(16);
    let (qs, ds) = rest.split_at_mut(64);
    let d = if max_scale > 0.0 {
        let iscale = Q4SCALE / max_scale;
        for (s, &v) in sc.iter_mut().zip(&scales) {
            // ggml stores the int into a byte: truncation (the value is 0..=15 on finite input).
            *s = nearest_int(iscale * v) as u8;
        }
        put_f16(ds, 0, max_scale / Q4SCALE)
    } else {
        sc.fill(0);
        put_f16(ds, 0, 0.0)
    };
    let dmin = if max_min > 0.0 {
        let iscale = Q4SCALE / max_min;
        for (s, &v) in sc.iter_mut().zip(&mins) {
            *s |= nearest_int(iscale * v).wrapping_shl(4) as u8;
        }
        put_f16(ds, 2, max_min / Q4SCALE)
    } else {
        put_f16(ds, 2, 0.0)
    };
    for ((&s, ls), xs) in sc
        .iter()
        .zip(l.chunks_exact_mut(16))
        .zip(x.chunks_exact(16))
    {
        let dl = d * f32::from(s & 15);
        if dl == 0.0 {
            continue;
        }
        let ml = dmin * f32::from(s >> 4);
        for (li, &v) in ls.iter_mut().zip(xs) {
            *li = nearest_int((v + ml) / dl).clamp(0, 3) as u8;
        }
    }
    pack_2bit(&l, qs);
}

fn encode_q3_k(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q3_K_BYTES)) {
        quantize_q3_k(x, b);
    }
}

fn quantize_q3_k(x: &[f32], b: &mut [u8]) {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let mut max_scale = 0f32;
    let mut amax = 0f32;
    for g in 0..16 {
        scales[g] = make_q3_quants(&x[16 * g..16 * g + 16], 4, &mut l[16 * g..16 * g + 16]);
        let a = scales[g].abs();
        if a > amax {
            amax = a;
            max_scale = scales[g];
        }
    }
    let (hmask, rest) = b.split_at_mut(32);
    let (qs, rest) = rest.split_at_mut(64);
    let (sc, ds) = rest.split_at_mut(12);
    sc.fill(0);
    let d = if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for (g, &s) in scales.iter().enumerate() {
            // As ggml: the rounded value goes through an i8 before clamping.
            let v = (i32::from(nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8;
            if g < 8 {
                sc[g] = v & 15;
            } else {
                sc[g - 8] |= (v & 15) << 4;
            }
            sc[8 + g % 4] |= (v >> 4) << (2 * (g / 4));
        }
        put_f16(ds, 0, 1.0 / iscale)
    } else {
        put_f16(ds, 0, 0.0)
    };
    let stored = q3_k_scales(sc);
    for ((&s, ls), xs) in stored
        .iter()
        .zip(l.chunks_exact_mut(16))
        .zip(x.chunks_exact(16))
    {
        let dl = d * f32::from(s);
        if dl == 0.0 {
            continue;
        }
        for (li, &v) in ls.iter_mut().zip(xs) {
            *li = (nearest_int(v / dl).clamp(-4, 3) + 4) as i8;
        }
    }
    // l is now 0..=7: bit 2 goes to hmask (bit v / 32 of byte v % 32), the rest to qs.
    hmask.fill(0);
    let mut low = [0u8; QK_K];
    for v in 0..QK_K {
        let q = l[v] as u8;
        if q > 3 {
            hmask[v % 32] |= 1 << (v / 32);
        }
        low[v] = q & 3;
    }
    pack_2bit(&low, qs);
}

/// Packs 6-bit scales and minimums into the 12 scale bytes of q4_K / q5_K.
fn pack_k4_scales(ls: &[u8; 8], lm: &[u8; 8], s: &mut [u8]) {
    for g in 0..8 {
        if g < 4 {
            s[g] = ls[g];
            s[g + 4] = lm[g];
        } else {
            s[g + 4] = (ls[g] & 15) | ((lm[g] & 15) << 4);
            s[g - 4] |= (ls[g] >> 4) << 6;
            s[g] |= (lm[g] >> 4) << 6;
        }
    }
}

/// The scale search and requantization shared by q4_K (`nmax = 15`) and q5_K (`nmax = 31`):
/// returns the quants (`0..=nmax`) and writes `d`, `dmin` and the scale bytes to `head`
/// (the first 16 bytes of the block).
fn quantize_k4(x: &[f32], nmax: i32, rmin: f32, nstep: i32, head: &mut [u8]) -> [u8; QK_K] {
    let mut l = [0u8; QK_K];
    let mut laux = [0u8; 32];
    let mut weights = [0f32; 32];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut max_scale = 0f32;
    let mut max_min = 0f32;
    for g in 0..8 {
        let xs = &x[32 * g..32 * g + 32];
        let mut sum_x2 = 0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (scale, min) = make_qkx2_quants(
            xs,
            &weights,
            nmax,
            &mut l[32 * g..32 * g + 32],
            &mut laux,
            rmin,
            0.1,
            nstep,
            false,
        );
        scales[g] = scale;
        mins[g] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    // As ggml: the rounded values go through a byte before the clamp to 63.
    let ls: [u8; 8] = std::array::from_fn(|g| (nearest_int(inv_scale * scales[g]) as u8).min(63));
    let lm: [u8; 8] = std::array::from_fn(|g| (nearest_int(inv_min * mins[g]) as u8).min(63));
    let (ds, s) = head.split_at_mut(4);
    s.fill(0);
    pack_k4_scales(&ls, &lm, s);
    let d = put_f16(ds, 0, max_scale / 63.0);
    let dmin = put_f16(ds, 2, max_min / 63.0);
    let (sc, m) = k4_scales_mins(s);
    for g in 0..8 {
        let dl = d * f32::from(sc[g]);
        if dl == 0.0 {
            continue;
        }
        let ml = dmin * f32::from(m[g]);
        for j in 32 * g..32 * g + 32 {
            l[j] = nearest_int((x[j] + ml) / dl).clamp(0, nmax) as u8;
        }
    }
    l
}

fn encode_q4_k(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q4_K_BYTES)) {
        let (head, qs) = b.split_at_mut(16);
        let l = quantize_k4(x, 15, -1.0, 20, head);
        for c in 0..4 {
            for i in 0..32 {
                qs[32 * c + i] = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
            }
        }
    }
}

fn encode_q5_k(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q5_K_BYTES)) {
        let (head, rest) = b.split_at_mut(16);
        let (qh, qs) = rest.split_at_mut(32);
        let l = quantize_k4(x, 31, -0.5, 15, head);
        qh.fill(0);
        for c in 0..4 {
            for i in 0..32 {
                let (a, z) = (l[64 * c + i], l[64 * c + 32 + i]);
                qh[i] |= ((a >> 4) << (2 * c)) | ((z >> 4) << (2 * c + 1));
                qs[32 * c + i] = (a & 15) | ((z & 15) << 4);
            }
        }
    }
}

fn encode_q6_k(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q6_K_BYTES)) {
        quantize_q6_k(x, b);
    }
}

fn quantize_q6_k(x: &[f32], b: &mut [u8]) {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let mut max_scale = 0f32;
    let mut max_abs_scale = 0f32;
    for g in 0..16 {
        let scale = make_qx_quants(&x[16 * g..16 * g + 16], 32, &mut l[16 * g..16 * g + 16]);
        scales[g] = scale;
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = scale;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        b.fill(0);
        return;
    }
    let (ql, rest) = b.split_at_mut(128);
    let (qh, rest) = rest.split_at_mut(64);
    let (sc, ds) = rest.split_at_mut(16);
    let iscale = -128.0 / max_scale;
    let d = put_f16(ds, 0, 1.0 / iscale);
    for (s, &v) in sc.iter_mut().zip(&scales) {
        *s = nearest_int(iscale * v).min(127) as i8 as u8;
    }
    for ((&s, ls), xs) in sc
        .iter()
        .zip(l.chunks_exact_mut(16))
        .zip(x.chunks_exact(16))
    {
        let dl = d * f32::from(s as i8);
        if dl == 0.0 {
            continue;
        }
        for (li, &v) in ls.iter_mut().zip(xs) {
            *li = (nearest_int(v / dl).clamp(-32, 31) + 32) as i8;
        }
    }
    // l is 0..=63 here.
    for h in 0..2 {
        for i in 0..32 {
            let q = |k: usize| l[128 * h + 32 * k + i] as u8;
            ql[64 * h + i] = (q(0) & 15) | ((q(2) & 15) << 4);
            ql[64 * h + 32 + i] = (q(1) & 15) | ((q(3) & 15) << 4);
            qh[32 * h + i] =
                (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
        }
    }
}

fn encode_q8_k(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q8_K_BYTES)) {
        quantize_q8_k(x, b);
    }
}

fn quantize_q8_k(x: &[f32], b: &mut [u8]) {
    let mut max = 0f32;
    let mut amax = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        // ggml leaves the bsums as they were; here the whole block is defined (zeros).
        b.fill(0);
        return;
    }
    let iscale = -127.0 / max;
    let (d, rest) = b.split_at_mut(4);
    let (qs, bsums) = rest.split_at_mut(QK_K);
    for (q, &v) in qs.iter_mut().zip(x) {
        // C stores the int into an int8_t: truncation (in range on finite input).
        *q = nearest_int(iscale * v).min(127) as i8 as u8;
    }
    for (g, out) in bsums.chunks_exact_mut(2).enumerate() {
        let sum: i32 = qs[16 * g..16 * g + 16]
            .iter()
            .map(|&q| i32::from(q as i8))
            .sum();
        out.copy_from_slice(&(sum as i16).to_le_bytes());
    }
    d.copy_from_slice(&(1.0 / iscale).to_le_bytes());
}

fn encode_iq4_xs(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(IQ4_XS_BYTES))
    {
        quantize_iq4_xs(x, b);
    }
}

fn quantize_iq4_xs(x: &[f32], b: &mut [u8]) {
    const NTRY: i32 = 7;
    let values = &KVALUES_IQ4NL;
    let v0 = f32::from(values[0]);
    let mut scales = [0f32; 8];
    let mut weight = [0f32; 32];
    let mut max_scale = 0f32;
    let mut amax_scale = 0f32;
    for (g, scale) in scales.iter_mut().enumerate() {
        let xb = &x[32 * g..32 * g + 32];
        for (w, &v) in weight.iter_mut().zip(xb) {
            *w = v * v;
        }
        let mut amax = 0f32;
        let mut max = 0f32;
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax < GROUP_MAX_EPS {
            *scale = 0.0;
            continue;
        }
        // The sums of one trial inverse scale: Σ w·q·x and Σ w·q².
        let sums = |id: f32| {
            let (mut sumqx, mut sumq2) = (0f32, 0f32);
            for (&v, &w) in xb.iter().zip(&weight) {
                let q = f32::from(values[best_index_iq4(values, id * v)]);
                sumqx += w * q * v;
                sumq2 += w * q * q;
            }
            (sumqx, sumq2)
        };
        let (sumqx, sumq2) = sums(1.0 / (-max / v0));
        let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
        let mut best = d * sumqx;
        for itry in -NTRY..=NTRY {
            let (sumqx, sumq2) = sums((itry + i32::from(values[0])) as f32 / max);
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        *scale = d;
        if d.abs() > amax_scale {
            amax_scale = d.abs();
            max_scale = d;
        }
    }
    let (head, qs) = b.split_at_mut(8);
    let d = -max_scale / 32.0;
    put_f16(head, 0, d);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut scales_h = 0u16;
    let mut scales_l = [0u8; 4];
    let mut l = [0u8; QK_K];
    for (g, &scale) in scales.iter().enumerate() {
        let ls = nearest_int(id * scale).clamp(-32, 31);
        let dl = d * ls as f32;
        let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
        for j in 32 * g..32 * g + 32 {
            l[j] = best_index_iq4(values, idl * x[j]) as u8;
        }
        let ls = (ls + 32) as u8;
        scales_l[g / 2] |= (ls & 15) << (4 * (g % 2));
        scales_h |= u16::from(ls >> 4) << (2 * g);
    }
    head[2..4].copy_from_slice(&scales_h.to_le_bytes());
    head[4..8].copy_from_slice(&scales_l);
    for g in 0..8 {
        for j in 0..16 {
            qs[16 * g + j] = l[32 * g + j] | (l[32 * g + 16 + j] << 4);
        }
    }
}
