//! Block-quantized storage formats: Q8_0 and Q4_0 here (scalar reference implementations);
//! ggml's other block types in [`legacy`] (q4_1, q5_0, q5_1, q8_1, iq4_nl) and [`kquants`]
//! (the K-quants with super-blocks of 256, q8_K and iq4_xs), reached through [`codec`].
//!
//! Both formats cut a row of `f32` values into blocks of 32 and store, per block, one `f16`
//! scale `d` plus 32 small integers `q`, so that each value is approximated by `q·d`.
//!
//! * **Q8_0** ([`BlockQ8_0`], 34 bytes per 32 values): `d = max|x| / 127` and
//!   `q = round(x / d)` (ties away from zero), `q` in `-127..=127` stored as `i8`.
//! * **Q4_0** ([`BlockQ4_0`], 18 bytes per 32 values): `d = m / -8` where `m` is the value of
//!   largest magnitude *with its sign* (the first one if several tie), and
//!   `q = min(7, floor(x / d + 0.5))`, `q` in `-8..=7`, stored as the nibble `q + 8`. Value `j`
//!   of the block (`j < 16`) sits in the low nibble of byte `j`, value `j + 16` in its high
//!   nibble. Because `d` carries the opposite sign of `m`, `m` itself maps to `q = -8` exactly and
//!   the asymmetric range `-8..=7` is used to its full width.
//!
//! The scale is computed in `f32` and only *stored* as `f16` (rounded to nearest even); the
//! integers are computed with the `f32` scale. Decoding multiplies by the stored `f16` scale.
//! These are the same arithmetic rules as ggml's reference quantizers, so the bytes produced
//! here match ggml's `q8_0` / `q4_0` tensors bit for bit on finite input. That includes an
//! all-zero Q4_0 block, whose scale is `0 / -8 = -0.0` (stored bits `0x8000`); ports that pick
//! the maximum by index (such as gguf-py's numpy quantizer) may store `+0.0` there instead,
//! which decodes identically. Non-finite input is accepted without panicking, but the bytes it
//! produces are unspecified.
//!
//! # Error bound
//!
//! Write `d` for the `f32` scale of a block and `d̃` for its stored `f16` value. For every
//! finite value `x` of the block and its decoded value `x̂`:
//!
//! * Q8_0: `|x − x̂| ≤ |d|/2 + 127·|d − d̃|`, plus `f32` rounding below `1e-4·(|d| + |d̃|)`.
//!   Rounding to the nearest multiple of `d` loses at most `d/2`; storing the scale in `f16`
//!   moves `q·d` by `|q|·|d − d̃|` with `|q| ≤ 127`.
//! * Q4_0: `|x − x̂| ≤ |d| + 8·|d − d̃|`, plus the same `f32` slack. Values with `x/d < 7.5`
//!   round to the nearest step (error `≤ |d|/2`); values of the opposite sign to `m` with
//!   `x/d ≥ 7.5` are clamped to `q = 7`, an error of up to one full step (reached when the block
//!   holds both `m` and `−m`).
//!
//! For a normal `f16` scale `|d − d̃| ≤ 2⁻¹¹·|d|`, so the bounds are about `0.563·|d|` and
//! `1.004·|d|`. The unit tests check these bounds on random blocks.

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::dtype::DType;
use crate::error::{Error, Result};

pub mod iq1;
pub mod iq2;
pub mod iq3;
pub mod kquants;
pub mod legacy;
pub mod lowbit;

/// The little-endian `f16` at byte `at` of a block, widened exactly to `f32` (blocks may sit
/// at any alignment, so the scale is read byte by byte).
#[inline(always)]
pub fn f16_at(block: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([block[at], block[at + 1]])).to_f32()
}

/// Values per super-block of the K-quants (q2_K..q8_K, iq4_xs).
pub const QK_K: usize = 256;

/// Defines decoders `fn $wide(src: &[u8], dst: &mut [f32])` that run the same Rust code as
/// `$body` — compiled a second time with AVX2, FMA and F16C enabled on x86-64 CPUs that have
/// them (chosen at run time), else as is. The bodies are integer unpacking and single f32
/// multiplications and additions (Rust never contracts those into FMAs), so both copies give
/// the same bits; the wide one lets LLVM vectorize the unpacking 256 bits at a time. Prompts
/// decode every weight tile of a product with three or more columns through these: a SmolLM2
/// requantized to Q4_K_M (mostly q5_0) spent a fifth of its prefill in the baseline decoders.
macro_rules! wide_decoders {
    ($($wide:ident => $body:path),* $(,)?) => {
        $(
            fn $wide(src: &[u8], dst: &mut [f32]) {
                #[cfg(target_arch = "x86_64")]
                {
                    #[target_feature(enable = "avx2,fma,f16c")]
                    fn wide(src: &[u8], dst: &mut [f32]) {
                        $body(src, dst)
                    }
                    if crate::isa::get().avx2_fma_f16c() {
                        // SAFETY: this CPU has every feature `wide` is compiled for.
                        return unsafe { wide(src, dst) };
                    }
                }
                $body(src, dst)
            }
        )*
    };
}
pub(crate) use wide_decoders;

