//! ggml's ternary-grid quants iq1_s and iq1_m (super-blocks of [`QK_K`] = 256 values):
//! layouts, shared unpacking helpers and the byte decoders. ferrograph reads and multiplies
//! these types but does not write them ([`DType::has_quantizer`] is false).
//!
//! # Layouts
//!
//! Both types cut a super-block into 32 runs of 8 consecutive values. A run is one point of
//! a fixed grid of 2048 vectors with coordinates in `{−1, 0, 1}` (shared by both types; the
//! grid data is generated from the gguf package by `scripts/make_iq3_iq1_tables.py`, see
//! [`IQ1_GRID`]), addressed by an 11-bit index, plus a shift `δ = ±1/8` (ggml's
//! `IQ1S_DELTA` / `IQ1M_DELTA`) applied to every coordinate. Multi-byte fields are
//! little-endian at any alignment.
//!
//! * **iq1_s** (50 bytes): `d: f16`, `qs[32]` (low 8 index bits of run `r`), then 8
//!   little-endian `u16` words `qh[s]`, one per sub-block `s` of 32 values (runs
//!   `4s..4s + 4`). Bits `3l..3l + 3` of `qh[s]` are the top three index bits of run
//!   `4s + l`; bits `12..15` are the sub-block's scale `a`; bit 15 set makes the shift `−1/8`
//!   (else `+1/8`). Value: `dl·(grid + δ)` with `dl = d·(2a + 1)`.
//! * **iq1_m** (56 bytes): `qs[32]` (low 8 index bits of run `r`), `qh[16]` (run `r` reads
//!   the nibble `qh[r / 2] >> 4·(r % 2)`: its low three bits are the top index bits, its bit
//!   3 set makes the run's shift `−1/8`), then 4 little-endian `u16` scale words `w[0..4]`.
//!   Each half sub-block `h` of 16 values (runs `2h`, `2h + 1`) has the 3-bit scale
//!   `a = (w[h / 4] >> 3·(h % 4)) & 7`. The super-block's f16 scale `d` is spread over the
//!   top nibbles of the words: its bits `4k..4k + 4` are bits `12..16` of `w[k]`. Value:
//!   `dl·(grid + δ)` with `dl = d·(2a + 1)`.
//!
//! # Decoding
//!
//! Decoding follows the operation order of ggml's C dequantizers and of gguf-py's numpy
//! ones, which agree: f16 → f32 exactly, `dl = d·(2a + 1)` in f32 (rounded), `grid + δ` in
//! f32 (exact: one of `±1.125`, `±0.875`, `±0.125`), then one rounded f32 multiplication. The
//! unit tests compare every value bit for bit with `gguf.quants.dequantize` on a checked-in
//! fixture (`tests/data/iq3_iq1_blocks.bin`, made by `scripts/make_iq3_iq1_fixtures.py`).
//! Every bit pattern decodes without panicking (non-finite scales decode to non-finite
//! values).

mod grids;
#[cfg(test)]
mod tests;

use half::f16;

use super::{f16_at, BlockCodec, QK_K};
use crate::dtype::DType;
use grids::{IQ1_CODES, IQ1_LEVELS};

/// Bytes of one iq1_s super-block.
pub const IQ1_S_BYTES: usize = 50;
/// Bytes of one iq1_m super-block.
pub const IQ1_M_BYTES: usize = 56;

/// The shift of iq1_s and iq1_m values, in units of the sub-block scale (ggml's
/// `IQ1S_DELTA` and `IQ1M_DELTA`, both 1/8).
pub const IQ1_DELTA: f32 = 0.125;

/// The 2048 points of the iq1 grid: coordinate `j` of point `i` is byte `j` of
/// `IQ1_GRID[i].to_le_bytes()` read as `i8` (−1, 0 or 1).
pub static IQ1_GRID: [u64; 2048] = expand(&IQ1_CODES);

/// Expands packed 2-bit level indices into little-endian i8 octets.
const fn expand(codes: &[u16; 2048]) -> [u64; 2048] {
    let mut out = [0u64; 2048];
    let mut i = 0;
    while i < 2048 {
        let mut j = 0;
        while j < 8 {
            let k = ((codes[i] >> (2 * j)) & 3) as usize;
            // Index 3 never occurs (the unit tests check); read it as 0 anyway.
            let level = if k < 3 { IQ1_LEVELS[k] } else { 0 };
            out[i] |= ((level as u8) as u64) << (8 * j);
            j += 1;
        }
        i += 1;
    }
    out
}

