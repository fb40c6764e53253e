//! Weights with minimums or with scales per 16 values on the integer GEMM: q4_1, q5_1, the
//! K-quants (q2_K, q3_K, q4_K, q5_K, q6_K), iq2_xs, iq2_s, nvfp4 and iq1_s.
//!
//! Every value of these types is `scale(g) · q + min(g)` for a small integer `q` and a group
//! `g` of 16 values (q2_K, q3_K, q6_K, iq2_xs, iq2_s, nvfp4) or 32 (q4_1, q5_1, q4_K, q5_K,
//! iq1_s, whose minimum is its scale times its ±1/8 shift),
//! where the scale and the minimum are an f16 (q4_1, q5_1: `d`, `m`), a product of an f16 and
//! an integer below 256 (the K-quants: `d · sc(g)`, `−dmin · m(g)`; iq2_xs / iq2_s:
//! `d · (2s + 1) / 8`, as their decoder computes it) or half an E4M3 byte (nvfp4) — exact in
//! f32. So a block of 32 values is
//! 32 signed bytes with a scale and a minimum per half of 16 ([`Decoded`]), and a product
//! row · activation block is
//!
//! `Σ_h  scale(h) · da · Σ_{j ∈ h} q_j · qa_j  +  min(h) · (da · Σ_{j ∈ h} qa_j)`
//!
//! with the activations quantized to q8_0 (`da`, `qa`) as for the other weight types. The
//! packed block keeps the parent's quant lines (so its transposing packer and its `vpdpbusd`
//! inner loop serve unchanged) and adds a scale, an offset correction and a minimum per half;
//! the prepared activation rows carry each half's `da · Σ qa` after their scales.
//!
//! Each term is paid only where the type has it ([`AffineType::halves`],
//! [`AffineType::mins`]): q4_1, q5_1, q4_K and q5_K share one scale and one minimum over a
//! block of 32, q3_K and q6_K have no minimums. Arithmetic (identical on every path and for every task split). For output
//! element `(i, j)`: `acc = 0`, then for blocks `b` in ascending order, with `isum` exact
//! integer sums (at most 32 · 128 · 127 in magnitude, exact in f32) and `ds` the activation
//! sums `da · (Σ qa as f32)` rounded once:
//! - scales per 32: `acc = fma(isum(b) as f32, scale(b) · da(b), acc)`, then with minimums
//!   `acc = fma(min(b), ds(b), acc)`;
//! - scales per 16: for halves `h = 0, 1`,
//!   `acc = fma(isum(b, h) as f32, scale(b, h) · da(b), acc)`, then with minimums
//!   `acc = fma(min(b, 0), ds(b, 0), acc)`, `acc = fma(min(b, 1), ds(b, 1), acc)`.
//!   (Each half is added as soon as its integer sum is complete: holding both halves' sums
//!   for six columns would need more than the 32 vector registers.)
//!
//! Only the AVX-512 VNNI kernel and the portable one (the reference) exist: on CPUs without
//! VNNI, these products keep decoding f32 tiles.

use super::{Isa, Line, PANEL, QK, STEPS};
use crate::dtype::DType;
use crate::kernels::quant_dot::f16_bits_to_f32;
use crate::quant::iq1::{iq1_s_parts, IQ1_DELTA, IQ1_S_BYTES};
use crate::quant::iq2::{unpack_iq2_s, unpack_iq2_xs};
use crate::quant::kquants::{
    k4_scales_mins, q3_k_quants, q3_k_scales, q5_k_quants, q6_k_quants, unpack_2bit, unpack_4bit,
};
use crate::quant::legacy::unpack_nibbles;
use crate::quant::lowbit::{nvfp4_levels, ue4m3_half, QK_NVFP4};
use crate::quant::QK_K;

/// Lines per packed block: the parent's 8 steps × 2 vectors of quants, then per (half,
/// vector) a line of scales, a line of offset corrections and a line of minimums (types with
/// one scale per 32 use the first half's lines for the whole block).
pub(super) const BLOCK_LINES: usize = STEPS * 2 + 12;
/// Byte offset of the scales (line `2 h + v`) inside a packed block.
const SCALES_AT: usize = STEPS * 2 * 64;
/// Byte offset of the offset corrections inside a packed block.
const COMP_AT: usize = SCALES_AT + 4 * 64;
/// Byte offset of the minimums inside a packed block.
const MINS_AT: usize = COMP_AT + 4 * 64;
/// Bytes of one packed block.
const PACKED_BLOCK: usize = BLOCK_LINES * 64;

/// The weight types of this module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AffineType {
    /// q4_1: 4-bit values with an f16 scale and minimum per 32.
    Q4_1,
    /// q5_1: 5-bit values with an f16 scale and minimum per 32.
    Q5_1,
    /// q2_K: 2-bit values with a 4-bit scale and minimum per 16.
    Q2K,
    /// q3_K: 3-bit signed values with a 6-bit scale per 16.
    Q3K,
    /// q4_K: 4-bit values with a 6-bit scale and minimum per 32.
    Q4K,
    /// q5_K: 5-bit values with a 6-bit scale and minimum per 32.
    Q5K,
    /// q6_K: 6-bit signed values with an 8-bit scale per 16.
    Q6K,
    /// iq2_xs: signed lattice points with a 4-bit scale per 16.
    Iq2Xs,
    /// iq2_s: signed lattice points with a 4-bit scale per 16.
    Iq2S,
    /// nvfp4: doubled FP4 levels with an E4M3 scale per 16 (blocks of 64).
    Nvfp4,
    /// iq1_s: grid points (−1, 0, 1) with a 3-bit scale and a ±1/8 shift per 32.
    Iq1S,
}

