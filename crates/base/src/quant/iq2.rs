//! ggml's 2-bit i-quants: iq2_xxs, iq2_xs and iq2_s. Read-only codecs (decoding to f32);
//! like ggml's CPU backend, ferrograph does not quantize to them ([`DType::has_quantizer`]).
//!
//! # The shared idea
//!
//! A super-block holds [`QK_K`] = 256 values and starts with an f16 scale `d` (bytes 0..2,
//! little-endian; all fields may sit at any alignment). The values come in runs of 8, each
//! run being one point of a fixed lattice (the tables of [`grids`]: 8 magnitudes, each 8, 25
//! or 43) with 8 sign bits. Every run of 16 values has a 4-bit scale `s`, and value `v`
//! decodes to
//!
//! ```text
//! x_v = db · (±m_v)   with   db = d·(0.5 + s)·0.25
//! ```
//!
//! where `m_v` is the lattice magnitude, the sign is minus when the run's sign bit `v % 8` is
//! set, and `db` is evaluated in f32 exactly in that order (`d` converted from f16 exactly,
//! then `d·(0.5 + s)` rounded, then `·0.25` rounded; each product rounded on its own, no
//! fused multiply-add). `db·(−m)` and `−(db·m)` are the same bits (rounding is symmetric), so
//! this is bit for bit ggml's and gguf-py's `db·grid·sign`.
//!
//! # Layouts
//!
//! Run `r` (0..32) covers values `8r..8r + 8`; 32-value sub-block `k = r / 4` (0..8); the
//! 16-value scale group of value `v` is `v / 16`.
//!
//! * **iq2_xxs** (66 bytes): `d`, then per sub-block `k` eight bytes at `2 + 8k`: four lattice
//!   indices (bytes, one per run `4k + l`, table of 256 points), then a little-endian u32 `w`
//!   holding four 7-bit sign indices (`(w >> 7l) & 127` for run `4k + l`) and, in its top four
//!   bits (`w >> 28`), the scale of both 16-value groups of the sub-block.
//! * **iq2_xs** (74 bytes): `d`, then 32 little-endian u16 `q_r` at `2 + 2r`: the lattice index
//!   is `q_r & 511` (table of 512 points), the 7-bit sign index `q_r >> 9`; then 8 scale bytes
//!   at `66 + k`: the low nibble scales values `32k..32k + 16`, the high nibble the next 16.
//! * **iq2_s** (82 bytes): `d`, 32 index bytes at `2 + r`, 32 sign bytes at `34 + r` (the 8 sign
//!   bits of run `r` directly, bit `j` for value `8r + j`), 8 bytes `qh` at `66 + k` whose bits
//!   `2l..2l + 2` are the top two bits of the 10-bit lattice index of run `4k + l` (table of
//!   1024 points), and 8 scale bytes at `74 + k` (nibbles as iq2_xs).
//!
//! A 7-bit sign index `i` stands for the sign byte `i | (parity(i) << 7)` ([`sign_byte`],
//! ggml's `ksigns_iq2xs`): the eighth sign makes the number of minus signs of a run even.
//!
//! # Decoding
//!
//! Every bit pattern decodes without panicking (a NaN or infinite `d` gives NaN or infinite
//! values). The unit tests compare every value bit for bit with `gguf.quants.dequantize` on a
//! checked-in fixture (`tests/data/iq2_blocks.bin`, made by `scripts/make_iq2_fixtures.py`
//! from random super-blocks with finite scales of every kind).

pub mod grids;
#[cfg(test)]
mod tests;

use super::{f16_at, BlockCodec, QK_K};
use crate::dtype::DType;
use grids::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID};

/// Bytes of one iq2_xxs super-block.
pub const IQ2_XXS_BYTES: usize = 66;
/// Bytes of one iq2_xs super-block.
pub const IQ2_XS_BYTES: usize = 74;
/// Bytes of one iq2_s super-block.
pub const IQ2_S_BYTES: usize = 82;

/// The three magnitudes a lattice point's bytes take, ascending.
pub const GRID_LEVELS: [u8; 3] = [8, 25, 43];

super::wide_decoders! {
    wide_iq2_xxs => decode_iq2_xxs,
    wide_iq2_xs => decode_iq2_xs,
    wide_iq2_s => decode_iq2_s,
}

/// The codec of `dtype` if it is one of this module's types (decoding only).
pub fn codec(dtype: DType) -> Option<BlockCodec> {
    let to_f32: fn(&[u8], &mut [f32]) = match dtype {
        DType::IQ2_XXS => wide_iq2_xxs,
        DType::IQ2_XS => wide_iq2_xs,
        DType::IQ2_S => wide_iq2_s,
        _ => return None,
    };
    Some(BlockCodec {
        to_f32,
        from_f32: None,
    })
}