/// Encodes f32 values into whole blocks of a type.
pub type EncodeFn = fn(&[f32], &mut [u8]);

/// Byte-level conversions of one block type. Rows are whole blocks laid out as ggml lays them
/// out, at any alignment; callers check lengths (`src.len() == dtype.row_size(dst.len())`).
#[derive(Clone, Copy, Debug)]
pub struct BlockCodec {
    /// Decodes whole blocks to f32.
    pub to_f32: fn(&[u8], &mut [f32]),
    /// Encodes f32 values into whole blocks with ggml's reference quantizer's rules; `None`
    /// for the types ferrograph reads but does not write ([`DType::has_quantizer`]).
    pub from_f32: Option<EncodeFn>,
}

/// The byte codec of a block type other than q8_0/q4_0 (those have typed block structs here),
/// or `None` for a non-block type.
pub fn codec(dtype: DType) -> Option<BlockCodec> {
    legacy::codec(dtype)
        .or_else(|| kquants::codec(dtype))
        .or_else(|| iq2::codec(dtype))
        .or_else(|| iq3::codec(dtype))
        .or_else(|| iq1::codec(dtype))
        .or_else(|| lowbit::codec(dtype))
}

/// Number of values in one [`BlockQ8_0`].
pub const QK8_0: usize = 32;
/// Number of values in one [`BlockQ4_0`].
pub const QK4_0: usize = 32;

/// One Q8_0 block: 32 values as `i8` times a shared `f16` scale (34 bytes, alignment 2).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct BlockQ8_0 {
    /// The scale: value `j` decodes to `qs[j] · d`.
    pub d: f16,
    /// The quantized values, each in `-127..=127`.
    pub qs: [i8; QK8_0],
}

/// One Q4_0 block: 32 values as 4-bit nibbles times a shared `f16` scale (18 bytes,
/// alignment 2).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct BlockQ4_0 {
    /// The scale: value `j` decodes to `(nibble_j − 8) · d`.
    pub d: f16,
    /// Packed nibbles: value `j < 16` in the low nibble of `qs[j]`, value `j + 16` in the high
    /// nibble of `qs[j]`; each nibble holds `q + 8` with `q` in `-8..=7`.
    pub qs: [u8; QK4_0 / 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 2 + QK8_0);
const _: () = assert!(std::mem::align_of::<BlockQ8_0>() == 2);
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 2 + QK4_0 / 2);
const _: () = assert!(std::mem::align_of::<BlockQ4_0>() == 2);

/// `v` rounded to the nearest integer, halves away from zero (C's `roundf`), then converted
/// to `i8` saturating (NaN → 0): exactly `v.round() as i8`, without the `roundf` library call
/// the baseline x86-64 target makes for `f32::round` (the truncating conversion and the
/// exact difference `v − trunc(v)` vectorise).
#[inline(always)]
pub fn round_to_i8(v: f32) -> i8 {
    // Saturating, and 0 for NaN (whose comparisons below are false).
    let t = v as i32;
    // Exact: the fraction of a float is representable, and |v| ≥ 2²³ has none.
    let f = v - t as f32;
    let r = t
        .saturating_add(i32::from(f >= 0.5))
        .saturating_sub(i32::from(f <= -0.5));
    r.clamp(i32::from(i8::MIN), i32::from(i8::MAX)) as i8
}

impl BlockQ8_0 {
    /// Quantizes 32 values into one block (reference rounding, see the module docs).
    pub fn quantize(x: &[f32; QK8_0]) -> Self {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; QK8_0];
        for (q, &v) in qs.iter_mut().zip(x) {
            // Halves away from zero, like C's `roundf`; |v·id| ≤ 127 up to rounding, and the
            // conversion saturates anyway.
            *q = round_to_i8(v * id);
        }
        BlockQ8_0 {
            d: f16::from_f32(d),
            qs,
        }
    }

    /// Decodes the block into 32 values.
    pub fn dequantize(&self, y: &mut [f32; QK8_0]) {
        let d = self.d.to_f32();
        for (out, &q) in y.iter_mut().zip(&self.qs) {
            *out = f32::from(q) * d;
        }
    }
}