impl AffineType {
    /// Every type of this module.
    const ALL: [AffineType; 11] = [
        AffineType::Q4_1,
        AffineType::Q5_1,
        AffineType::Q2K,
        AffineType::Q3K,
        AffineType::Q4K,
        AffineType::Q5K,
        AffineType::Q6K,
        AffineType::Iq2Xs,
        AffineType::Iq2S,
        AffineType::Nvfp4,
        AffineType::Iq1S,
    ];

    /// The weight type.
    const fn dtype(self) -> DType {
        match self {
            AffineType::Q4_1 => DType::Q4_1,
            AffineType::Q5_1 => DType::Q5_1,
            AffineType::Q2K => DType::Q2_K,
            AffineType::Q3K => DType::Q3_K,
            AffineType::Q4K => DType::Q4_K,
            AffineType::Q5K => DType::Q5_K,
            AffineType::Q6K => DType::Q6_K,
            AffineType::Iq2Xs => DType::IQ2_XS,
            AffineType::Iq2S => DType::IQ2_S,
            AffineType::Nvfp4 => DType::NVFP4,
            AffineType::Iq1S => DType::IQ1_S,
        }
    }

    /// The type of `dtype`, if it is one of this module's.
    pub(crate) fn of(dtype: DType) -> Option<AffineType> {
        AffineType::ALL.into_iter().find(|t| t.dtype() == dtype)
    }

    /// Whether the scales come per 16 values (else one per block of 32).
    pub(super) fn halves(self) -> bool {
        matches!(
            self,
            AffineType::Q2K
                | AffineType::Q3K
                | AffineType::Q6K
                | AffineType::Iq2Xs
                | AffineType::Iq2S
                | AffineType::Nvfp4
        )
    }

    /// Whether the values have minimums.
    pub(super) fn mins(self) -> bool {
        !matches!(
            self,
            AffineType::Q3K
                | AffineType::Q6K
                | AffineType::Iq2Xs
                | AffineType::Iq2S
                | AffineType::Nvfp4
        )
    }

    /// Blocks of 32 per stored block (a super-block of 256, nvfp4's 64, or one block).
    fn blocks(self) -> usize {
        self.dtype().block_size() / QK
    }

    /// Bytes of one stored block.
    fn bytes(self) -> usize {
        self.dtype().type_size()
    }
}

/// One stored block as integers: value `j` is `scale[j / 16] · q[j] + min[j / 16]` (the
/// first 32 values for q4_1 / q5_1).
#[derive(Clone, Copy)]
pub(super) struct Decoded {
    q: [i8; QK_K],
    scale: [f32; 16],
    min: [f32; 16],
}

impl Decoded {
    const ZERO: Decoded = Decoded {
        q: [0; QK_K],
        scale: [0.0; 16],
        min: [0.0; 16],
    };
}

/// The f16 at byte `at` of `b`, widened.
#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Decodes the super-block `sb` of type `kt` into `out` (the definition of [`Decoded`]).
#[inline(always)]
fn decode(kt: AffineType, sb: &[u8], out: &mut Decoded) {
    decode_scales(kt, sb, out);
    match kt {
        AffineType::Q4_1 => widen(&unpack_nibbles(&sb[4..20], None), &mut out.q),
        AffineType::Q5_1 => {
            let qh = u32::from_le_bytes(sb[4..8].try_into().expect("4 bytes"));
            widen(&unpack_nibbles(&sb[8..24], Some(qh)), &mut out.q);
        }
        AffineType::Q2K => widen(&unpack_2bit(&sb[16..80]), &mut out.q),
        AffineType::Q3K => out.q = q3_k_quants(&sb[0..32], &sb[32..96]),
        AffineType::Q4K => widen(&unpack_4bit(&sb[16..144]), &mut out.q),
        AffineType::Q5K => widen(&q5_k_quants(&sb[16..48], &sb[48..176]), &mut out.q),
        AffineType::Q6K => out.q = q6_k_quants(&sb[0..128], &sb[128..192]),
        AffineType::Iq2Xs => out.q = unpack_iq2_xs(sb).values,
        AffineType::Iq2S => out.q = unpack_iq2_s(sb).values,
        AffineType::Nvfp4 => out.q[..QK_NVFP4].copy_from_slice(&nvfp4_levels(&sb[4..36])),
        AffineType::Iq1S => {
            out.q = iq1_s_parts(sb[..IQ1_S_BYTES].try_into().expect("a block")).0;
        }
    }
}

/// Small unsigned values as signed bytes (the first `q.len()` of `out`).
#[inline(always)]
fn widen(q: &[u8], out: &mut [i8; QK_K]) {
    for (o, &v) in out.iter_mut().zip(q) {
        *o = v as i8;
    }
}

/// Sets group `g`'s scale and minimum to `f(g)` for every group of 16.
#[inline(always)]
fn set_groups(out: &mut Decoded, f: impl Fn(usize) -> (f32, f32)) {
    for (g, (scale, min)) in out.scale.iter_mut().zip(&mut out.min).enumerate() {
        (*scale, *min) = f(g);
    }
}