/// The 8 coordinates of iq1 grid point `index` (only its low 11 bits are read).
#[inline(always)]
pub fn iq1_point(index: usize) -> [i8; 8] {
    IQ1_GRID[index & 2047].to_le_bytes().map(|v| v as i8)
}

/// An iq1_s super-block unpacked: grid coordinates in value order, the odd sub-block scales
/// `2a + 1` (`1..=15`) and whether each sub-block's shift is negative.
#[inline]
pub fn iq1_s_parts(b: &[u8; IQ1_S_BYTES]) -> ([i8; QK_K], [u8; 8], [bool; 8]) {
    let mut q = [0i8; QK_K];
    let mut scales = [0u8; 8];
    let mut neg = [false; 8];
    for s in 0..8 {
        let h = u16::from_le_bytes([b[34 + 2 * s], b[35 + 2 * s]]);
        scales[s] = 2 * ((h >> 12) & 7) as u8 + 1;
        neg[s] = h & 0x8000 != 0;
        for l in 0..4 {
            let r = 4 * s + l;
            let index = usize::from(b[2 + r]) | (usize::from(h >> (3 * l) & 7) << 8);
            q[8 * r..8 * r + 8].copy_from_slice(&iq1_point(index));
        }
    }
    (q, scales, neg)
}

/// The f16 super-block scale of an iq1_m block, gathered from the top nibbles of its scale
/// words.
#[inline(always)]
pub fn iq1_m_scale(b: &[u8; IQ1_M_BYTES]) -> f16 {
    let bits = (0..4).fold(0u16, |acc, k| {
        acc | (u16::from(b[49 + 2 * k] >> 4) << (4 * k))
    });
    f16::from_bits(bits)
}

/// An iq1_m super-block unpacked: grid coordinates in value order, the odd scales `2a + 1`
/// (`1..=15`) of its 16 half sub-blocks, and whether each run's shift is negative.
#[inline]
pub fn iq1_m_parts(b: &[u8; IQ1_M_BYTES]) -> ([i8; QK_K], [u8; 16], [bool; 32]) {
    let mut q = [0i8; QK_K];
    let mut neg = [false; 32];
    for r in 0..32 {
        let nib = b[32 + r / 2] >> (4 * (r % 2));
        neg[r] = nib & 8 != 0;
        let index = usize::from(b[r]) | (usize::from(nib & 7) << 8);
        q[8 * r..8 * r + 8].copy_from_slice(&iq1_point(index));
    }
    let scales = std::array::from_fn(|h| {
        let w = u16::from_le_bytes([b[48 + 2 * (h / 4)], b[49 + 2 * (h / 4)]]);
        2 * ((w >> (3 * (h % 4))) & 7) as u8 + 1
    });
    (q, scales, neg)
}

super::wide_decoders! {
    wide_iq1_s => decode_iq1_s,
    wide_iq1_m => decode_iq1_m,
}

/// The codec of `dtype` if it is one of this module's types (decoding only).
pub fn codec(dtype: DType) -> Option<BlockCodec> {
    let to_f32: fn(&[u8], &mut [f32]) = match dtype {
        DType::IQ1_S => wide_iq1_s,
        DType::IQ1_M => wide_iq1_m,
        _ => return None,
    };
    Some(BlockCodec {
        to_f32,
        from_f32: None,
    })
}

/// `grid + δ` for one coordinate (exact).
#[inline(always)]
fn shifted(g: i8, neg: bool) -> f32 {
    f32::from(g) + if neg { -IQ1_DELTA } else { IQ1_DELTA }
}

#[inline(always)]
fn decode_iq1_s(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<IQ1_S_BYTES>();
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 0);
        let (q, scales, neg) = iq1_s_parts(b);
        for (s, (ys, qs)) in y.chunks_exact_mut(32).zip(q.chunks_exact(32)).enumerate() {
            let dl = d * f32::from(scales[s]);
            for (out, &g) in ys.iter_mut().zip(qs) {
                *out = dl * shifted(g, neg[s]);
            }
        }
    }
}

#[inline(always)]
fn decode_iq1_m(src: &[u8], dst: &mut [f32]) {
    let (blocks, _) = src.as_chunks::<IQ1_M_BYTES>();
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = iq1_m_scale(b).to_f32();
        let (q, scales, neg) = iq1_m_parts(b);
        for (r, (ys, qs)) in y.chunks_exact_mut(8).zip(q.chunks_exact(8)).enumerate() {
            let dl = d * f32::from(scales[r / 2]);
            for (out, &g) in ys.iter_mut().zip(qs) {
                *out = dl * shifted(g, neg[r]);
            }
        }
    }
}
