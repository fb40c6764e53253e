//! ggml's 3-bit grid quants iq3_xxs and iq3_s (super-blocks of [`QK_K`] = 256 values):
//! layouts, shared unpacking helpers and the byte decoders. ferrograph reads and multiplies
//! these types but does not write them ([`DType::has_quantizer`] is false).
//!
//! # Layouts
//!
//! Both types cut a super-block into 8 sub-blocks of 32 values, each with an odd 4-bit
//! scale, and each sub-block into 8 quadruples of consecutive values. A quadruple is one
//! point of a fixed grid of non-negative byte vectors (the grid data is generated from the
//! gguf package by `scripts/make_iq3_iq1_tables.py`, see [`IQ3_XXS_GRID`] and
//! [`IQ3_S_GRID`]), and every value carries its own sign. Multi-byte fields are
//! little-endian at any alignment.
//!
//! * **iq3_xxs** (98 bytes): `d: f16`, `qs[64]` (grid indices, one byte per quadruple, in
//!   value order: quadruple `k` covers values `4k..4k + 4`), then 8 little-endian `u32`
//!   words, one per sub-block `s`. Word `s` holds four 7-bit sign indices (bits `7l..7l + 7`
//!   for the run of 8 values `32s + 8l..32s + 8l + 8`) and the 4-bit scale `a = w >> 28`.
//!   A 7-bit sign index `i` stands for the 8 sign bits `i | (parity(i) << 7)` (the eighth
//!   sign is chosen so that every run of 8 flips an even number of signs: ggml's
//!   `ksigns_iq2xs` table, computed here by [`sign_byte`]); bit `j` set makes value `j` of
//!   the run negative. Grid points have coordinates in `{4, 12, 20, 28, 36, 44, 52, 62}`.
//!   Value: `db·(±grid)` with `db = (d·(0.5 + a))·0.5`, i.e. `d·(2a + 1)/4`.
//! * **iq3_s** (110 bytes): `d: f16`, `qs[64]` (low 8 bits of the grid indices, one per
//!   quadruple as in iq3_xxs), `qh[8]` (bit `j` of `qh[i]` is the ninth index bit of
//!   quadruple `8i + j`), `signs[32]` (bit `j` of `signs[k]` is the sign of value `8k + j`),
//!   `scales[4]` (sub-block `s` uses the low nibble of `scales[s / 2]` for even `s`, the high
//!   nibble for odd `s`: `a` in `0..=15`). 512 grid points with coordinates in
//!   `{1, 3, …, 15}`. Value: `db·(±grid)` with `db = d·(2a + 1)`.
//!
//! # Decoding
//!
//! Decoding follows the operation order of ggml's C dequantizers and of gguf-py's numpy
//! ones, which agree: f16 → f32 exactly, the sub-block's `db` in f32 as written above (each
//! operation rounded), then one rounded f32 multiplication by the signed grid coordinate
//! (ggml multiplies by the unsigned coordinate and then by `±1`; negation commutes with
//! rounding to nearest, so the bits are the same). The unit tests compare every value bit for
//! bit with `gguf.quants.dequantize` on a checked-in fixture (`tests/data/iq3_iq1_blocks.bin`,
//! made by `scripts/make_iq3_iq1_fixtures.py`). Every bit pattern decodes without panicking
//! (non-finite scales decode to non-finite values).

mod grids;
#[cfg(test)]
pub(crate) mod tests;

use super::{f16_at, BlockCodec, QK_K};
use crate::dtype::DType;
use grids::{IQ3_S_CODES, IQ3_S_LEVELS, IQ3_XXS_CODES, IQ3_XXS_LEVELS};

/// Bytes of one iq3_xxs super-block.
pub const IQ3_XXS_BYTES: usize = 98;
/// Bytes of one iq3_s super-block.
pub const IQ3_S_BYTES: usize = 110;

/// The 256 iq3_xxs grid points: coordinate `j` of point `i` is byte `j` of
/// `IQ3_XXS_GRID[i].to_le_bytes()` (one of 4, 12, …, 52, 62).
pub static IQ3_XXS_GRID: [u32; 256] = expand(&IQ3_XXS_CODES, &IQ3_XXS_LEVELS);

/// The 512 iq3_s grid points, packed as [`IQ3_XXS_GRID`] (coordinates odd, 1..=15).
pub static IQ3_S_GRID: [u32; 512] = expand(&IQ3_S_CODES, &IQ3_S_LEVELS);

/// Expands packed 3-bit level indices into little-endian byte quadruples.
const fn expand<const N: usize>(codes: &[u16; N], levels: &[u8; 8]) -> [u32; N] {
    let mut out = [0u32; N];
    let mut i = 0;
    while i < N {
        let mut j = 0;
        while j < 4 {
            let level = levels[((codes[i] >> (3 * j)) & 7) as usize];
            out[i] |= (level as u32) << (8 * j);
            j += 1;
        }
        i += 1;
    }
    out
}