/// The scales and minimums of [`decode`].
#[inline(always)]
fn decode_scales(kt: AffineType, sb: &[u8], out: &mut Decoded) {
    match kt {
        AffineType::Q4_1 | AffineType::Q5_1 => {
            let (d, m) = (f16_at(sb, 0), f16_at(sb, 2));
            set_groups(out, |_| (d, m));
        }
        AffineType::Q2K => {
            let (d, dmin) = (f16_at(sb, 80), f16_at(sb, 82));
            set_groups(out, |g| {
                (d * f32::from(sb[g] & 15), -(dmin * f32::from(sb[g] >> 4)))
            });
        }
        AffineType::Q3K => {
            let sc = q3_k_scales(&sb[96..108]);
            let d = f16_at(sb, 108);
            set_groups(out, |g| (d * f32::from(sc[g]), 0.0));
        }
        AffineType::Q4K | AffineType::Q5K => {
            let (d, dmin) = (f16_at(sb, 0), f16_at(sb, 2));
            let (sc, m) = k4_scales_mins(&sb[4..16]);
            set_groups(out, |g| {
                (d * f32::from(sc[g / 2]), -(dmin * f32::from(m[g / 2])))
            });
        }
        AffineType::Q6K => {
            let d = f16_at(sb, 208);
            set_groups(out, |g| (d * f32::from(sb[192 + g] as i8), 0.0));
        }
        AffineType::Iq2Xs | AffineType::Iq2S => {
            // as the decoder: (d · (0.5 + s)) · 0.25, exact (an f16 times an odd number
            // below 32, over 8)
            let d = f16_at(sb, 0);
            let at = if kt == AffineType::Iq2Xs { 66 } else { 74 };
            set_groups(out, |g| {
                let s = (sb[at + g / 2] >> (4 * (g % 2))) & 15;
                (d * (0.5 + f32::from(s)) * 0.25, 0.0)
            });
        }
        AffineType::Iq1S => {
            // `d · (2a + 1)` and that times ±1/8, both exact: `dl · (q ± 1/8)` as the decoder
            // computes it is `dl · q + dl · (±1/8)` without rounding (q in −1..=1)
            let d = f16_at(sb, 0);
            set_groups(out, |g| {
                let h = u16::from_le_bytes([sb[34 + g / 2 * 2], sb[35 + g / 2 * 2]]);
                let dl = d * f32::from(2 * ((h >> 12) & 7) + 1);
                let shift = if h & 0x8000 != 0 {
                    -IQ1_DELTA
                } else {
                    IQ1_DELTA
                };
                (dl, dl * shift)
            });
        }
        // four sub-blocks of 16 (the other groups are not read)
        AffineType::Nvfp4 => {
            for (g, &byte) in sb[..4].iter().enumerate() {
                (out.scale[g], out.min[g]) = (ue4m3_half(byte), 0.0);
            }
        }
    }
}

/// Fills the activation sums of a prepared row of `k` elements for weights of `kt` (the
/// parent's layout: `k` offset quants, `k / 32` f32 scales, then two f32 per block): with
/// scales per 16, `da(b) · Σ (quant − 128)` over each half of block `b`; with one per 32, the
/// same over the block, then 0.
pub(super) fn fill_sums(row: &mut [u8], k: usize, kt: AffineType) {
    let nb = k / QK;
    let (quants, rest) = row.split_at_mut(k);
    let (scales, sums) = rest.split_at_mut(4 * nb);
    let part = if kt.halves() { QK / 2 } else { QK };
    for (b, block) in quants[..k].chunks_exact(QK).enumerate() {
        let da = f32::from_ne_bytes(scales[4 * b..][..4].try_into().expect("4 bytes"));
        let mut out = [0f32; 2];
        for (o, q) in out.iter_mut().zip(block.chunks_exact(part)) {
            let isum: i32 = q.iter().map(|&q| i32::from(q) - 128).sum();
            *o = da * isum as f32;
        }
        sums[8 * b..8 * b + 4].copy_from_slice(&out[0].to_ne_bytes());
        sums[8 * b + 4..8 * b + 8].copy_from_slice(&out[1].to_ne_bytes());
    }
}

/// Packs the K-quant rows `rows` (`None` past the matrix's last row) of type `kt` into `out`:
/// `nb` packed blocks of 32 values, with the packer of `isa` (each writes the same bytes).
pub(super) fn pack_panel(
    isa: Isa,
    kt: AffineType,
    rows: &[Option<&[u8]>; PANEL],
    nb: usize,
    out: &mut Vec<Line>,
) {
    assert!(nb.is_multiple_of(kt.blocks()));
    assert!(rows
        .iter()
        .flatten()
        .all(|r| r.len() >= nb / kt.blocks() * kt.bytes()));
    super::reset_panel(out, nb * BLOCK_LINES, rows);
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Vnni512 => DECODED.with(|cell| {
            let mut dec = cell.borrow_mut();
            let dec = dec.get_or_insert_with(|| Box::new([Decoded::ZERO; PANEL]));
            // SAFETY: `Vnni512` is only chosen when the CPU has AVX-512F/BW/VNNI and
            // AVX2/F16C; the sizes were checked above.
            unsafe { x86::pack_panel(kt, rows, nb, out, dec) }
        }),
        _ => pack_panel_portable(kt, rows, nb, out),
    }
}

thread_local! {
    // The SIMD packer's decoded rows, kept between panels (12 KiB: building it per panel
    // was a visible copy in profiles).
    static DECODED: std::cell::RefCell<Option<Box<[Decoded; PANEL]>>> =
        const { std::cell::RefCell::new(None) };
}