/// The sign byte of 7-bit sign index `index` (bits above the seventh are ignored): the seven
/// bits themselves plus, as bit 7, their parity, so every sign byte has an even number of set
/// bits (ggml's `ksigns_iq2xs`, computed rather than stored).
#[inline(always)]
pub const fn sign_byte(index: u32) -> u8 {
    let low = (index & 0x7F) as u8;
    low | (((low.count_ones() & 1) as u8) << 7)
}

/// One super-block of any of the three types, unpacked: the signed lattice values
/// (`±8`, `±25`, `±43`) in value order and the 16 four-bit scales (value `v` uses
/// `scales[v / 16]`). Decoding and the portable dot products both start from this.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unpacked {
    /// Value `v`'s signed lattice magnitude.
    pub values: [i8; QK_K],
    /// The 4-bit scale (`0..=15`) of each run of 16 values.
    pub scales: [u8; 16],
}

/// Writes run `r` (values `8r..8r + 8`) of `out` from a lattice point and its sign byte.
#[inline(always)]
fn put_run(out: &mut [i8; QK_K], r: usize, point: u64, signs: u8) {
    for (j, o) in out[8 * r..8 * r + 8].iter_mut().enumerate() {
        // Magnitudes are at most 43, so both the value and its negation fit in an i8.
        let m = (point >> (8 * j)) as u8 as i8;
        *o = if (signs >> j) & 1 != 0 { -m } else { m };
    }
}

/// The little-endian u32 at byte `at` of `b`.
#[inline(always)]
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Unpacks one iq2_xxs super-block (`b` holds at least [`IQ2_XXS_BYTES`] bytes).
#[inline]
pub fn unpack_iq2_xxs(b: &[u8]) -> Unpacked {
    let mut values = [0i8; QK_K];
    let mut scales = [0u8; 16];
    for k in 0..8 {
        let w = u32_at(b, 6 + 8 * k);
        let s = (w >> 28) as u8;
        scales[2 * k] = s;
        scales[2 * k + 1] = s;
        for l in 0..4 {
            let point = IQ2XXS_GRID[usize::from(b[2 + 8 * k + l])];
            put_run(&mut values, 4 * k + l, point, sign_byte(w >> (7 * l)));
        }
    }
    Unpacked { values, scales }
}

/// Splits 8 scale bytes into their 16 nibbles (low nibble first).
#[inline(always)]
fn nibbles(s: &[u8]) -> [u8; 16] {
    std::array::from_fn(|g| (s[g / 2] >> (4 * (g % 2))) & 15)
}

/// Unpacks one iq2_xs super-block (`b` holds at least [`IQ2_XS_BYTES`] bytes).
#[inline]
pub fn unpack_iq2_xs(b: &[u8]) -> Unpacked {
    let mut values = [0i8; QK_K];
    for r in 0..32 {
        let q = u16::from_le_bytes([b[2 + 2 * r], b[3 + 2 * r]]);
        let point = IQ2XS_GRID[usize::from(q & 511)];
        put_run(&mut values, r, point, sign_byte(u32::from(q >> 9)));
    }
    Unpacked {
        values,
        scales: nibbles(&b[66..74]),
    }
}

/// Unpacks one iq2_s super-block (`b` holds at least [`IQ2_S_BYTES`] bytes).
#[inline]
pub fn unpack_iq2_s(b: &[u8]) -> Unpacked {
    let mut values = [0i8; QK_K];
    for r in 0..32 {
        let high = (b[66 + r / 4] >> (2 * (r % 4))) & 3;
        let index = usize::from(b[2 + r]) | (usize::from(high) << 8);
        put_run(&mut values, r, IQ2S_GRID[index], b[34 + r]);
    }
    Unpacked {
        values,
        scales: nibbles(&b[74..82]),
    }
}

/// Decodes whole super-blocks of `BYTES` bytes with `unpack`.
#[inline(always)]
fn decode_with<const BYTES: usize>(src: &[u8], dst: &mut [f32], unpack: fn(&[u8]) -> Unpacked) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 0);
        let u = unpack(b);
        for ((&s, ys), vs) in u
            .scales
            .iter()
            .zip(y.chunks_exact_mut(16))
            .zip(u.values.chunks_exact(16))
        {
            let db = d * (0.5 + f32::from(s)) * 0.25;
            for (out, &v) in ys.iter_mut().zip(vs) {
                *out = db * f32::from(v);
            }
        }
    }
}

#[inline(always)]
fn decode_iq2_xxs(src: &[u8], dst: &mut [f32]) {
    decode_with::<IQ2_XXS_BYTES>(src, dst, unpack_iq2_xxs);
}

#[inline(always)]
fn decode_iq2_xs(src: &[u8], dst: &mut [f32]) {
    decode_with::<IQ2_XS_BYTES>(src, dst, unpack_iq2_xs);
}

#[inline(always)]
fn decode_iq2_s(src: &[u8], dst: &mut [f32]) {
    decode_with::<IQ2_S_BYTES>(src, dst, unpack_iq2_s);
}