impl BlockQ4_0 {
    /// Quantizes 32 values into one block (reference rounding, see the module docs).
    pub fn quantize(x: &[f32; QK4_0]) -> Self {
        // The first value of largest magnitude, keeping its sign.
        let mut amax = 0.0f32;
        let mut max = 0.0f32;
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        // x·id lies in [-8, 8] up to rounding, so x·id + 8.5 lies in [0.5, 16.5]; truncating a
        // non-negative number is rounding it down. 16 only happens for x·id ≥ 7.5 and is
        // clamped to 15. The lower clamp only matters for non-finite input.
        let nibble = |v: f32| -> u8 { ((v * id + 8.5) as i8).clamp(0, 15) as u8 };
        let mut qs = [0u8; QK4_0 / 2];
        let (lo, hi) = x.split_at(QK4_0 / 2);
        for ((q, &a), &b) in qs.iter_mut().zip(lo).zip(hi) {
            *q = nibble(a) | (nibble(b) << 4);
        }
        BlockQ4_0 {
            d: f16::from_f32(d),
            qs,
        }
    }

    /// Decodes the block into 32 values.
    pub fn dequantize(&self, y: &mut [f32; QK4_0]) {
        let d = self.d.to_f32();
        let (lo, hi) = y.split_at_mut(QK4_0 / 2);
        for ((&q, a), b) in self.qs.iter().zip(lo).zip(hi) {
            *a = (i32::from(q & 0x0F) - 8) as f32 * d;
            *b = (i32::from(q >> 4) - 8) as f32 * d;
        }
    }
}

/// What the row and byte helpers need to know about a block type.
trait Block: Pod {
    /// Format name for error messages.
    const NAME: &'static str;
    /// Values per block (32 for both formats).
    const QK: usize;
    fn quantize_chunk(x: &[f32]) -> Self;
    fn dequantize_chunk(&self, y: &mut [f32]);
}

impl Block for BlockQ8_0 {
    const NAME: &'static str = "q8_0";
    const QK: usize = QK8_0;
    fn quantize_chunk(x: &[f32]) -> Self {
        Self::quantize(x.try_into().expect("chunk of QK8_0 values"))
    }
    fn dequantize_chunk(&self, y: &mut [f32]) {
        self.dequantize(y.try_into().expect("chunk of QK8_0 values"))
    }
}

impl Block for BlockQ4_0 {
    const NAME: &'static str = "q4_0";
    const QK: usize = QK4_0;
    fn quantize_chunk(x: &[f32]) -> Self {
        Self::quantize(x.try_into().expect("chunk of QK4_0 values"))
    }
    fn dequantize_chunk(&self, y: &mut [f32]) {
        self.dequantize(y.try_into().expect("chunk of QK4_0 values"))
    }
}

/// Checks that `n_values` values fill exactly `n_blocks` blocks of `B`.
fn check_row<B: Block>(n_values: usize, n_blocks: usize) -> Result<()> {
    if !n_values.is_multiple_of(B::QK) {
        return Err(crate::shape_err!(
            "{}: {} values is not a multiple of the block size {}",
            B::NAME,
            n_values,
            B::QK
        ));
    }
    if n_values / B::QK != n_blocks {
        return Err(crate::shape_err!(
            "{}: {} values need {} blocks, but {} blocks were given",
            B::NAME,
            n_values,
            n_values / B::QK,
            n_blocks
        ));
    }
    Ok(())
}

fn quantize_row<B: Block>(x: &[f32], y: &mut [B]) -> Result<()> {
    check_row::<B>(x.len(), y.len())?;
    for (chunk, block) in x.chunks_exact(B::QK).zip(y.iter_mut()) {
        *block = B::quantize_chunk(chunk);
    }
    Ok(())
}

fn dequantize_row<B: Block>(x: &[B], y: &mut [f32]) -> Result<()> {
    check_row::<B>(y.len(), x.len())?;
    for (block, chunk) in x.iter().zip(y.chunks_exact_mut(B::QK)) {
        block.dequantize_chunk(chunk);
    }
    Ok(())
}

/// Checks that `len` bytes are a whole number of `B` blocks.
fn check_byte_len<B: Block>(len: usize) -> Result<()> {
    let size = std::mem::size_of::<B>();
    if !len.is_multiple_of(size) {
        return Err(crate::shape_err!(
            "{}: {} bytes is not a multiple of the block size of {} bytes",
            B::NAME,
            len,
            size
        ));
    }
    Ok(())
}

fn misaligned<B: Block>(addr: usize) -> Error {
    Error::InvalidArgument(format!(
        "{}: byte buffer at address {:#x} is not aligned to {} bytes",
        B::NAME,
        addr,
        std::mem::align_of::<B>()
    ))
}