/// [`pack_panel`] in portable Rust (the reference): `out` holds `nb` zeroed packed blocks.
fn pack_panel_portable(kt: AffineType, rows: &[Option<&[u8]>; PANEL], nb: usize, out: &mut [Line]) {
    let bytes = super::line_bytes(out);
    let mut dec = Decoded::ZERO;
    for (r, row) in rows.iter().enumerate() {
        let Some(row) = row else {
            continue;
        };
        let (v, lane) = (r / 16, r % 16);
        for (s, sb) in row
            .chunks_exact(kt.bytes())
            .take(nb / kt.blocks())
            .enumerate()
        {
            decode(kt, sb, &mut dec);
            for j in 0..kt.blocks() {
                let blk = &mut bytes[(s * kt.blocks() + j) * PACKED_BLOCK..][..PACKED_BLOCK];
                let w = &dec.q[QK * j..QK * (j + 1)];
                for st in 0..STEPS {
                    let at = (st * 2 + v) * 64 + lane * 4;
                    for t in 0..4 {
                        blk[at + t] = w[4 * st + t] as u8;
                    }
                }
                // one part per half with scales per 16, else one for the block and zeros
                let parts = if kt.halves() { 2 } else { 1 };
                for h in 0..2 {
                    let part = QK / parts;
                    let (sum, scale, min) = if h < parts {
                        let w = &w[part * h..part * (h + 1)];
                        let sum: i32 = w.iter().map(|&x| i32::from(x)).sum();
                        (-128 * sum, dec.scale[2 * j + h], dec.min[2 * j + h])
                    } else {
                        (0, 0.0, 0.0)
                    };
                    let line = (2 * h + v) * 64 + lane * 4;
                    blk[SCALES_AT + line..][..4].copy_from_slice(&scale.to_ne_bytes());
                    blk[COMP_AT + line..][..4].copy_from_slice(&sum.to_ne_bytes());
                    blk[MINS_AT + line..][..4].copy_from_slice(&min.to_ne_bytes());
                }
            }
        }
    }
}

/// The f32 or i32 lane `r` of line `2 h + v` at byte offset `at` of the packed block `blk`.
fn lane(blk: &[Line], at: usize, h: usize, r: usize) -> [u8; 4] {
    let (v, lane) = (r / 16, r % 16);
    let line = at / 64 + 2 * h + v;
    blk[line].0[lane * 4..lane * 4 + 4]
        .try_into()
        .expect("4 bytes")
}

/// The portable micro-kernel: `out[c][r]` for panel row `r` and activation row `acts[c]`.
fn tile_portable(
    kt: AffineType,
    panel: &[Line],
    acts: &[&[u8]],
    k: usize,
    out: &mut [[f32; PANEL]; super::COLS],
) {
    let nb = k / QK;
    let parts = if kt.halves() { 2 } else { 1 };
    for (c, act) in acts.iter().enumerate() {
        let f32_at = |at: usize| f32::from_ne_bytes(act[at..at + 4].try_into().expect("4"));
        for (r, o) in out[c].iter_mut().enumerate() {
            let (v, lane_at) = (r / 16, (r % 16) * 4);
            let mut acc = 0f32;
            for b in 0..nb {
                let blk = &panel[b * BLOCK_LINES..(b + 1) * BLOCK_LINES];
                let da = f32_at(k + 4 * b);
                let mut isum = [0i32; 2];
                for (h, sum) in isum.iter_mut().enumerate().take(parts) {
                    *sum = i32::from_ne_bytes(lane(blk, COMP_AT, h, r));
                    let steps = STEPS / parts;
                    for s in steps * h..steps * (h + 1) {
                        let line = &blk[s * 2 + v].0;
                        for t in 0..4 {
                            let a = i32::from(act[b * QK + 4 * s + t]);
                            *sum += a * i32::from(line[lane_at + t] as i8);
                        }
                    }
                }
                for (h, &sum) in isum.iter().enumerate().take(parts) {
                    let dw = f32::from_ne_bytes(lane(blk, SCALES_AT, h, r));
                    acc = (sum as f32).mul_add(dw * da, acc);
                }
                if kt.mins() {
                    for h in 0..parts {
                        let mn = f32::from_ne_bytes(lane(blk, MINS_AT, h, r));
                        acc = mn.mul_add(f32_at(k + 4 * nb + 4 * (2 * b + h)), acc);
                    }
                }
            }
            *o = acc;
        }
    }
}