/// The 8 sign bits a 7-bit iq3_xxs sign index stands for: the index itself (only its low 7
/// bits are read) with its parity as bit 7, so that the byte has an even number of set bits.
#[inline(always)]
pub const fn sign_byte(index: u32) -> u8 {
    let i = (index & 0x7F) as u8;
    i | (((i.count_ones() & 1) as u8) << 7)
}

/// The 4 grid coordinates of `point` with the signs of bits `0..4` of `signs` applied
/// (`bit set` → negative).
#[inline(always)]
fn signed_quad(point: u32, signs: u8, out: &mut [i8]) {
    for (j, (o, g)) in out.iter_mut().zip(point.to_le_bytes()).enumerate() {
        // Coordinates are at most 62, so the negation fits in i8.
        let g = g as i8;
        *o = if signs >> j & 1 != 0 { -g } else { g };
    }
}

/// The signed quants (`±grid`, in `−62..=62`) of an iq3_xxs super-block in value order, and
/// the odd sub-block scales `2a + 1` (`1..=31`) of its 8 sub-blocks.
#[inline]
pub fn iq3_xxs_quants(b: &[u8; IQ3_XXS_BYTES]) -> ([i8; QK_K], [u8; 8]) {
    let mut q = [0i8; QK_K];
    let mut scales = [0u8; 8];
    for s in 0..8 {
        let w = u32::from_le_bytes([b[66 + 4 * s], b[67 + 4 * s], b[68 + 4 * s], b[69 + 4 * s]]);
        scales[s] = 2 * (w >> 28) as u8 + 1;
        for l in 0..4 {
            let signs = sign_byte(w >> (7 * l));
            let run = 32 * s + 8 * l;
            let k = run / 4;
            signed_quad(
                IQ3_XXS_GRID[usize::from(b[2 + k])],
                signs,
                &mut q[run..run + 4],
            );
            signed_quad(
                IQ3_XXS_GRID[usize::from(b[3 + k])],
                signs >> 4,
                &mut q[run + 4..run + 8],
            );
        }
    }
    (q, scales)
}

/// The 9-bit grid index of iq3_s quadruple `k` (`0..64`).
#[inline(always)]
pub fn iq3_s_index(b: &[u8; IQ3_S_BYTES], k: usize) -> usize {
    usize::from(b[2 + k]) | (usize::from(b[66 + k / 8] >> (k % 8) & 1) << 8)
}

/// The signed quants (`±grid`, in `−15..=15`) of an iq3_s super-block in value order, and
/// the odd sub-block scales `2a + 1` (`1..=31`) of its 8 sub-blocks.
#[inline]
pub fn iq3_s_quants(b: &[u8; IQ3_S_BYTES]) -> ([i8; QK_K], [u8; 8]) {
    let mut q = [0i8; QK_K];
    for k in 0..64 {
        let signs = b[74 + k / 2] >> (4 * (k % 2));
        signed_quad(
            IQ3_S_GRID[iq3_s_index(b, k)],
            signs,
            &mut q[4 * k..4 * k + 4],
        );
    }
    let scales = std::array::from_fn(|s| 2 * (b[106 + s / 2] >> (4 * (s % 2)) & 15) + 1);
    (q, scales)
}

super::wide_decoders! {
    wide_iq3_xxs => decode_iq3_xxs,
    wide_iq3_s => decode_iq3_s,
}

/// The codec of `dtype` if it is one of this module's types (decoding only).
pub fn codec(dtype: DType) -> Option<BlockCodec> {
    let to_f32: fn(&[u8], &mut [f32]) = match dtype {
        DType::IQ3_XXS => wide_iq3_xxs,
        DType::IQ3_S => wide_iq3_s,
        _ => return None,
    };
    Some(BlockCodec {
        to_f32,
        from_f32: None,
    })
}

#[inline(always)]
fn decode_iq3_xxs(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<IQ3_XXS_BYTES>();
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 0);
        let (q, scales) = iq3_xxs_quants(b);
        for ((&a, ys), qs) in scales
            .iter()
            .zip(y.chunks_exact_mut(32))
            .zip(q.chunks_exact(32))
        {
            // The scale as ggml writes it: (d·(0.5 + a))·0.5, with a = (2a + 1 − 1)/2.
            let db = d * (0.5 + f32::from(a >> 1)) * 0.5;
            for (out, &qv) in ys.iter_mut().zip(qs) {
                *out = db * f32::from(qv);
            }
        }
    }
}

#[inline(always)]
fn decode_iq3_s(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<IQ3_S_BYTES>();
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 0);
        let (q, scales) = iq3_s_quants(b);
        for ((&ls, ys), qs) in scales
            .iter()
            .zip(y.chunks_exact_mut(32))
            .zip(q.chunks_exact(32))
        {
            let db = d * f32::from(ls);
            for (out, &qv) in ys.iter_mut().zip(qs) {
                *out = db * f32::from(qv);
            }
        }
    }
}