fn view<B: Block>(bytes: &[u8]) -> Result<&[B]> {
    check_byte_len::<B>(bytes.len())?;
    if bytes.is_empty() {
        // An empty slice's pointer may be dangling and unaligned; there is nothing to view.
        return Ok(&[]);
    }
    let addr = bytes.as_ptr() as usize;
    if !addr.is_multiple_of(std::mem::align_of::<B>()) {
        return Err(misaligned::<B>(addr));
    }
    bytemuck::try_cast_slice(bytes).map_err(|e| {
        Error::InvalidArgument(format!("{}: cannot view bytes as blocks: {e}", B::NAME))
    })
}

fn view_mut<B: Block>(bytes: &mut [u8]) -> Result<&mut [B]> {
    check_byte_len::<B>(bytes.len())?;
    if bytes.is_empty() {
        return Ok(&mut []);
    }
    let addr = bytes.as_ptr() as usize;
    if !addr.is_multiple_of(std::mem::align_of::<B>()) {
        return Err(misaligned::<B>(addr));
    }
    bytemuck::try_cast_slice_mut(bytes).map_err(|e| {
        Error::InvalidArgument(format!("{}: cannot view bytes as blocks: {e}", B::NAME))
    })
}

fn quantize_bytes<B: Block>(x: &[f32]) -> Result<Vec<u8>> {
    let mut blocks = vec![B::zeroed(); x.len() / B::QK];
    quantize_row(x, &mut blocks)?;
    Ok(bytemuck::cast_slice::<B, u8>(&blocks).to_vec())
}

fn dequantize_bytes<B: Block>(bytes: &[u8], n: usize) -> Result<Vec<f32>> {
    check_byte_len::<B>(bytes.len())?;
    let n_blocks = bytes.len() / std::mem::size_of::<B>();
    check_row::<B>(n, n_blocks)?;
    let mut y = vec![0.0f32; n];
    match view::<B>(bytes) {
        Ok(blocks) => dequantize_row(blocks, &mut y)?,
        Err(_) => {
            // Unaligned input (for example a slice into a Python `bytes` object): copy the
            // blocks into properly aligned storage first.
            let mut blocks = vec![B::zeroed(); n_blocks];
            bytemuck::cast_slice_mut::<B, u8>(&mut blocks).copy_from_slice(bytes);
            dequantize_row(&blocks, &mut y)?;
        }
    }
    Ok(y)
}

/// Quantizes `x` into Q8_0 blocks.
///
/// `x.len()` must be a multiple of [`QK8_0`] and equal `y.len() * QK8_0`; otherwise
/// [`Error::Shape`] names both lengths.
pub fn quantize_row_q8_0_ref(x: &[f32], y: &mut [BlockQ8_0]) -> Result<()> {
    quantize_row(x, y)
}

/// Decodes Q8_0 blocks into `y`.
///
/// `y.len()` must be a multiple of [`QK8_0`] and equal `x.len() * QK8_0`; otherwise
/// [`Error::Shape`].
pub fn dequantize_row_q8_0(x: &[BlockQ8_0], y: &mut [f32]) -> Result<()> {
    dequantize_row(x, y)
}

/// Quantizes `x` into Q4_0 blocks.
///
/// `x.len()` must be a multiple of [`QK4_0`] and equal `y.len() * QK4_0`; otherwise
/// [`Error::Shape`] names both lengths.
pub fn quantize_row_q4_0_ref(x: &[f32], y: &mut [BlockQ4_0]) -> Result<()> {
    quantize_row(x, y)
}

/// Decodes Q4_0 blocks into `y`.
///
/// `y.len()` must be a multiple of [`QK4_0`] and equal `x.len() * QK4_0`; otherwise
/// [`Error::Shape`].
pub fn dequantize_row_q4_0(x: &[BlockQ4_0], y: &mut [f32]) -> Result<()> {
    dequantize_row(x, y)
}

/// Views raw bytes as Q8_0 blocks without copying.
///
/// Fails with [`Error::Shape`] if `bytes.len()` is not a multiple of 34 and with
/// [`Error::InvalidArgument`] if the bytes do not start on a 2-byte boundary.
pub fn blocks_q8_0(bytes: &[u8]) -> Result<&[BlockQ8_0]> {
    view(bytes)
}

/// Views raw bytes as mutable Q8_0 blocks without copying (errors as [`blocks_q8_0`]).
pub fn blocks_q8_0_mut(bytes: &mut [u8]) -> Result<&mut [BlockQ8_0]> {
    view_mut(bytes)
}