/// One micro-tile of weights of `kt` with the kernels of `isa` (`acts.len()` in 1..=COLS;
/// every activation row prepared with its sums, see [`fill_sums`]).
pub(super) fn run_tile(
    kt: AffineType,
    isa: Isa,
    panel: &[Line],
    acts: &[&[u8]],
    k: usize,
    out: &mut [[f32; PANEL]; super::COLS],
) {
    assert!(!acts.is_empty() && acts.len() <= super::COLS);
    assert!(panel.len() >= (k / QK) * BLOCK_LINES);
    assert!(acts.iter().all(|a| a.len() >= super::act_row_bytes(k)));
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Vnni512` is only chosen when the CPU has its features; sizes as above.
        Isa::Vnni512 => unsafe { x86::tile_vnni512(kt, panel, acts, k, out) },
        _ => tile_portable(kt, panel, acts, k, out),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::x86::store_quant_lines;
    use super::super::{Line, COLS, PANEL, QK, STEPS};
    use super::{decode_scales, AffineType, Decoded, BLOCK_LINES, COMP_AT, MINS_AT, SCALES_AT};
    use std::arch::x86_64::*;

    /// The 256 values of the super-block at `sb` as [`super::decode`] gives them, 32 at a time:
    /// vector `i` holds values `32 i..32 i + 32`.
    ///
    /// # Safety
    /// The CPU must support AVX2; `sb` points at a whole super-block of `kt`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn decode_quants(kt: AffineType, sb: *const u8, q: &mut [i8; 256]) {
        let m2 = _mm256_set1_epi8(3);
        let m4 = _mm256_set1_epi8(15);
        let one = _mm256_set1_epi8(1);
        let mut v = [_mm256_setzero_si256(); 8];
        // SAFETY: every load reads inside the stored block (layouts in `crate::quant::kquants`
        // and `crate::quant::legacy`).
        unsafe {
            match kt {
                AffineType::Q4_1 | AffineType::Q5_1 => {
                    // one block of 32: 16 bytes of nibbles after the scales (and q5_1's `qh`)
                    let qs = if kt == AffineType::Q4_1 { 4 } else { 8 };
                    v[0] = super::super::unpack_nibbles(_mm_loadu_si128(sb.add(qs).cast()));
                    if kt == AffineType::Q5_1 {
                        let qh = sb.add(4).cast::<i32>().read_unaligned();
                        v[0] = _mm256_or_si256(v[0], super::super::fifth_bits(qh));
                    }
                }
                AffineType::Q2K | AffineType::Q3K => {
                    let qs = if kt == AffineType::Q2K { 16 } else { 32 };
                    let hmask = _mm256_loadu_si256(sb.cast());
                    for h in 0..2 {
                        let x = _mm256_loadu_si256(sb.add(qs + 32 * h).cast());
                        for t in 0..4 {
                            let i = 4 * h + t;
                            let shift = _mm_cvtsi32_si128(2 * t as i32);
                            let low = _mm256_and_si256(_mm256_srl_epi16(x, shift), m2);
                            v[i] = if kt == AffineType::Q2K {
                                low
                            } else {
                                // q3_K: low − 4 unless the value's bit of hmask is set
                                let count = _mm_cvtsi32_si128(i as i32);
                                let high = _mm256_and_si256(_mm256_srl_epi16(hmask, count), one);
                                _mm256_sub_epi8(
                                    _mm256_or_si256(low, _mm256_slli_epi16::<2>(high)),
                                    _mm256_set1_epi8(4),
                                )
                            };
                        }
                    }
                }
                AffineType::Q4K | AffineType::Q5K => {
                    let (qs, qh) = if kt == AffineType::Q4K {
                        (16, 0)
                    } else {
                        (48, 16)
                    };
                    let bits = _mm256_loadu_si256(sb.add(qh).cast());
                    for c in 0..4 {
                        let x = _mm256_loadu_si256(sb.add(qs + 32 * c).cast());
                        v[2 * c] = _mm256_and_si256(x, m4);
                        v[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(x), m4);
                    }
                    if kt == AffineType::Q5K {
                        for (i, vi) in v.iter_mut().enumerate() {
                            let count = _mm_cvtsi32_si128(i as i32);
                            let high = _mm256_and_si256(_mm256_srl_epi16(bits, count), one);
                            *vi = _mm256_or_si256(*vi, _mm256_slli_epi16::<4>(high));
                        }
                    }
                }
                AffineType::Iq2Xs | AffineType::Iq2S | AffineType::Nvfp4 | AffineType::Iq1S => {
                    use super::super::groups::x86 as groups;
                    for (i, vi) in v.iter_mut().enumerate().take(kt.blocks()) {
                        *vi = match kt {
                            AffineType::Iq2Xs => groups::iq2_xs_values(sb, i),
                            AffineType::Iq2S => groups::iq2_s_values(sb, i),
                            AffineType::Iq1S => groups::iq1_s_values(sb, i),
                            _ => groups::nvfp4_values(sb, i),
                        };
                    }
                }
                AffineType::Q6K => {
                    let thirty_two = _mm256_set1_epi8(32);
                    for h in 0..2 {
                        let l0 = _mm256_loadu_si256(sb.add(64 * h).cast());
                        let l1 = _mm256_loadu_si256(sb.add(64 * h + 32).cast());
                        let hb = _mm256_loadu_si256(sb.add(128 + 32 * h).cast());
                        // the high two bits of value group t are bits 2t, 2t + 1 of `hb`
                        let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(hb, m2));
                        let h1 =
                            _mm256_slli_epi16::<2>(_mm256_and_si256(hb, _mm256_set1_epi8(0x0c)));
                        let h2 = _mm256_and_si256(hb, _mm256_set1_epi8(0x30));
                        let h3 =
                            _mm256_and_si256(_mm256_srli_epi16::<2>(hb), _mm256_set1_epi8(0x30));
                        let lo0 = _mm256_and_si256(l0, m4);
                        let lo1 = _mm256_and_si256(l1, m4);
                        let hi0 = _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4);
                        let hi1 = _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4);
                        let o = 4 * h;
                        v[o] = _mm256_sub_epi8(_mm256_or_si256(lo0, h0), thirty_two);
                        v[o + 1] = _mm256_sub_epi8(_mm256_or_si256(lo1, h1), thirty_two);
                        v[o + 2] = _mm256_sub_epi8(_mm256_or_si256(hi0, h2), thirty_two);
                        v[o + 3] = _mm256_sub_epi8(_mm256_or_si256(hi1, h3), thirty_two);
                    }
                }
            }
            for (i, vi) in v.iter().enumerate().take(kt.blocks()) {
                _mm256_storeu_si256(q.as_mut_ptr().add(32 * i).cast(), *vi);
            }
        }
    }

    /// [`super::pack_panel`] with AVX-512: each row's super-block is decoded once into
    /// integers (compiled here with AVX2 enabled), then each block's 16-row halves go through
    /// the parent's transposing store; scales and minimums are gathered per lane.
    ///
    /// # Safety
    /// The CPU must support AVX-512F/BW/VNNI, AVX2 and F16C; every present row holds
    /// `nb / 8` super-blocks of `kt` and `out` holds `nb` zeroed packed blocks. `dec` is
    /// scratch (its contents are overwritten before they are read).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
    pub(super) unsafe fn pack_panel(
        kt: AffineType,
        rows: &[Option<&[u8]>; PANEL],
        nb: usize,
        out: &mut [Line],
        dec: &mut [Decoded; PANEL],
    ) {
        let bytes = kt.bytes();
        for s in 0..nb / kt.blocks() {
            for (r, row) in rows.iter().enumerate() {
                if let Some(row) = row {
                    let sb = &row[s * bytes..(s + 1) * bytes];
                    decode_scales(kt, sb, &mut dec[r]);
                    // SAFETY: `sb` is a whole super-block; the CPU has AVX2 (caller).
                    unsafe { decode_quants(kt, sb.as_ptr(), &mut dec[r].q) };
                }
            }
            for j in 0..kt.blocks() {
                let b = s * kt.blocks() + j;
                // SAFETY: packed block `b` exists in `out` (caller).
                let blk = unsafe { out.as_mut_ptr().add(b * BLOCK_LINES) }.cast::<u8>();
                for v in 0..2 {
                    if rows[16 * v..16 * v + 16].iter().all(Option::is_none) {
                        continue;
                    }
                    let mut r = [_mm256_setzero_si256(); 16];
                    let mut scale = [[0f32; 16]; 2];
                    let mut min = [[0f32; 16]; 2];
                    for i in 0..16 {
                        if rows[16 * v + i].is_none() {
                            continue;
                        }
                        let d = &dec[16 * v + i];
                        // SAFETY: bytes `32 j..32 j + 32` of the 256 decoded values.
                        r[i] = unsafe { _mm256_loadu_si256(d.q.as_ptr().add(QK * j).cast()) };
                        for h in 0..2 {
                            scale[h][i] = d.scale[2 * j + h];
                            min[h][i] = d.min[2 * j + h];
                        }
                    }
                    // SAFETY: packed block `b` (64-byte aligned lines) holds BLOCK_LINES
                    // lines; the stores write line `2 h + v` of each lane field.
                    unsafe {
                        let mut sums = store_quant_lines(&r, blk, v);
                        let parts = if kt.halves() {
                            2
                        } else {
                            sums[0] = _mm512_add_epi32(sums[0], sums[1]);
                            1
                        };
                        for h in parts..2 {
                            let line = (2 * h + v) * 64;
                            for at in [COMP_AT, SCALES_AT, MINS_AT] {
                                _mm512_store_si512(
                                    blk.add(at + line).cast(),
                                    _mm512_setzero_si512(),
                                );
                            }
                        }
                        for h in 0..parts {
                            let line = (2 * h + v) * 64;
                            let comp = _mm512_sub_epi32(
                                _mm512_setzero_si512(),
                                _mm512_slli_epi32::<7>(sums[h]),
                            );
                            _mm512_store_si512(blk.add(COMP_AT + line).cast(), comp);
                            let sc = _mm512_loadu_ps(scale[h].as_ptr());
                            _mm512_store_ps(blk.add(SCALES_AT + line).cast(), sc);
                            let mn = _mm512_loadu_ps(min[h].as_ptr());
                            _mm512_store_ps(blk.add(MINS_AT + line).cast(), mn);
                        }
                    }
                }
            }
        }
    }

    /// The VNNI micro-kernel for `C` activation rows: 32 weight rows × `C` columns held in
    /// 2·`C` integer and 2·`C` f32 accumulators; the integer sums restart per half block
    /// with scales per 16 (`HALVES`), minimums are added with `MINS`.
    ///
    /// # Safety
    /// The CPU must support AVX-512F/BW/VNNI; `panel` holds `k / 32` packed blocks and every
    /// `acts[c]` a prepared activation row of `k` elements with its sums.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[allow(clippy::needless_range_loop)] // `v` and `c` index several arrays of registers
    unsafe fn tile<const C: usize, const HALVES: bool, const MINS: bool>(
        panel: &[Line],
        acts: &[&[u8]],
        k: usize,
        out: &mut [[f32; PANEL]; COLS],
    ) {
        let nb = k / QK;
        let parts = if HALVES { 2 } else { 1 };
        let steps = STEPS / parts;
        debug_assert!(panel.len() >= nb * BLOCK_LINES && acts.len() >= C);
        let ap: [*const u8; C] = std::array::from_fn(|c| acts[c].as_ptr());
        let mut accf = [[_mm512_setzero_ps(); 2]; C];
        for b in 0..nb {
            // SAFETY: block `b` of the panel (BLOCK_LINES aligned lines) and bytes
            // `32 b .. 32 b + 32`, the scale `k + 4 b` and the sums `k + 4 nb + 8 b` of every
            // activation row exist (caller); the panel lines are 64-byte aligned.
            unsafe {
                let blk = panel.as_ptr().add(b * BLOCK_LINES).cast::<u8>();
                let line = |base: usize, h: usize, v: usize| blk.add(base + (2 * h + v) * 64);
                let da: [__m512; C] = std::array::from_fn(|c| {
                    _mm512_set1_ps(ap[c].add(k + 4 * b).cast::<f32>().read_unaligned())
                });
                for h in 0..parts {
                    let comp0 = _mm512_load_si512(line(COMP_AT, h, 0).cast());
                    let comp1 = _mm512_load_si512(line(COMP_AT, h, 1).cast());
                    let mut acci = [[comp0, comp1]; C];
                    for s in steps * h..steps * (h + 1) {
                        let w0 = _mm512_load_si512(blk.add(s * 128).cast());
                        let w1 = _mm512_load_si512(blk.add(s * 128 + 64).cast());
                        for c in 0..C {
                            let x = ap[c].add(b * QK + 4 * s).cast::<i32>().read_unaligned();
                            let a = _mm512_set1_epi32(x);
                            acci[c][0] = _mm512_dpbusd_epi32(acci[c][0], a, w0);
                            acci[c][1] = _mm512_dpbusd_epi32(acci[c][1], a, w1);
                        }
                    }
                    let dw = [
                        _mm512_load_ps(line(SCALES_AT, h, 0).cast()),
                        _mm512_load_ps(line(SCALES_AT, h, 1).cast()),
                    ];
                    for c in 0..C {
                        for v in 0..2 {
                            accf[c][v] = _mm512_fmadd_ps(
                                _mm512_cvtepi32_ps(acci[c][v]),
                                _mm512_mul_ps(dw[v], da[c]),
                                accf[c][v],
                            );
                        }
                    }
                }
                if MINS {
                    let mn = |h: usize, v: usize| _mm512_load_ps(line(MINS_AT, h, v).cast());
                    for c in 0..C {
                        let sums = ap[c].add(k + 4 * nb + 8 * b).cast::<f32>();
                        for v in 0..2 {
                            for h in 0..parts {
                                let ds = _mm512_set1_ps(sums.add(h).read_unaligned());
                                accf[c][v] = _mm512_fmadd_ps(mn(h, v), ds, accf[c][v]);
                            }
                        }
                    }
                }
            }
        }
        for c in 0..C {
            // SAFETY: `out[c]` holds 32 f32 (two unaligned 16-lane stores).
            unsafe {
                _mm512_storeu_ps(out[c].as_mut_ptr(), accf[c][0]);
                _mm512_storeu_ps(out[c].as_mut_ptr().add(16), accf[c][1]);
            }
        }
    }

    /// [`tile`] for `C` columns and the terms of `kt`.
    ///
    /// # Safety
    /// As [`tile`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn tile_for<const C: usize>(
        kt: AffineType,
        panel: &[Line],
        acts: &[&[u8]],
        k: usize,
        out: &mut [[f32; PANEL]; COLS],
    ) {
        // SAFETY: forwarded from the caller.
        unsafe {
            match (kt.halves(), kt.mins()) {
                (true, true) => tile::<C, true, true>(panel, acts, k, out),
                (true, false) => tile::<C, true, false>(panel, acts, k, out),
                (false, true) => tile::<C, false, true>(panel, acts, k, out),
                (false, false) => tile::<C, false, false>(panel, acts, k, out),
            }
        }
    }

    /// Dispatches on the column count (1..=COLS) and the type's terms.
    ///
    /// # Safety
    /// As [`tile`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn tile_vnni512(
        kt: AffineType,
        panel: &[Line],
        acts: &[&[u8]],
        k: usize,
        out: &mut [[f32; PANEL]; COLS],
    ) {
        // SAFETY: forwarded from the caller.
        unsafe { per_cols!(acts.len(), tile_for(kt, panel, acts, k, out)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::values;

    const TYPES: [(DType, AffineType); 11] = [
        (DType::Q4_1, AffineType::Q4_1),
        (DType::Q5_1, AffineType::Q5_1),
        (DType::Q2_K, AffineType::Q2K),
        (DType::Q3_K, AffineType::Q3K),
        (DType::Q4_K, AffineType::Q4K),
        (DType::Q5_K, AffineType::Q5K),
        (DType::Q6_K, AffineType::Q6K),
        (DType::IQ2_XS, AffineType::Iq2Xs),
        (DType::IQ2_S, AffineType::Iq2S),
        (DType::NVFP4, AffineType::Nvfp4),
        (DType::IQ1_S, AffineType::Iq1S),
    ];

    #[test]
    fn every_type_is_listed_and_found_by_its_dtype() {
        assert_eq!(TYPES.len(), AffineType::ALL.len());
        for (dtype, kt) in TYPES {
            assert!(AffineType::ALL.contains(&kt), "{kt:?}");
            assert_eq!(AffineType::of(dtype), Some(kt));
            assert_eq!(kt.dtype(), dtype);
        }
    }

    /// `m` rows of `k` values: random bytes with sane f16 `d` (and `dmin`) of both signs.
    fn random_rows(dtype: DType, m: usize, k: usize, seed: u32) -> Vec<u8> {
        let mut raw = super::super::tests::lcg_bytes(m * dtype.row_size(k).unwrap(), seed);
        let at: &[usize] = match dtype {
            DType::Q2_K => &[80, 82],
            DType::Q3_K => &[108],
            DType::Q6_K => &[208],
            DType::IQ2_XS | DType::IQ2_S | DType::IQ1_S => &[0],
            // E4M3 scale bytes: every byte is a finite scale
            DType::NVFP4 => &[],
            _ => &[0, 2],
        };
        for (i, sb) in raw.chunks_exact_mut(dtype.type_size()).enumerate() {
            for (n, &a) in at.iter().enumerate() {
                let sign = if (i + n) % 3 == 0 { -1.0 } else { 1.0 };
                let d = half::f16::from_f32(sign * (0.002 + 0.0003 * ((i * 7 + n) % 11) as f32));
                sb[a..a + 2].copy_from_slice(&d.to_bits().to_le_bytes());
            }
        }
        raw
    }

    /// `scale · q + min` of every value equals the type's decoder.
    #[test]
    fn decoded_integers_give_the_decoded_values() {
        for (dtype, kt) in TYPES {
            let raw = random_rows(dtype, 1, 4 * QK_K, 3);
            let mut want = vec![0f32; 4 * QK_K];
            dtype.row_to_f32(&raw, &mut want).unwrap();
            let mut dec = Decoded::ZERO;
            let n = kt.blocks() * QK;
            for (s, sb) in raw.chunks_exact(kt.bytes()).enumerate() {
                decode(kt, sb, &mut dec);
                for j in 0..n {
                    let g = j / 16;
                    let got = dec.scale[g].mul_add(f32::from(dec.q[j]), dec.min[g]);
                    let want = want[s * n + j];
                    assert!(got == want, "{dtype} block {s} value {j}: {got} vs {want}");
                }
            }
        }
    }

    /// The module's arithmetic written out from the decoded integers (no packing).
    fn reference(row: &[u8], kt: AffineType, act: &[f32], k: usize) -> f32 {
        let mut prepared = vec![0u8; super::super::act_row_bytes(k)];
        super::super::prepare_row(act, &mut prepared);
        fill_sums(&mut prepared, k, kt);
        let nb = k / QK;
        let f = |at: usize| f32::from_ne_bytes(prepared[at..at + 4].try_into().unwrap());
        let mut acc = 0f32;
        let mut dec = Decoded::ZERO;
        for b in 0..nb {
            if b % kt.blocks() == 0 {
                let s = b / kt.blocks();
                decode(kt, &row[s * kt.bytes()..(s + 1) * kt.bytes()], &mut dec);
            }
            let j = b % kt.blocks();
            let isum = |lo: usize, n: usize| -> f32 {
                (lo..lo + n)
                    .map(|t| i32::from(dec.q[QK * j + t]) * (i32::from(prepared[b * QK + t]) - 128))
                    .sum::<i32>() as f32
            };
            let da = f(k + 4 * b);
            if kt.halves() {
                acc = isum(0, 16).mul_add(dec.scale[2 * j] * da, acc);
                acc = isum(16, 16).mul_add(dec.scale[2 * j + 1] * da, acc);
            } else {
                assert_eq!(dec.scale[2 * j], dec.scale[2 * j + 1]);
                acc = isum(0, 32).mul_add(dec.scale[2 * j] * da, acc);
            }
            if kt.mins() {
                let parts = if kt.halves() { 2 } else { 1 };
                for h in 0..parts {
                    acc = dec.min[2 * j + h].mul_add(f(k + 4 * nb + 4 * (2 * b + h)), acc);
                }
            }
        }
        acc
    }

    /// Every packer writes the portable bytes and every kernel gives the written-out
    /// arithmetic's bits, for every K-quant type, every column count and partial panels.
    #[test]
    fn every_isa_matches_the_arithmetic_bit_for_bit() {
        let k = 2 * QK_K;
        let nb = k / QK;
        let isas: Vec<Isa> = Isa::available()
            .into_iter()
            .filter(|&i| i != Isa::Avx2)
            .collect();
        for ((dtype, kt), m) in TYPES.iter().flat_map(|t| [(*t, 29), (*t, 11), (*t, 32)]) {
            let row_bytes = dtype.row_size(k).unwrap();
            let raw = random_rows(dtype, m, k, 9);
            let rows: [Option<&[u8]>; PANEL] =
                std::array::from_fn(|r| (r < m).then(|| &raw[r * row_bytes..(r + 1) * row_bytes]));
            let mut want = vec![Line([0; 64]); nb * BLOCK_LINES];
            pack_panel_portable(kt, &rows, nb, &mut want);
            // stale bytes: a full panel must overwrite every one
            let mut panel = vec![Line([0xA5; 64]); nb * BLOCK_LINES];
            for &isa in &isas {
                panel.iter_mut().for_each(|l| *l = Line([0xA5; 64]));
                pack_panel(isa, kt, &rows, nb, &mut panel);
                let same = panel.iter().zip(&want).all(|(a, b)| a.0 == b.0);
                assert!(same, "{dtype} {isa:?} m {m}: packed panel differs");
            }
            let xs: Vec<Vec<f32>> = (0..super::super::COLS)
                .map(|c| values(k, 21 + c as u32))
                .collect();
            for cols in 1..=super::super::COLS {
                let prepared: Vec<Vec<u8>> = xs[..cols]
                    .iter()
                    .map(|x| {
                        let mut p = vec![0u8; super::super::act_row_bytes(k)];
                        super::super::prepare_row(x, &mut p);
                        fill_sums(&mut p, k, kt);
                        p
                    })
                    .collect();
                let acts: Vec<&[u8]> = prepared.iter().map(|p| p.as_slice()).collect();
                for &isa in &isas {
                    let mut out = [[0f32; PANEL]; super::super::COLS];
                    run_tile(kt, isa, &want, &acts, k, &mut out);
                    for c in 0..cols {
                        for r in 0..m {
                            let w = reference(rows[r].unwrap(), kt, &xs[c], k);
                            assert_eq!(
                                out[c][r].to_bits(),
                                w.to_bits(),
                                "{dtype} {isa:?} cols {cols} c {c} r {r}: {} vs {w}",
                                out[c][r]
                            );
                        }
                    }
                }
            }
        }
    }
}