/// Views raw bytes as Q4_0 blocks without copying.
///
/// Fails with [`Error::Shape`] if `bytes.len()` is not a multiple of 18 and with
/// [`Error::InvalidArgument`] if the bytes do not start on a 2-byte boundary.
pub fn blocks_q4_0(bytes: &[u8]) -> Result<&[BlockQ4_0]> {
    view(bytes)
}

/// Views raw bytes as mutable Q4_0 blocks without copying (errors as [`blocks_q4_0`]).
pub fn blocks_q4_0_mut(bytes: &mut [u8]) -> Result<&mut [BlockQ4_0]> {
    view_mut(bytes)
}

/// Quantizes `x` to Q8_0 and returns the blocks' bytes (`x.len() / 32 * 34` of them).
///
/// `x.len()` must be a multiple of [`QK8_0`], else [`Error::Shape`].
pub fn quantize_q8_0_bytes(x: &[f32]) -> Result<Vec<u8>> {
    quantize_bytes::<BlockQ8_0>(x)
}

/// Decodes `n` values from Q8_0 block bytes.
///
/// `n` must be a multiple of [`QK8_0`] and `bytes.len()` must be `n / 32 * 34`, else
/// [`Error::Shape`]. The bytes need no particular alignment.
pub fn dequantize_q8_0_bytes(bytes: &[u8], n: usize) -> Result<Vec<f32>> {
    dequantize_bytes::<BlockQ8_0>(bytes, n)
}

/// Quantizes `x` to Q4_0 and returns the blocks' bytes (`x.len() / 32 * 18` of them).
///
/// `x.len()` must be a multiple of [`QK4_0`], else [`Error::Shape`].
pub fn quantize_q4_0_bytes(x: &[f32]) -> Result<Vec<u8>> {
    quantize_bytes::<BlockQ4_0>(x)
}

/// Decodes `n` values from Q4_0 block bytes.
///
/// `n` must be a multiple of [`QK4_0`] and `bytes.len()` must be `n / 32 * 18`, else
/// [`Error::Shape`]. The bytes need no particular alignment.
pub fn dequantize_q4_0_bytes(bytes: &[u8], n: usize) -> Result<Vec<f32>> {
    dequantize_bytes::<BlockQ4_0>(bytes, n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The f32 scale the quantizer computes for a Q8_0 block (same operations, same result).
    fn scale_q8_0(x: &[f32]) -> f32 {
        x.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0
    }

    /// The f32 scale the quantizer computes for a Q4_0 block.
    fn scale_q4_0(x: &[f32]) -> f32 {
        let mut amax = 0.0f32;
        let mut max = 0.0f32;
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        max / -8.0
    }

    /// Checks the module-level error bound for every block of `x` against its decoding `y`.
    /// `rounding` is the error in steps allowed by rounding (1/2 for Q8_0, 1 for Q4_0) and
    /// `qmax` the largest |q|.
    fn check_bound(
        x: &[f32],
        y: &[f32],
        d16: &[f16],
        scale: fn(&[f32]) -> f32,
        rounding: f64,
        qmax: f64,
    ) {
        for ((xb, yb), dt) in x.chunks(32).zip(y.chunks(32)).zip(d16) {
            let d = f64::from(scale(xb)).abs();
            let dt = f64::from(dt.to_f32());
            let bound =
                rounding * d + qmax * (d - dt.abs()).abs() + 1e-4 * (d + dt.abs()) + f64::EPSILON;
            for (&a, &b) in xb.iter().zip(yb) {
                let err = (f64::from(a) - f64::from(b)).abs();
                assert!(
                    err <= bound,
                    "value {a} decoded as {b}: error {err} > bound {bound} (d = {d}, d16 = {dt})"
                );
            }
        }
    }

    fn roundtrip_q8_0(x: &[f32]) -> (Vec<BlockQ8_0>, Vec<f32>) {
        let mut blocks = vec![BlockQ8_0::default(); x.len() / 32];
        quantize_row_q8_0_ref(x, &mut blocks).unwrap();
        let mut y = vec![0.0; x.len()];
        dequantize_row_q8_0(&blocks, &mut y).unwrap();
        (blocks, y)
    }

    fn roundtrip_q4_0(x: &[f32]) -> (Vec<BlockQ4_0>, Vec<f32>) {
        let mut blocks = vec![BlockQ4_0::default(); x.len() / 32];
        quantize_row_q4_0_ref(x, &mut blocks).unwrap();
        let mut y = vec![0.0; x.len()];
        dequantize_row_q4_0(&blocks, &mut y).unwrap();
        (blocks, y)
    }

    fn check_q8_0(x: &[f32]) {
        let (blocks, y) = roundtrip_q8_0(x);
        let d16: Vec<f16> = blocks.iter().map(|b| b.d).collect();
        check_bound(x, &y, &d16, scale_q8_0, 0.5, 127.0);
        for b in &blocks {
            assert!(b.qs.iter().all(|&q| q != i8::MIN), "q8_0 never uses -128");
        }
    }

    fn check_q4_0(x: &[f32]) {
        let (blocks, y) = roundtrip_q4_0(x);
        let d16: Vec<f16> = blocks.iter().map(|b| b.d).collect();
        check_bound(x, &y, &d16, scale_q4_0, 1.0, 8.0);
    }

    /// A small deterministic generator so the fixed tests need no randomness.
    fn ramp(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.173 + (i as f32).sin())
            .collect()
    }

    #[test]
    fn block_sizes() {
        assert_eq!(std::mem::size_of::<BlockQ8_0>(), 34);
        assert_eq!(std::mem::size_of::<BlockQ4_0>(), 18);
    }

    #[test]
    fn round_to_i8_is_roundf_then_a_saturating_cast() {
        let mut x = 0x9E37_79B9u32;
        let specials = [
            0.5f32,
            -0.5,
            1.5,
            -1.5,
            2.5,
            0.49999997,
            -0.49999997,
            126.5,
            127.5,
            -127.5,
            -128.5,
            1e9,
            -1e9,
            3e38,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -0.0,
            8388609.0,
        ];
        let randoms = (0..200_000).map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            f32::from_bits(x)
        });
        for v in specials.into_iter().chain(randoms) {
            assert_eq!(round_to_i8(v), v.round() as i8, "{v:e}");
        }
        for i in -300_000..300_000 {
            let v = i as f32 / 1024.0;
            assert_eq!(round_to_i8(v), v.round() as i8, "{v}");
        }
    }

    #[test]
    fn roundtrip_within_bound() {
        let x = ramp(32 * 8);
        check_q8_0(&x);
        check_q4_0(&x);
        let tiny: Vec<f32> = x.iter().map(|v| v * 1e-9).collect();
        check_q8_0(&tiny);
        check_q4_0(&tiny);
        let big: Vec<f32> = x.iter().map(|v| v * 1e4).collect();
        check_q8_0(&big);
        check_q4_0(&big);
    }

    #[test]
    fn all_zero_block() {
        let x = [0.0f32; 32];
        let b8 = BlockQ8_0::quantize(&x);
        assert_eq!(b8, BlockQ8_0::default());
        let b4 = BlockQ4_0::quantize(&x);
        // 0 / -8 is -0.0: the stored scale is the f16 bit pattern 0x8000, as in ggml's C code.
        assert_eq!(b4.d.to_bits(), 0x8000);
        assert_eq!(b4.qs, [0x88; 16], "zero is the nibble 8");
        let mut y = [1.0f32; 32];
        b8.dequantize(&mut y);
        assert_eq!(y, [0.0; 32]);
        let mut y = [1.0f32; 32];
        b4.dequantize(&mut y);
        assert_eq!(y, [0.0; 32]);
    }

    #[test]
    fn single_large_value() {
        let mut x = [0.0f32; 32];
        x[5] = 1000.0;
        let b8 = BlockQ8_0::quantize(&x);
        assert_eq!(b8.d, f16::from_f32(1000.0 / 127.0));
        for (j, &q) in b8.qs.iter().enumerate() {
            assert_eq!(q, if j == 5 { 127 } else { 0 });
        }
        let mut y = [0.0f32; 32];
        b8.dequantize(&mut y);
        assert!((y[5] - 1000.0).abs() <= 127.0 * (1000.0 / 127.0) * 2f32.powi(-11));

        // Q4_0: d = 1000 / -8 = -125 (exact in f16), the large value is nibble 0.
        let b4 = BlockQ4_0::quantize(&x);
        assert_eq!(b4.d, f16::from_f32(-125.0));
        assert_eq!(b4.qs[5], 0x80);
        let mut y = [0.0f32; 32];
        b4.dequantize(&mut y);
        let mut expect = [0.0f32; 32];
        expect[5] = 1000.0;
        assert_eq!(y, expect);
    }

    #[test]
    fn q4_0_negative_max() {
        // The value of largest magnitude is negative: the scale is positive.
        let mut x = [0.5f32; 32];
        x[3] = -6.4;
        x[20] = 2.0;
        let b = BlockQ4_0::quantize(&x);
        assert_eq!(b.d, f16::from_f32(0.8));
        assert_eq!(b.qs[3] & 0x0F, 0, "max maps to q = -8");
        let mut y = [0.0f32; 32];
        b.dequantize(&mut y);
        let d = f16::from_f32(0.8).to_f32();
        assert_eq!(y[3], -8.0 * d);
        // 0.5 / 0.8 = 0.625 → q = 1; 2.0 / 0.8 = 2.5 → q = 3 (halves round up).
        assert_eq!(y[0], d);
        assert_eq!(y[20], 3.0 * d);
        check_q4_0(&x);
    }

    #[test]
    fn q4_0_opposite_extremes_use_full_step() {
        // m = -5 comes first, so d = 0.625; +5 is x/d = 8 and clamps to q = 7: one full step.
        let mut x = [0.0f32; 32];
        x[0] = -5.0;
        x[1] = 5.0;
        let b = BlockQ4_0::quantize(&x);
        assert_eq!(b.d, f16::from_f32(0.625));
        assert_eq!(b.qs[0], 0x80);
        assert_eq!(b.qs[1], 0x8F);
        let mut y = [0.0f32; 32];
        b.dequantize(&mut y);
        assert_eq!(y[0], -5.0);
        assert_eq!(y[1], 4.375);
        // With the order swapped, +5 is the max: d = -0.625 and -5 clamps instead.
        x.swap(0, 1);
        let b = BlockQ4_0::quantize(&x);
        assert_eq!(b.d, f16::from_f32(-0.625));
        b.dequantize(&mut y);
        assert_eq!((y[0], y[1]), (5.0, -4.375));
    }

    #[test]
    fn q8_0_known_bytes() {
        // amax = 127 → d = 1 (f16 0x3C00), id = 1. Halves round away from zero.
        let mut x = [0.0f32; 32];
        x[..5].copy_from_slice(&[127.0, -63.5, 0.5, -0.5, 2.49]);
        let bytes = quantize_q8_0_bytes(&x).unwrap();
        let mut expect = vec![0x00, 0x3C, 0x7F, 0xC0, 0x01, 0xFF, 0x02];
        expect.resize(34, 0);
        assert_eq!(bytes, expect);
        let y = dequantize_q8_0_bytes(&bytes, 32).unwrap();
        assert_eq!(&y[..5], &[127.0, -64.0, 1.0, -1.0, 2.0]);
        assert!(y[5..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn q4_0_known_bytes() {
        // max = -8 → d = 1 (f16 0x3C00), id = 1, nibble = min(15, trunc(x + 8.5)).
        let mut x = [0.0f32; 32];
        x[..5].copy_from_slice(&[-8.0, 7.0, 7.9, -0.5, 0.5]);
        x[16] = 3.0;
        x[17] = -3.2;
        // nibbles, low half: 0, 15, 15 (16 clamped), 8, 9, then 8s;
        // high half: 11, 5, then 8s.
        let bytes = quantize_q4_0_bytes(&x).unwrap();
        let mut expect = vec![0x00, 0x3C, 0xB0, 0x5F, 0x8F, 0x88, 0x89];
        expect.resize(18, 0x88);
        assert_eq!(bytes, expect);
        let y = dequantize_q4_0_bytes(&bytes, 32).unwrap();
        assert_eq!(&y[..5], &[-8.0, 7.0, 7.0, 0.0, 1.0]);
        assert_eq!(&y[16..18], &[3.0, -3.0]);
    }

    #[test]
    fn bad_lengths() {
        let x = vec![0.0f32; 64];
        let mut b8 = vec![BlockQ8_0::default(); 1];
        let e = quantize_row_q8_0_ref(&x, &mut b8).unwrap_err();
        assert!(
            matches!(&e, Error::ShapeMismatch { message: m, .. } if m.contains("64") && m.contains('1')),
            "{e}"
        );
        let e = quantize_row_q8_0_ref(&x[..31], &mut b8).unwrap_err();
        assert!(
            matches!(&e, Error::ShapeMismatch { message: m, .. } if m.contains("31") && m.contains("32")),
            "{e}"
        );
        let mut y = vec![0.0f32; 40];
        assert!(matches!(
            dequantize_row_q8_0(&b8, &mut y),
            Err(Error::ShapeMismatch { .. })
        ));
        let mut b4 = vec![BlockQ4_0::default(); 3];
        assert!(matches!(
            quantize_row_q4_0_ref(&x, &mut b4),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            dequantize_row_q4_0(&b4, &mut y[..32]),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            quantize_q8_0_bytes(&x[..33]),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            quantize_q4_0_bytes(&x[..1]),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            dequantize_q8_0_bytes(&[0; 34], 64),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            dequantize_q8_0_bytes(&[0; 35], 32),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            dequantize_q4_0_bytes(&[0; 18], 31),
            Err(Error::ShapeMismatch { .. })
        ));
        // Empty rows are fine.
        assert!(quantize_row_q8_0_ref(&[], &mut []).is_ok());
        assert_eq!(quantize_q4_0_bytes(&[]).unwrap(), Vec::<u8>::new());
        assert_eq!(dequantize_q4_0_bytes(&[], 0).unwrap(), Vec::<f32>::new());
    }

    #[test]
    fn byte_views() {
        // u16 storage guarantees a 2-byte aligned start.
        let mut storage = vec![0u16; 40];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut storage);
        let x = ramp(64);

        let q8 = quantize_q8_0_bytes(&x).unwrap();
        bytes[..68].copy_from_slice(&q8);
        let view = blocks_q8_0(&bytes[..68]).unwrap();
        assert_eq!(view.len(), 2);
        let (blocks, _) = roundtrip_q8_0(&x);
        assert_eq!(view, &blocks[..]);
        blocks_q8_0_mut(&mut bytes[..34]).unwrap()[0].qs[0] = 7;
        assert_eq!(bytes[2], 7);

        assert!(matches!(
            blocks_q8_0(&bytes[..35]),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            blocks_q8_0(&bytes[1..35]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            blocks_q8_0_mut(&mut bytes[1..35]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(blocks_q8_0(&[]).unwrap().is_empty());

        let q4 = quantize_q4_0_bytes(&x).unwrap();
        assert_eq!(q4.len(), 36);
        bytes[..36].copy_from_slice(&q4);
        let (blocks, y) = roundtrip_q4_0(&x);
        assert_eq!(blocks_q4_0(&bytes[..36]).unwrap(), &blocks[..]);
        assert!(blocks_q4_0_mut(&mut bytes[..36]).is_ok());
        assert!(matches!(
            blocks_q4_0(&bytes[..17]),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            blocks_q4_0(&bytes[1..19]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(blocks_q4_0_mut(&mut []).unwrap().is_empty());

        // The byte decoders accept unaligned input by copying.
        bytes[1..37].copy_from_slice(&q4);
        assert_eq!(dequantize_q4_0_bytes(&bytes[1..37], 64).unwrap(), y);
        bytes[1..69].copy_from_slice(&q8);
        let (_, y8) = roundtrip_q8_0(&x);
        assert_eq!(dequantize_q8_0_bytes(&bytes[1..69], 64).unwrap(), y8);
    }

    /// Blocks of 32 values at a random power-of-two scale, from far below f16's normal range
    /// up to where the Q8_0 scale still fits in f16.
    fn scaled_block() -> impl Strategy<Value = Vec<f32>> {
        (prop::collection::vec(-1.0f32..1.0, 32), -40i32..18)
            .prop_map(|(v, e)| v.into_iter().map(|a| a * 2f32.powi(e)).collect())
    }

    proptest! {
        #[test]
        fn prop_roundtrip_bound(blocks in prop::collection::vec(scaled_block(), 1..4)) {
            let x: Vec<f32> = blocks.concat();
            check_q8_0(&x);
            check_q4_0(&x);
        }

        #[test]
        fn prop_bytes_match_blocks(block in scaled_block()) {
            let (b8, y8) = roundtrip_q8_0(&block);
            let q8 = quantize_q8_0_bytes(&block).unwrap();
            prop_assert_eq!(&q8[..], bytemuck::cast_slice::<BlockQ8_0, u8>(&b8));
            prop_assert_eq!(dequantize_q8_0_bytes(&q8, 32).unwrap(), y8);
            let (b4, y4) = roundtrip_q4_0(&block);
            let q4 = quantize_q4_0_bytes(&block).unwrap();
            prop_assert_eq!(&q4[..], bytemuck::cast_slice::<BlockQ4_0, u8>(&b4));
            prop_assert_eq!(dequantize_q4_0_bytes(&q4, 32).unwrap(), y4);
        }

        #[test]
        fn prop_extreme_maps_to_end_of_range(block in scaled_block()) {
            let x: &[f32; 32] = block.as_slice().try_into().unwrap();
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            prop_assume!(amax > 0.0);
            let i = x.iter().position(|v| v.abs() == amax).unwrap();
            let b8 = BlockQ8_0::quantize(x);
            prop_assert_eq!(i32::from(b8.qs[i]).abs(), 127);
            let b4 = BlockQ4_0::quantize(x);
            let nib = if i < 16 { b4.qs[i] & 0x0F } else { b4.qs[i - 16] >> 4 };
            prop_assert_eq!(nib, 0);
        }
    }
}

/// Test support shared by the codec tests (RNG, fixture reader).
#[cfg(test)]
pub(crate) mod test_support;
