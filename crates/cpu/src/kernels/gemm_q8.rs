//! MUL_MAT with q8_0, q4_0, q5_0, iq4_nl or iq4_xs weights — and the low-bit and grid types
//! whose 32-value groups are small integers times one scale (tq1_0, tq2_0, mxfp4, q1_0, q2_0,
//! iq2_xxs, iq3_xxs, iq3_s: see [`groups`]) — as integer block products, as ggml does: the
//! activations are quantized to q8_0 per block of 32, each (weight row, activation
//! row, block) product is an exact integer sum, scaled by the two block scales and accumulated
//! in f32. Every block of 32 of these weight types is exactly 32 signed bytes times one scale
//! ([`Source`]), so one packed layout and one set of kernels serve them all. Weights with
//! minimums or with scales per 16 values (q4_1, q5_1, the K-quants) go through the `affine`
//! submodule, whose packed blocks add per-half scales, corrections and minimums to the same
//! quant lines.
//!
//! Layout. Weights are repacked a panel of [`PANEL`] rows at a time (per task, into a
//! thread-local buffer) so that one 64-byte line holds 4 consecutive `k` of 16 rows: the
//! layout `vpdpbusd` wants (16 i32 lanes, each the sum of four u8 × i8 products). Nibbles
//! (and q5_0's fifth bits, iq4_nl's table levels) are unpacked to signed bytes there. The
//! activations are stored as unsigned bytes (`q + 128`); the offset's contribution,
//! `128 · Σ w` per weight row and block, is precomputed at packing time and is the starting
//! value of each block's integer sum, so no sign tricks are needed and every i8 weight value
//! (−128 included) is exact.
//!
//! Arithmetic (identical on every path and for every task split). For output element
//! `(i, j)`: `acc = 0`, then for blocks `b` in ascending order
//! `acc = fma(isum(i, j, b) as f32, dw(i, b) · da(j, b), acc)` where `isum` is the exact
//! integer block sum (at most 32 · 128 · 127 in magnitude, so its f32 conversion is exact),
//! `dw · da` is one rounded f32 product and `fma` rounds once. The AVX-512 VNNI kernel, the
//! AVX2 kernel (`avx2`: the same packed panels, activations widened to i16, no offset) and
//! the portable kernel therefore agree bit for bit.

use super::view::RowIo;
use std::cell::RefCell;

use super::interleaved::Layout as Interleaved;
use super::par_ranges_streaming;
use super::quant_dot::{f16_bits_to_f32, quantize_row_q8_0, Q8_0_BYTES, QK};
use super::view::RawTensor;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::quant::kquants::IQ4_XS_BYTES;
use crate::quant::legacy::KVALUES_IQ4NL;

/// The weight types the integer GEMM takes: every block of 32 values of each is 32 signed
/// bytes times one f32 scale, exactly (the file's values, nothing rounded).
///
/// | type | 32 bytes | scale |
/// | --- | --- | --- |
/// | q8_0 | the quants | `d` |
/// | q4_0 | nibble − 8 | `d` |
/// | q5_0 | (nibble \| high bit << 4) − 16 | `d` |
/// | iq4_nl | `KVALUES_IQ4NL[nibble]` (−127..=113) | `d` |
/// | iq4_xs | `KVALUES_IQ4NL[nibble]` of one group of 32 | `d · (group scale − 32)` |
///
/// The iq4_xs scale is a product of an f16 and an integer below 64 in magnitude, so it is
/// exact in f32; q5_0 and iq4_nl files (the bulk of llama.cpp's Q4_K_M / IQ4_XS files of
/// models whose width is not a multiple of 256) thus run prompts on the same integer
/// kernels as q8_0. The sources after iq4_xs are decoded one group of 32 at a time by
/// [`groups`] (its table), so their grid lookups and digit extractions run once per weight
/// and call, not once per column.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// q8_0 blocks.
    Q8_0,
    /// q4_0 blocks.
    Q4_0,
    /// q5_0 blocks.
    Q5_0,
    /// iq4_nl blocks.
    Iq4Nl,
    /// iq4_xs super-blocks (8 groups of 32).
    Iq4Xs,
    /// tq1_0 blocks (8 groups of 32; see [`groups`] for this and the sources below).
    Tq1_0,
    /// tq2_0 blocks (8 groups).
    Tq2_0,
    /// mxfp4 blocks (one group).
    Mxfp4,
    /// q1_0 blocks (4 groups).
    Q1_0,
    /// q2_0 blocks (2 groups).
    Q2_0,
    /// iq2_xxs super-blocks (8 groups).
    Iq2Xxs,
    /// iq3_xxs super-blocks (8 groups).
    Iq3Xxs,
    /// iq3_s super-blocks (8 groups).
    Iq3S,
}

impl Source {
    /// Every source; a packer's const parameter is a position in this list ([`Source::at`]),
    /// so each source gets its own packer with the per-row choice of unpacking folded away (a
    /// jump table per row and block had been a tenth of packing a q4_0 panel).
    const ALL: [Source; 13] = [
        Source::Q8_0,
        Source::Q4_0,
        Source::Q5_0,
        Source::Iq4Nl,
        Source::Iq4Xs,
        Source::Tq1_0,
        Source::Tq2_0,
        Source::Mxfp4,
        Source::Q1_0,
        Source::Q2_0,
        Source::Iq2Xxs,
        Source::Iq3Xxs,
        Source::Iq3S,
    ];

    /// The source at `index` in [`Source::ALL`].
    pub(crate) const fn at(index: u8) -> Source {
        Source::ALL[index as usize]
    }

    /// The weight type of the source.
    pub(crate) const fn dtype(self) -> DType {
        match self {
            Source::Q8_0 => DType::Q8_0,
            Source::Q4_0 => DType::Q4_0,
            Source::Q5_0 => DType::Q5_0,
            Source::Iq4Nl => DType::IQ4_NL,
            Source::Iq4Xs => DType::IQ4_XS,
            Source::Tq1_0 => DType::TQ1_0,
            Source::Tq2_0 => DType::TQ2_0,
            Source::Mxfp4 => DType::MXFP4,
            Source::Q1_0 => DType::Q1_0,
            Source::Q2_0 => DType::Q2_0,
            Source::Iq2Xxs => DType::IQ2_XXS,
            Source::Iq3Xxs => DType::IQ3_XXS,
            Source::Iq3S => DType::IQ3_S,
        }
    }

    /// The source of weights of type `dtype`, if the GEMM takes it.
    pub(crate) fn of(dtype: DType) -> Option<Source> {
        Source::ALL.into_iter().find(|s| s.dtype() == dtype)
    }

    /// Where the stored block holding 32-value block `b` of a row starts (bytes from the
    /// row's start) and which group of it `b` is (0 for the one-block sources). Inside the
    /// packers the source is a constant, so the type's sizes fold.
    #[inline(always)]
    fn locate(self, b: usize) -> (usize, usize) {
        let dtype = self.dtype();
        let groups = dtype.block_size() / QK;
        (b / groups * dtype.type_size(), b % groups)
    }

    /// Whether the source's groups are decoded by [`groups`].
    #[inline(always)]
    const fn grouped(self) -> bool {
        !matches!(
            self,
            Source::Q8_0 | Source::Q4_0 | Source::Q5_0 | Source::Iq4Nl | Source::Iq4Xs
        )
    }
}

/// The scale of iq4_xs group `g` of the super-block at `at`: `d · (ls − 32)`, exact in f32.
///
/// # Safety
/// `at` points at a whole iq4_xs super-block.
#[inline(always)]
unsafe fn iq4_xs_scale(at: *const u8, g: usize, d: f32) -> f32 {
    // SAFETY: the super-block's bytes 2..8 hold the scales (caller).
    let (high, low) = unsafe { (at.add(2).cast::<u16>().read_unaligned(), *at.add(4 + g / 2)) };
    let ls = ((low >> (4 * (g % 2))) & 15) | ((((high >> (2 * g)) & 3) as u8) << 4);
    d * f32::from(i16::from(ls) - 32)
}

/// The definition of [`Source`]: block `b` of `row` as 32 signed bytes and its f32 scale.
fn block_ints(src: Source, row: &[u8], b: usize) -> ([i8; QK], f32) {
    let (at, g) = src.locate(b);
    if src.grouped() {
        return groups::group_ints(src, row, at, g);
    }
    let d = f16_bits_to_f32(u16::from_ne_bytes([row[at], row[at + 1]]));
    let mut w = [0i8; QK];
    let nibbles = |qs: &[u8], w: &mut [i8; QK], f: &dyn Fn(u8, usize) -> i8| {
        for j in 0..QK / 2 {
            w[j] = f(qs[j] & 15, j);
            w[j + QK / 2] = f(qs[j] >> 4, j + QK / 2);
        }
    };
    match src {
        Source::Q8_0 => {
            for (q, &v) in w.iter_mut().zip(&row[at + 2..at + 2 + QK]) {
                *q = v as i8;
            }
        }
        Source::Q4_0 => nibbles(&row[at + 2..], &mut w, &|n, _| n as i8 - 8),
        Source::Q5_0 => {
            let qh = u32::from_le_bytes(row[at + 2..at + 6].try_into().expect("4 bytes"));
            let high = |j: usize| (((qh >> j) & 1) as u8) << 4;
            nibbles(&row[at + 6..], &mut w, &|n, j| (n | high(j)) as i8 - 16);
        }
        Source::Iq4Nl => nibbles(&row[at + 2..], &mut w, &|n, _| {
            KVALUES_IQ4NL[usize::from(n)]
        }),
        Source::Iq4Xs => {
            nibbles(&row[at + 8 + 16 * g..], &mut w, &|n, _| {
                KVALUES_IQ4NL[usize::from(n)]
            });
            // SAFETY: `at` starts a whole super-block of `row`.
            return (w, unsafe {
                iq4_xs_scale(row[at..at + IQ4_XS_BYTES].as_ptr(), g, d)
            });
        }
        _ => unreachable!("grouped sources are decoded by `groups`"),
    }
    (w, d)
}

/// 16 bytes' nibbles as 32 bytes: the low nibbles, then the high ones.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn unpack_nibbles(x: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let low = _mm_set1_epi8(0x0f);
    _mm256_set_m128i(
        _mm_and_si128(_mm_srli_epi16::<4>(x), low),
        _mm_and_si128(x, low),
    )
}

/// The fifth bits of a q5 block's 32 values (`qh` bit `j` → byte `j`) as `0x10` or 0.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn fifth_bits(qh: i32) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // byte `j` tests bit `j % 8` of byte `j / 8` of `qh`
    let spread = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let bits = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(qh), spread), bit);
    _mm256_and_si256(_mm256_cmpeq_epi8(bits, bit), _mm256_set1_epi8(0x10))
}

/// `$f::<S>($args)` with `S` the position of `$src` in [`Source::ALL`]: a function generic
/// over the source (a const parameter) called for a source known only at run time.
#[cfg(target_arch = "x86_64")]
macro_rules! per_source {
    ($src:expr, $f:ident($($arg:expr),*)) => {
        match $src {
            Source::Q8_0 => $f::<0>($($arg),*),
            Source::Q4_0 => $f::<1>($($arg),*),
            Source::Q5_0 => $f::<2>($($arg),*),
            Source::Iq4Nl => $f::<3>($($arg),*),
            Source::Iq4Xs => $f::<4>($($arg),*),
            Source::Tq1_0 => $f::<5>($($arg),*),
            Source::Tq2_0 => $f::<6>($($arg),*),
            Source::Mxfp4 => $f::<7>($($arg),*),
            Source::Q1_0 => $f::<8>($($arg),*),
            Source::Q2_0 => $f::<9>($($arg),*),
            Source::Iq2Xxs => $f::<10>($($arg),*),
            Source::Iq3Xxs => $f::<11>($($arg),*),
            Source::Iq3S => $f::<12>($($arg),*),
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(crate) use per_source;

/// `$f::<C>($args)` with `C` = `$n` (1..=[`COLS`]): a micro-kernel generic over its column
/// count called for a count known only at run time.
#[cfg(target_arch = "x86_64")]
macro_rules! per_cols {
    ($n:expr, $f:ident($($arg:expr),*)) => {{
        const _: () = assert!($crate::kernels::gemm_q8::COLS == 6, "one arm per column count");
        match $n {
            1 => $f::<1>($($arg),*),
            2 => $f::<2>($($arg),*),
            3 => $f::<3>($($arg),*),
            4 => $f::<4>($($arg),*),
            5 => $f::<5>($($arg),*),
            _ => $f::<6>($($arg),*),
        }
    }};
}

/// Loads block `b` of each present row of `rows` (weights of `src`) into `r` as 32 signed
/// bytes (the values of [`block_ints`]) and its scale into `scales`; missing rows keep their
/// zeros. A macro so that it expands inside the packers' target-feature functions (AVX2 and
/// F16C enabled there).
#[cfg(target_arch = "x86_64")]
macro_rules! load_row_blocks {
    ($rows:expr, $b:expr, $src:expr, $r:expr, $scales:expr) => {{
        use $crate::kernels::gemm_q8::Source;
        let (offset, group) = $src.locate($b);
        // The 16 iq4_nl levels in each 128-bit lane, for `vpshufb`.
        // SAFETY: the table is 16 bytes.
        let levels = _mm256_broadcastsi128_si256(unsafe {
            _mm_loadu_si128($crate::quant::legacy::KVALUES_IQ4NL.as_ptr().cast())
        });
        for (i, row) in $rows.iter().enumerate() {
            let Some(row) = row else {
                continue;
            };
            // SAFETY: block `b` of the row lies inside it (the packer's caller guarantees
            // every present row holds the blocks), and so does its stored block.
            unsafe {
                let at = row.as_ptr().add(offset);
                _mm_prefetch::<_MM_HINT_T0>(
                    at.wrapping_add($crate::kernels::gemm_q8::PACK_PREFETCH)
                        .cast(),
                );
                if $src.grouped() {
                    let (v, d) = $crate::kernels::gemm_q8::groups::x86::group($src, at, group);
                    $scales[i] = d;
                    $r[i] = v;
                    continue;
                }
                let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(
                    at.cast::<u16>().read_unaligned(),
                ))));
                $scales[i] = d;
                $r[i] = match $src {
                    Source::Q8_0 => _mm256_loadu_si256(at.add(2).cast()),
                    Source::Q4_0 => _mm256_sub_epi8(
                        $crate::kernels::gemm_q8::unpack_nibbles(_mm_loadu_si128(at.add(2).cast())),
                        _mm256_set1_epi8(8),
                    ),
                    Source::Q5_0 => {
                        let qh = at.add(2).cast::<i32>().read_unaligned();
                        let high = $crate::kernels::gemm_q8::fifth_bits(qh);
                        _mm256_sub_epi8(
                            _mm256_or_si256(
                                $crate::kernels::gemm_q8::unpack_nibbles(_mm_loadu_si128(
                                    at.add(6).cast(),
                                )),
                                high,
                            ),
                            _mm256_set1_epi8(16),
                        )
                    }
                    Source::Iq4Nl => _mm256_shuffle_epi8(
                        levels,
                        $crate::kernels::gemm_q8::unpack_nibbles(_mm_loadu_si128(at.add(2).cast())),
                    ),
                    Source::Iq4Xs => {
                        $scales[i] = $crate::kernels::gemm_q8::iq4_xs_scale(at, group, d);
                        _mm256_shuffle_epi8(
                            levels,
                            $crate::kernels::gemm_q8::unpack_nibbles(_mm_loadu_si128(
                                at.add(8 + 16 * group).cast(),
                            )),
                        )
                    }
                    _ => unreachable!("grouped sources are decoded above"),
                };
            }
        }
    }};
}

/// Packs the panel of `rows` of `dtype` (of [`affine`]'s types when `affine_type`).
fn pack_any(
    isa: Isa,
    dtype: DType,
    affine_type: Option<affine::AffineType>,
    rows: &[Option<&[u8]>; PANEL],
    nb: usize,
    out: &mut Vec<Line>,
) {
    match affine_type {
        Some(kt) => affine::pack_panel(isa, kt, rows, nb, out),
        None => pack_panel(isa, dtype, rows, nb, out),
    }
}

/// How far ahead in each weight row the packers prefetch. A panel's 16-32 rows are as many
/// concurrent streams, more than the hardware prefetchers follow: without this, packing a
/// panel waited on memory about as long as its tiles computed (q8_0, 4-16 columns). 256
/// bytes measured best of 128-2048 on Zen 5 (farther evicts lines still to be read).
#[cfg(target_arch = "x86_64")]
pub(crate) const PACK_PREFETCH: usize = 256;

mod affine;
#[cfg(target_arch = "x86_64")]
mod avx2;
mod groups;
pub mod nibbles;
pub mod stored;

/// Weight rows per packed panel (two 16-lane vectors).
pub const PANEL: usize = 32;

/// Activation rows (output columns) per micro-tile.
const COLS: usize = 6;

/// Steps of four `k` per block.
const STEPS: usize = QK / 4;

/// One cache line of a packed panel (64-byte aligned so the kernel's loads are aligned).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Lines per packed block: 8 steps × 2 vectors of quants, then the 32 f32 scales, then the
/// 32 i32 offset corrections.
const BLOCK_LINES: usize = STEPS * 2 + 2 + 2;
/// Byte offset of the scales inside a packed block.
const SCALES_AT: usize = STEPS * 2 * 64;
/// Byte offset of the offset corrections inside a packed block.
const COMP_AT: usize = SCALES_AT + 2 * 64;

/// The kernel family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust.
    Portable,
    /// AVX2 + FMA + F16C (`vpmaddubsw` on 256-bit vectors, see `avx2`).
    Avx2,
    /// AVX-512 with VNNI (`vpdpbusd` on 512-bit vectors).
    Vnni512,
}

impl Isa {
    /// Every family this CPU runs, slowest first.
    pub fn available() -> Vec<Isa> {
        let mut out = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            // The VNNI family packs its panels with the AVX2 packer, so it needs AVX2 too.
            if crate::isa::get().avx2_fma_f16c() {
                out.push(Isa::Avx2);
                if has_vnni512() {
                    out.push(Isa::Vnni512);
                }
            }
        }
        out
    }

    /// The fastest family this CPU runs.
    pub fn best() -> Isa {
        static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| *Isa::available().last().unwrap_or(&Isa::Portable))
    }
}

/// Whether the AVX-512 VNNI kernel can run on this CPU.
fn has_vnni512() -> bool {
    crate::isa::get().avx512_bw_vnni()
}

/// Bytes of one prepared activation row of `k` elements: `k` offset quants, one f32 scale per
/// block, then two f32 half-block sums per block (filled for K-quant weights only, see
/// `affine`).
pub fn act_row_bytes(k: usize) -> usize {
    k + 12 * (k / QK)
}

/// Bytes of one activation row of `k` elements as the kernels of `isa` read it: the AVX2
/// kernel's quants are widened to i16 ([`widen_row`]), the others' are offset bytes.
pub fn act_row_bytes_for(isa: Isa, k: usize) -> usize {
    if isa == Isa::Avx2 {
        2 * k + 4 * (k / QK)
    } else {
        act_row_bytes(k)
    }
}

/// Rewrites a prepared row of `k` elements (the first [`act_row_bytes`] of `row`) in place
/// into the wide layout of the AVX2 kernel: `k` signed i16 quants (the offset removed), then
/// the same f32 scales. `row` holds `act_row_bytes_for(Isa::Avx2, k)` bytes.
pub fn widen_row(row: &mut [u8], k: usize) {
    let scales = 4 * (k / QK);
    assert!(row.len() >= 2 * k + scales);
    row.copy_within(k..k + scales, 2 * k);
    // Backwards: element `i` moves to bytes `2 i..2 i + 2`, never over an unread element.
    for i in (0..k).rev() {
        let q = (i16::from(row[i]) - 128).to_ne_bytes();
        row[2 * i..2 * i + 2].copy_from_slice(&q);
    }
}

/// [`prepare_row`] into the layout the kernels of `isa` read ([`act_row_bytes_for`]).
pub fn prepare_row_for(isa: Isa, x: &[f32], out: &mut [u8]) {
    prepare_row(x, out);
    if isa == Isa::Avx2 {
        widen_row(out, x.len());
    }
}

/// Whether this path handles the product (quantized weights with whole blocks in dense rows,
/// a dense f32 output).
pub fn applies(a: &RawTensor, dst: &RawTensor) -> bool {
    // K-quants have only the VNNI kernel (and the portable reference).
    let k_quant = affine::AffineType::of(a.dtype).is_some() && Isa::best() == Isa::Vnni512;
    if Source::of(a.dtype).is_none() && !k_quant {
        return false;
    }
    a.ne[0] > 0
        && a.ne[0].is_multiple_of(a.dtype.block_size())
        && a.nb[0] == a.dtype.type_size()
        && dst.dtype == DType::F32
        && dst.nb[0] == 4
        && (dst.ptr.0 as usize).is_multiple_of(4)
        && dst.nb[1..].iter().all(|s| s % 4 == 0)
}

/// Quantizes one f32 row into the prepared layout (the q8_0 quantization of
/// [`quantize_row_q8_0`], values offset by 128, scales widened to f32); AVX-512 when the CPU
/// has it, with the same bits.
pub fn prepare_row(x: &[f32], out: &mut [u8]) {
    assert!(x.len().is_multiple_of(QK) && out.len() >= act_row_bytes(x.len()));
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F/BW (checked); the sizes were checked above.
        unsafe { x86::prepare_row(x, out) };
        return;
    }
    prepare_row_portable(x, out);
}

/// Whether the AVX-512F/BW quantizer can run on this CPU.
fn has_avx512() -> bool {
    crate::isa::get().avx512_bw()
}

/// One block of [`prepare_row`], portable: quantizes `xs` (32 values) into `quants` and
/// returns the scale.
fn prepare_block(xs: &[f32], quants: &mut [u8]) -> f32 {
    let mut block = [0u8; Q8_0_BYTES];
    quantize_row_q8_0(xs, &mut block);
    for (q, &v) in quants.iter_mut().zip(&block[2..]) {
        *q = v ^ 0x80;
    }
    f16_bits_to_f32(u16::from_ne_bytes([block[0], block[1]]))
}

/// [`prepare_row`] in portable Rust (the reference).
pub fn prepare_row_portable(x: &[f32], out: &mut [u8]) {
    let k = x.len();
    let (quants, scales) = out.split_at_mut(k);
    for (b, xs) in x.chunks_exact(QK).enumerate() {
        let d = prepare_block(xs, &mut quants[b * QK..(b + 1) * QK]);
        scales[4 * b..4 * b + 4].copy_from_slice(&d.to_ne_bytes());
    }
}

/// Prepares every row of `b` (parallel) into `out` (`nrows × act_row_bytes_for(isa, k)`
/// bytes) for the kernels of `isa`, with the sums weights of a K-quant type need.
fn prepare_acts(
    isa: Isa,
    b: &RawTensor,
    out: &mut [u8],
    k_quant: Option<affine::AffineType>,
) -> Result<()> {
    let k = b.ne[0];
    let row_bytes = act_row_bytes_for(isa, k);
    // Dense aligned f32 rows are quantized where they are, others loaded first.
    let dense = b.dtype == DType::F32
        && b.nb[0] == 4
        && (b.ptr.0 as usize).is_multiple_of(4)
        && b.nb[1..].iter().all(|s| s % 4 == 0);
    super::par_rows_mut(
        out,
        row_bytes,
        || vec![0f32; k],
        |r, row, buf| {
            let (i1, i2, i3) = b.row_coords(r);
            if dense {
                // SAFETY: row `r` lies inside `b`, dense 4-byte aligned f32 (checked above),
                // read-only during the product.
                let x = unsafe {
                    std::slice::from_raw_parts(b.at(b.row_offset(i1, i2, i3)).cast::<f32>(), k)
                };
                prepare_row_for(isa, x, row);
            } else {
                // SAFETY: row `r` lies inside `b` (read-only during the product).
                unsafe { b.load_row(i1, i2, i3, buf)? };
                prepare_row_for(isa, buf, row);
            }
            if let Some(kt) = k_quant {
                affine::fill_sums(row, k, kt);
            }
            Ok(())
        },
    )
}

/// Packs weight rows (`rows[r]` is the raw row of panel row `r`, `None` past the last row)
/// of type `dtype` into `out`: `nb` packed blocks, with the packer of `isa` (every packer
/// writes the same bytes).
fn pack_panel(
    isa: Isa,
    dtype: DType,
    rows: &[Option<&[u8]>; PANEL],
    nb: usize,
    out: &mut Vec<Line>,
) {
    let src = Source::of(dtype).expect("a type the integer GEMM takes");
    reset_panel(out, nb * BLOCK_LINES, rows);
    // whole stored blocks (iq4_xs: super-blocks of 8) in every present row
    let row_bytes = dtype.row_size(nb * QK).expect("whole blocks");
    assert!(rows.iter().flatten().all(|r| r.len() >= row_bytes));
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2` is only chosen when the CPU has AVX2/FMA/F16C; sizes as above, and
        // `out` is zeroed when a row is missing.
        Isa::Avx2 => unsafe { avx2::pack_panel(src, rows, nb, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Vnni512` is only chosen when the CPU has AVX-512F/BW/VNNI and AVX2/F16C;
        // sizes as above, and `out` is zeroed when a row is missing.
        Isa::Vnni512 => unsafe { x86::pack_panel(src, rows, nb, out) },
        _ => pack_panel_portable(src, rows, nb, out),
    }
}

/// Makes `out` a panel of `lines` lines for a packer of `rows`. Every packer writes every
/// byte of a panel whose rows are all present; missing rows (past the matrix's end) are left
/// as zeros, so only such a panel is cleared first (clearing every panel was 7% of a
/// one-sentence MiniLM call).
fn reset_panel(out: &mut Vec<Line>, lines: usize, rows: &[Option<&[u8]>; PANEL]) {
    if out.len() != lines || rows.iter().any(Option::is_none) {
        out.clear();
        out.resize(lines, Line([0; 64]));
    }
}

/// The bytes of packed lines.
fn line_bytes(lines: &mut [Line]) -> &mut [u8] {
    // SAFETY: a `Line` is 64 plain bytes (`repr(C)`), so the lines are `64 · len` bytes.
    unsafe {
        std::slice::from_raw_parts_mut(
            lines.as_mut_ptr().cast::<u8>(),
            std::mem::size_of_val(lines),
        )
    }
}

/// [`pack_panel`] in portable Rust (the reference): `out` holds `nb` zeroed packed blocks.
fn pack_panel_portable(src: Source, rows: &[Option<&[u8]>; PANEL], nb: usize, out: &mut [Line]) {
    let bytes = line_bytes(out);
    for (b, blk) in bytes.chunks_exact_mut(PACKED_BLOCK).take(nb).enumerate() {
        for (r, row) in rows.iter().enumerate() {
            if let Some(row) = row {
                pack_block(src, row, b, blk, r);
            }
        }
    }
}

/// Bytes of one packed block (all [`PANEL`] rows of a panel, [`QK`] values of `k`).
const PACKED_BLOCK: usize = BLOCK_LINES * std::mem::size_of::<Line>();

/// Packs block `b` of the plain row `row` (weights of `src`) as lane `r` (0..[`PANEL`]) of
/// the packed block `blk` ([`PACKED_BLOCK`] bytes): its values in the quant lines, its scale
/// and its offset correction. The definition every packer follows.
fn pack_block(src: Source, row: &[u8], b: usize, blk: &mut [u8], r: usize) {
    let (w, scale) = block_ints(src, row, b);
    let (v, lane) = (r / 16, r % 16);
    for s in 0..STEPS {
        let at = (s * 2 + v) * 64 + lane * 4;
        for t in 0..4 {
            blk[at + t] = w[4 * s + t] as u8;
        }
    }
    let sum: i32 = w.iter().map(|&x| i32::from(x)).sum();
    let at = SCALES_AT + v * 64 + lane * 4;
    blk[at..at + 4].copy_from_slice(&scale.to_ne_bytes());
    let at = COMP_AT + v * 64 + lane * 4;
    blk[at..at + 4].copy_from_slice(&(-128 * sum).to_ne_bytes());
}

/// The inverse of [`pack_block`] for the values of a q8_0 block: lane `r`'s values of the
/// packed block `blk` as the plain block's quant bytes (`quants`: the block's bytes after its
/// scale).
fn unpack_block_quants(blk: &[u8], r: usize, quants: &mut [u8]) {
    let (v, lane) = (r / 16, r % 16);
    for s in 0..STEPS {
        let at = (s * 2 + v) * 64 + lane * 4;
        quants[4 * s..4 * s + 4].copy_from_slice(&blk[at..at + 4]);
    }
}

/// The portable micro-kernel: `out[c][r]` for panel row `r` and activation row `acts[c]`.
#[inline(always)]
fn tile_portable(panel: &[Line], acts: &[&[u8]], k: usize, out: &mut [[f32; PANEL]; COLS]) {
    let nb = k / QK;
    for (c, act) in acts.iter().enumerate() {
        let mut acc = [0f32; PANEL];
        for b in 0..nb {
            let blk = &panel[b * BLOCK_LINES..(b + 1) * BLOCK_LINES];
            let mut isum = [0i32; PANEL];
            for (r, s) in isum.iter_mut().enumerate() {
                let (v, lane) = (r / 16, r % 16);
                *s = i32::from_ne_bytes(
                    blk[STEPS * 2 + 2 + v].0[lane * 4..lane * 4 + 4]
                        .try_into()
                        .expect("4 bytes"),
                );
            }
            let aq = &act[b * QK..(b + 1) * QK];
            for s in 0..STEPS {
                for (v, half) in isum.chunks_exact_mut(16).enumerate() {
                    let line = &blk[s * 2 + v].0;
                    for (lane, sum) in half.iter_mut().enumerate() {
                        for t in 0..4 {
                            *sum += i32::from(aq[4 * s + t]) * i32::from(line[lane * 4 + t] as i8);
                        }
                    }
                }
            }
            let da = f32::from_ne_bytes(act[k + 4 * b..k + 4 * b + 4].try_into().expect("4"));
            for (r, (a, &s)) in acc.iter_mut().zip(&isum).enumerate() {
                let (v, lane) = (r / 16, r % 16);
                let dw = f32::from_ne_bytes(
                    blk[STEPS * 2 + v].0[lane * 4..lane * 4 + 4]
                        .try_into()
                        .expect("4 bytes"),
                );
                *a = (s as f32).mul_add(dw * da, *a);
            }
        }
        out[c] = acc;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Line, Source, BLOCK_LINES, COLS, COMP_AT, PANEL, QK, SCALES_AT, STEPS};
    use half::f16;
    use std::arch::x86_64::*;

    /// [`super::pack_panel`] with 512-bit vectors: each row's block is loaded as 32 signed
    /// bytes (q4_0 nibbles unpacked, minus 8), rows `p` and `p + 8` share one register, and
    /// an 8 × 8 transpose of 4-byte groups inside each 256-bit half plus one lane exchange
    /// gives whole packed lines (16 rows × 4 consecutive `k`). Writes the same bytes as the
    /// portable packer; a half panel without rows is left as it is (zeroed by the caller).
    ///
    /// # Safety
    /// The CPU must support AVX-512F/BW/VNNI, AVX2 and F16C; every present row holds `nb`
    /// blocks of 32 of `src`'s type and `out` holds `nb` packed blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
    pub(crate) unsafe fn pack_panel(
        src: Source,
        rows: &[Option<&[u8]>; PANEL],
        nb: usize,
        out: &mut [Line],
    ) {
        // SAFETY: forwarded from the caller.
        unsafe { per_source!(src, pack_panel_of(rows, nb, out)) }
    }

    /// [`pack_panel`] for the source at index `S` ([`Source::at`]).
    ///
    /// # Safety
    /// As [`pack_panel`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
    unsafe fn pack_panel_of<const S: u8>(
        rows: &[Option<&[u8]>; PANEL],
        nb: usize,
        out: &mut [Line],
    ) {
        let src = const { Source::at(S) };
        for b in 0..nb {
            // SAFETY: packed block `b` exists in `out` (caller).
            let blk = unsafe { out.as_mut_ptr().add(b * BLOCK_LINES) }.cast::<u8>();
            for v in 0..2 {
                let half = &rows[v * 16..v * 16 + 16];
                if half.iter().all(Option::is_none) {
                    continue;
                }
                // Plain loops and a macro, no closures: a closure would not inherit this
                // function's target features (its intrinsics would become calls).
                let mut scales = [0f32; 16];
                let mut r = [_mm256_setzero_si256(); 16];
                load_row_blocks!(half, b, src, r, scales);
                // SAFETY: packed block `b` holds `BLOCK_LINES` lines (caller).
                let [low, high] = unsafe { store_quant_lines(&r, blk, v) };
                let sum = _mm512_add_epi32(low, high);
                // SAFETY: `scales` holds 16 f32; the stores write one line each of block `b`.
                unsafe {
                    let d = _mm512_loadu_ps(scales.as_ptr());
                    _mm512_store_ps(blk.add(SCALES_AT + v * 64).cast(), d);
                    let comp =
                        _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<7>(sum));
                    _mm512_store_si512(blk.add(COMP_AT + v * 64).cast(), comp);
                }
            }
        }
    }

    /// Writes the 32 values of 16 rows (`r[i]`: row `16 v + i`'s signed bytes) as the quant
    /// lines of vector `v` of the packed block at `blk` (line `2 s + v` holds values
    /// `4 s..4 s + 4` of the 16 rows) and returns each row's sum of values `0..16` and
    /// `16..32` (lane `i`: row `16 v + i`). Rows `p` and `p + 8` share one register, and an
    /// 8 × 8 transpose of 4-byte groups inside each 256-bit half plus one lane exchange gives
    /// whole lines.
    ///
    /// # Safety
    /// The CPU must support AVX-512F/BW/VNNI; `blk` points at a 64-byte aligned packed block
    /// whose first `2 · STEPS` lines may be written.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
    pub(crate) unsafe fn store_quant_lines(
        r: &[__m256i; 16],
        blk: *mut u8,
        v: usize,
    ) -> [__m512i; 2] {
        let ones = _mm512_set1_epi8(1);
        // Qwords of the lane exchange: lines 0-3 take lanes 0 and 2 of both inputs, lines
        // 4-7 lanes 1 and 3 (`a` = rows 0-3 and 8-11, `b` = rows 4-7 and 12-15).
        let first = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
        let second = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
        let mut z = [_mm512_setzero_si512(); 8];
        for p in 0..8 {
            z[p] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(r[p]), r[p + 8]);
        }
        // Within each 128-bit lane: t = 2-row interleaves, u[j] (j < 4) = dword j of
        // rows 0-3, u[4 + j] = of rows 4-7 (and of rows 8-15 in the upper half).
        let mut t = [_mm512_setzero_si512(); 8];
        for p in 0..4 {
            t[2 * p] = _mm512_unpacklo_epi32(z[2 * p], z[2 * p + 1]);
            t[2 * p + 1] = _mm512_unpackhi_epi32(z[2 * p], z[2 * p + 1]);
        }
        let mut u = [_mm512_setzero_si512(); 8];
        for g in 0..2 {
            let o = 4 * g;
            u[o] = _mm512_unpacklo_epi64(t[o], t[o + 2]);
            u[o + 1] = _mm512_unpackhi_epi64(t[o], t[o + 2]);
            u[o + 2] = _mm512_unpacklo_epi64(t[o + 1], t[o + 3]);
            u[o + 3] = _mm512_unpackhi_epi64(t[o + 1], t[o + 3]);
        }
        let mut sums = [_mm512_setzero_si512(); 2];
        for s in 0..STEPS {
            let (j, idx) = if s < 4 { (s, first) } else { (s - 4, second) };
            let line = _mm512_permutex2var_epi64(u[j], idx, u[j + 4]);
            // SAFETY: line `2s + v` of the packed block (64-byte aligned, caller).
            unsafe { _mm512_store_si512(blk.add((s * 2 + v) * 64).cast(), line) };
            sums[s / 4] = _mm512_dpbusd_epi32(sums[s / 4], ones, line);
        }
        sums
    }

    /// [`super::prepare_row`] with AVX-512: the same operations as `quantize_row_q8_0`
    /// (maximum magnitude, `d = amax / 127`, `id = 1 / d`, round half away from zero,
    /// saturate to i8), each exact or rounded the same way. Blocks holding a NaN or an
    /// infinity, or so tiny that `1 / d` overflows, go through the portable code.
    ///
    /// # Safety
    /// The CPU must support AVX-512F/BW; `x.len()` is a multiple of 32 and `out` holds
    /// `act_row_bytes(x.len())` bytes.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn prepare_row(x: &[f32], out: &mut [u8]) {
        let k = x.len();
        let abs_mask = _mm512_set1_epi32(0x7fff_ffff);
        let half = _mm512_set1_ps(0.5);
        let one = _mm512_set1_ps(1.0);
        let sign = _mm512_set1_epi32(i32::MIN);
        let bias = _mm_set1_epi8(-128);
        for b in 0..k / QK {
            let xs = &x[b * QK..(b + 1) * QK];
            // SAFETY: `xs` holds 32 f32.
            let (v0, v1) = unsafe {
                (
                    _mm512_loadu_ps(xs.as_ptr()),
                    _mm512_loadu_ps(xs.as_ptr().add(16)),
                )
            };
            let a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), abs_mask));
            let a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), abs_mask));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let has_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v0, v1) != 0;
            let d = if !has_nan && amax.is_finite() && id.is_finite() {
                let id = _mm512_set1_ps(id);
                for (h, v) in [v0, v1].into_iter().enumerate() {
                    let y = _mm512_mul_ps(v, id);
                    // round(y) half away from zero: t = trunc(y); y − t is exact; add ±1
                    // where |y − t| ≥ 0.5.
                    let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
                    let frac = _mm512_castsi512_ps(_mm512_and_si512(
                        _mm512_castps_si512(_mm512_sub_ps(y, t)),
                        abs_mask,
                    ));
                    let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, half);
                    let step = _mm512_castsi512_ps(_mm512_or_si512(
                        _mm512_castps_si512(one),
                        _mm512_and_si512(_mm512_castps_si512(y), sign),
                    ));
                    let r = _mm512_mask_add_ps(t, up, t, step);
                    let q = _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(r));
                    // SAFETY: 16 quants of block `b` (out holds k of them).
                    unsafe {
                        _mm_storeu_si128(
                            out.as_mut_ptr().add(b * QK + 16 * h).cast(),
                            _mm_xor_si128(q, bias),
                        )
                    };
                }
                f16::from_f32(d).to_f32()
            } else {
                super::prepare_block(xs, &mut out[b * QK..(b + 1) * QK])
            };
            out[k + 4 * b..k + 4 * b + 4].copy_from_slice(&d.to_ne_bytes());
        }
    }

    /// The VNNI micro-kernel for `C` activation rows: 32 weight rows × `C` columns held in
    /// 2·`C` integer and 2·`C` f32 accumulators.
    ///
    /// # Safety
    /// The CPU must support AVX-512F/BW/VNNI; `panel` holds `k / 32` packed blocks and every
    /// `acts[c]` a prepared activation row of `k` elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn tile<const C: usize>(
        panel: &[Line],
        acts: &[&[u8]],
        k: usize,
        out: &mut [[f32; PANEL]; COLS],
    ) {
        let nb = k / QK;
        debug_assert!(panel.len() >= nb * BLOCK_LINES && acts.len() >= C);
        let ap: [*const u8; C] = std::array::from_fn(|c| acts[c].as_ptr());
        let mut accf = [[_mm512_setzero_ps(); 2]; C];
        for b in 0..nb {
            // SAFETY: block `b` of the panel (BLOCK_LINES aligned lines) and bytes
            // `32 b .. 32 b + 32` and `k + 4 b .. k + 4 b + 4` of every activation row exist
            // (caller); the panel lines are 64-byte aligned.
            unsafe {
                let blk = panel.as_ptr().add(b * BLOCK_LINES).cast::<u8>();
                let comp0 = _mm512_load_si512(blk.add(COMP_AT).cast());
                let comp1 = _mm512_load_si512(blk.add(COMP_AT + 64).cast());
                let mut acci = [[comp0, comp1]; C];
                for s in 0..STEPS {
                    let w0 = _mm512_load_si512(blk.add(s * 128).cast());
                    let w1 = _mm512_load_si512(blk.add(s * 128 + 64).cast());
                    for c in 0..C {
                        let x = ap[c].add(b * QK + 4 * s).cast::<i32>().read_unaligned();
                        let a = _mm512_set1_epi32(x);
                        acci[c][0] = _mm512_dpbusd_epi32(acci[c][0], a, w0);
                        acci[c][1] = _mm512_dpbusd_epi32(acci[c][1], a, w1);
                    }
                }
                let dw0 = _mm512_load_ps(blk.add(SCALES_AT).cast());
                let dw1 = _mm512_load_ps(blk.add(SCALES_AT + 64).cast());
                scale_block(&mut accf, &acci, [dw0, dw1], &ap, k + 4 * b);
            }
        }
        // SAFETY: AVX-512F, which this function has.
        unsafe { store_tile(&accf, out) };
    }

    /// The f32 step of one block for every column, shared by the VNNI micro-kernels:
    /// `acc = fma(isum, dw · da, acc)` per half panel, `da` the f32 scale at byte `at` of
    /// column `c`'s prepared activation row.
    ///
    /// # Safety
    /// Inlined only into functions with AVX-512F; every `ap[c]` holds 4 bytes at `at`.
    #[inline(always)]
    pub(super) unsafe fn scale_block<const C: usize>(
        accf: &mut [[__m512; 2]; C],
        acci: &[[__m512i; 2]; C],
        dw: [__m512; 2],
        ap: &[*const u8; C],
        at: usize,
    ) {
        for c in 0..C {
            // SAFETY: the caller's contract.
            unsafe {
                let da = _mm512_set1_ps(ap[c].add(at).cast::<f32>().read_unaligned());
                for h in 0..2 {
                    accf[c][h] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(acci[c][h]),
                        _mm512_mul_ps(dw[h], da),
                        accf[c][h],
                    );
                }
            }
        }
    }

    /// Writes the `C` columns' 32 sums of a micro-tile to `out`.
    ///
    /// # Safety
    /// Inlined only into functions with AVX-512F.
    #[inline(always)]
    pub(super) unsafe fn store_tile<const C: usize>(
        accf: &[[__m512; 2]; C],
        out: &mut [[f32; PANEL]; COLS],
    ) {
        for c in 0..C {
            // SAFETY: `out[c]` holds 32 f32 (two unaligned 16-lane stores); AVX-512F (the
            // caller's contract).
            unsafe {
                _mm512_storeu_ps(out[c].as_mut_ptr(), accf[c][0]);
                _mm512_storeu_ps(out[c].as_mut_ptr().add(16), accf[c][1]);
            }
        }
    }

    /// Dispatches on the column count (1..=COLS).
    ///
    /// # Safety
    /// As [`tile`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn tile_vnni512(
        panel: &[Line],
        acts: &[&[u8]],
        k: usize,
        out: &mut [[f32; PANEL]; COLS],
    ) {
        // SAFETY: forwarded from the caller.
        unsafe { per_cols!(acts.len(), tile(panel, acts, k, out)) }
    }
}

/// One micro-tile with the kernels of `isa` (`acts.len()` in 1..=COLS).
fn run_tile(isa: Isa, panel: &[Line], acts: &[&[u8]], k: usize, out: &mut [[f32; PANEL]; COLS]) {
    assert!(!acts.is_empty() && acts.len() <= COLS);
    assert!(panel.len() >= (k / QK) * BLOCK_LINES);
    assert!(acts.iter().all(|a| a.len() >= act_row_bytes_for(isa, k)));
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Vnni512` is only chosen when the CPU has its features (`Isa::available`);
        // the sizes were checked above.
        Isa::Vnni512 => unsafe { x86::tile_vnni512(panel, acts, k, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2` is only chosen when the CPU has AVX2 and FMA; sizes as above.
        Isa::Avx2 => unsafe { avx2::tile(panel, acts, k, out) },
        #[allow(unreachable_patterns)]
        _ => tile_portable(panel, acts, k, out),
    }
}

thread_local! {
    // The packed panel of the running task, kept between calls.
    static PANEL_BUF: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
    // The plain rows of the running task's panel, when the weights are stored interleaved.
    static PLAIN_ROWS: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Activation rows per task block (a multiple of COLS): large, so each weight panel is packed
/// once for (nearly) all columns; the micro-tile's activation rows are streamed from L2/L3,
/// which its many multiply-adds per byte easily hide.
const COL_BLOCK: usize = 1020;

/// MUL_MAT `dst[i, j, i12, i13] = Σ_k a[k, i, i12/r2, i13/r3] · b[k, j, i12, i13]` with
/// weights `a` of a type [`applies`] takes (see the module documentation), on the kernels of
/// `isa`. With `interleaved`, `a` is a whole 2-D q4_1 matrix stored in that layout (see
/// [`super::interleaved`]; same bits as the plain rows). `scratch` holds the prepared
/// activations.
pub fn mul_mat(
    isa: Isa,
    dst: &RawTensor,
    a: &RawTensor,
    interleaved: Option<&Interleaved>,
    b: &RawTensor,
    (r2, r3): (usize, usize),
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let weights = match interleaved {
        Some(layout) => {
            let fits = layout.rows == a.ne[1]
                && layout.row_bytes == a.dtype.row_size(a.ne[0])?
                && a.ne[2] * a.ne[3] == 1;
            if !fits {
                return Err(Error::shape(
                    "quantized GEMM: the interleaved layout does not fit this product",
                ));
            }
            Weights::Interleaved(layout)
        }
        None => Weights::Plain,
    };
    mul_mat_from(isa, dst, a, weights, b, (r2, r3), scratch)
}

/// How the weights of a product are stored.
#[derive(Clone, Copy)]
enum Weights<'a> {
    /// Plain rows of blocks.
    Plain,
    /// Rows interleaved eight at a time (q4_1; the whole 2-D matrix).
    Interleaved(&'a Interleaved),
    /// Packed panels ([`stored`]) at this address.
    Panels(super::view::SendPtr),
    /// q4_0 nibble panels ([`nibbles`]) at this address: read by the fused kernel, or
    /// rebuilt and packed per task where there is none.
    Nibbles(super::view::SendPtr, &'a nibbles::NibbleLayout),
}

/// [`mul_mat`] with weights stored as packed panels ([`stored`]): `a` describes the plain
/// 2-D matrix (types, shape and strides) and points at the stored panels, which must start at
/// a multiple of 64 bytes and follow `layout`. Same bits as [`mul_mat`] on the plain rows.
pub fn mul_mat_stored(
    isa: Isa,
    dst: &RawTensor,
    a: &RawTensor,
    layout: &stored::PanelLayout,
    b: &RawTensor,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let fits = layout.dtype() == a.dtype
        && layout.k == a.ne[0]
        && layout.rows == a.ne[1]
        && a.ne[2] == 1
        && a.ne[3] == 1
        && (a.ptr.0 as usize).is_multiple_of(std::mem::align_of::<Line>());
    if !fits {
        return Err(Error::shape(
            "quantized GEMM: stored panels do not fit this product",
        ));
    }
    mul_mat_from(
        isa,
        dst,
        a,
        Weights::Panels(a.ptr),
        b,
        (b.ne[2], b.ne[3]),
        scratch,
    )
}

/// [`mul_mat`] with q4_0 weights stored as nibble panels ([`nibbles`]): `a` describes the
/// plain 2-D matrix and points at the stored panels, which follow `layout`. The fused
/// kernel reads each panel as stored ([`nibbles::tile`]; elsewhere a task rebuilds and packs
/// it), with the bits of [`mul_mat`] on the plain rows.
pub fn mul_mat_nibbles(
    isa: Isa,
    dst: &RawTensor,
    a: &RawTensor,
    layout: &nibbles::NibbleLayout,
    b: &RawTensor,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let fits = a.dtype == DType::Q4_0
        && layout.k == a.ne[0]
        && layout.rows == a.ne[1]
        && a.ne[2] == 1
        && a.ne[3] == 1;
    if !fits {
        return Err(Error::shape(
            "quantized GEMM: stored nibble panels do not fit this product",
        ));
    }
    mul_mat_from(
        isa,
        dst,
        a,
        Weights::Nibbles(a.ptr, layout),
        b,
        (b.ne[2], b.ne[3]),
        scratch,
    )
}

/// [`mul_mat`], [`mul_mat_stored`] and [`mul_mat_nibbles`]: panels packed per task from `a`'s
/// rows (plain or interleaved), read as stored, or expanded from nibble panels.
fn mul_mat_from(
    isa: Isa,
    dst: &RawTensor,
    a: &RawTensor,
    weights: Weights<'_>,
    b: &RawTensor,
    (r2, r3): (usize, usize),
    scratch: &mut Vec<u8>,
) -> Result<()> {
    if !applies(a, dst) || b.ne[0] != a.ne[0] {
        return Err(Error::shape(
            "quantized GEMM: operands do not fit this path",
        ));
    }
    let (k, m, n) = (a.ne[0], a.ne[1], b.ne[1]);
    let (ne12, ne13) = (b.ne[2], b.ne[3]);
    let nb = k / QK;
    let affine_type = affine::AffineType::of(a.dtype);
    if affine_type.is_some()
        && (isa == Isa::Avx2 || matches!(weights, Weights::Panels(_) | Weights::Nibbles(..)))
    {
        return Err(Error::shape(format!(
            "quantized GEMM: {} weights need the VNNI or the portable kernel and plain rows",
            a.dtype
        )));
    }
    let row_bytes = act_row_bytes_for(isa, k);
    scratch.clear();
    scratch.resize(b.nrows() * row_bytes, 0);
    prepare_acts(isa, b, scratch, affine_type)?;
    let acts: &[u8] = scratch;
    // Nibble panels on the fused kernel: each activation block's offset term, once per row
    // (in parallel, as the rows were prepared).
    let fused = matches!(weights, Weights::Nibbles(..)) && nibbles::has_fused_tile(isa);
    let mut terms = vec![0i32; if fused { b.nrows() * nb } else { 0 }];
    super::par_rows_mut(
        &mut terms,
        nb,
        || (),
        |r, out, _| {
            nibbles::offset_terms(&acts[r * row_bytes..(r + 1) * row_bytes], k, out);
            Ok(())
        },
    )?;
    let terms: &[i32] = &terms;
    let a_row_bytes = a.dtype.row_size(k)?;
    let panels = m.div_ceil(PANEL);
    let col_blocks = n.div_ceil(COL_BLOCK);
    let cb = n.div_ceil(col_blocks.max(1)).next_multiple_of(COLS);
    let col_blocks = n.div_ceil(cb);
    let batches = ne12 * ne13;
    let tasks = batches * panels * col_blocks;
    let (r2, r3) = (r2.max(1), r3.max(1));
    // One range per thread: the panels stream the weights in order (MiniLM q8_0 1x16, 1x128,
    // 32x128 measured 1.7-2.5% faster than with four ranges per thread).
    par_ranges_streaming(tasks, 1, |range| {
        let mut buf = PANEL_BUF.with(RefCell::take);
        let mut plain = PLAIN_ROWS.with(RefCell::take);
        let mut out = [[0f32; PANEL]; COLS];
        for task in range {
            // Panels vary fastest: a thread's consecutive tasks share an activation block.
            let p = task % panels;
            let jb = (task / panels) % col_blocks;
            let batch = task / (col_blocks * panels);
            let (i12, i13) = (batch % ne12, batch / ne12);
            let (i02, i03) = (i12 / r2, i13 / r3);
            let i0 = p * PANEL;
            // The stored nibble panel the fused kernel reads (nibble weights only).
            let mut stored_panel: &[u8] = &[];
            let panel: &[Line] = match weights {
                // SAFETY: panel `p` of the stored matrix: `nb` packed blocks of 64-byte
                // aligned lines (`mul_mat_stored` checked the alignment and the layout),
                // read-only during the product.
                Weights::Panels(base) => unsafe {
                    let at = base.0.add(p * nb * PACKED_BLOCK);
                    std::slice::from_raw_parts(at.cast::<Line>(), nb * BLOCK_LINES)
                },
                Weights::Nibbles(base, layout) => {
                    // SAFETY: panel `p` of the stored matrix (`layout.stored_bytes()` bytes at
                    // `a`'s address, the caller's), read-only during the product.
                    let stored = unsafe {
                        std::slice::from_raw_parts(
                            base.0.add(p * layout.panel_bytes()).cast_const(),
                            layout.panel_bytes(),
                        )
                    };
                    if fused {
                        stored_panel = stored;
                    } else {
                        nibbles::expand_panel(isa, layout, p, stored, &mut plain, &mut buf);
                    }
                    &buf
                }
                Weights::Interleaved(layout) => {
                    let present = (m - i0).min(PANEL);
                    plain.resize(PANEL * a_row_bytes, 0);
                    // SAFETY: the whole matrix as stored (`layout.bytes()` bytes at `a`'s
                    // address, checked by `mul_mat`), read-only during the product.
                    let stored =
                        unsafe { std::slice::from_raw_parts(a.ptr.0.cast_const(), layout.bytes()) };
                    super::interleaved::plain_rows(layout, stored, i0..i0 + present, &mut plain);
                    let rows: [Option<&[u8]>; PANEL] = std::array::from_fn(|r| {
                        (r < present).then(|| &plain[r * a_row_bytes..(r + 1) * a_row_bytes])
                    });
                    pack_any(isa, a.dtype, affine_type, &rows, nb, &mut buf);
                    &buf
                }
                Weights::Plain => {
                    let rows: [Option<&[u8]>; PANEL] = std::array::from_fn(|r| {
                        (i0 + r < m).then(|| {
                            // SAFETY: weight row (i0 + r, i02, i03) lies inside `a`
                            // (read-only) and holds `a_row_bytes` bytes of adjacent blocks
                            // (`applies`).
                            unsafe {
                                std::slice::from_raw_parts(
                                    a.at(a.row_offset(i0 + r, i02, i03)).cast_const(),
                                    a_row_bytes,
                                )
                            }
                        })
                    });
                    pack_any(isa, a.dtype, affine_type, &rows, nb, &mut buf);
                    &buf
                }
            };
            let valid = (m - i0).min(PANEL);
            let cols = jb * cb..((jb + 1) * cb).min(n);
            for j0 in cols.clone().step_by(COLS) {
                let j1 = (j0 + COLS).min(cols.end);
                // The tile's activation rows, on the stack (no allocation per tile).
                let mut act_rows: [&[u8]; COLS] = [&[]; COLS];
                for (slot, j) in act_rows.iter_mut().zip(j0..j1) {
                    let r = j + n * (i12 + ne12 * i13);
                    *slot = &acts[r * row_bytes..(r + 1) * row_bytes];
                }
                if let Some(kt) = affine_type {
                    affine::run_tile(kt, isa, panel, &act_rows[..j1 - j0], k, &mut out);
                } else if fused {
                    let mut term_rows: [&[i32]; COLS] = [&[]; COLS];
                    for (slot, j) in term_rows.iter_mut().zip(j0..j1) {
                        let r = j + n * (i12 + ne12 * i13);
                        *slot = &terms[r * nb..(r + 1) * nb];
                    }
                    let (acts, terms) = (&act_rows[..j1 - j0], &term_rows[..j1 - j0]);
                    nibbles::tile(isa, stored_panel, acts, terms, k, &mut out);
                } else {
                    run_tile(isa, panel, &act_rows[..j1 - j0], k, &mut out);
                }
                for (c, j) in (j0..j1).enumerate() {
                    let base = dst.row_offset(j, i12, i13) + i0 * 4;
                    // SAFETY: output elements (i0..i0 + valid, j) of batch (i12, i13) lie
                    // inside `dst`, are contiguous f32 (`applies`) and belong to this task
                    // alone.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            out[c].as_ptr(),
                            dst.at(base).cast::<f32>(),
                            valid,
                        );
                    }
                }
            }
        }
        PANEL_BUF.with(|cell| cell.replace(buf));
        PLAIN_ROWS.with(|cell| cell.replace(plain));
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::values;

    /// The module's arithmetic written out directly from the plain blocks (no packing).
    fn reference(row: &[u8], src: Source, act: &[f32], k: usize) -> f32 {
        let mut prepared = vec![0u8; act_row_bytes(k)];
        prepare_row(act, &mut prepared);
        let mut acc = 0f32;
        for b in 0..k / QK {
            let (w, dw) = block_ints(src, row, b);
            let isum: i32 = (0..QK)
                .map(|j| i32::from(w[j]) * (i32::from(prepared[b * QK + j]) - 128))
                .sum();
            let da = f32::from_ne_bytes(prepared[k + 4 * b..k + 4 * b + 4].try_into().unwrap());
            acc = (isum as f32).mul_add(dw * da, acc);
        }
        acc
    }

    const SOURCES: [(DType, Source); 13] = [
        (DType::Q8_0, Source::Q8_0),
        (DType::Q4_0, Source::Q4_0),
        (DType::Q5_0, Source::Q5_0),
        (DType::IQ4_NL, Source::Iq4Nl),
        (DType::IQ4_XS, Source::Iq4Xs),
        (DType::TQ1_0, Source::Tq1_0),
        (DType::TQ2_0, Source::Tq2_0),
        (DType::MXFP4, Source::Mxfp4),
        (DType::Q1_0, Source::Q1_0),
        (DType::Q2_0, Source::Q2_0),
        (DType::IQ2_XXS, Source::Iq2Xxs),
        (DType::IQ3_XXS, Source::Iq3Xxs),
        (DType::IQ3_S, Source::Iq3S),
    ];

    #[test]
    fn every_source_is_listed_once_in_order() {
        for (i, src) in Source::ALL.iter().enumerate() {
            assert_eq!(Source::at(i as u8), *src);
            assert_eq!(
                SOURCES.iter().filter(|(_, s)| s == src).count(),
                1,
                "{src:?}"
            );
            let (dtype, _) = SOURCES.iter().find(|(_, s)| s == src).unwrap();
            assert_eq!(Source::of(*dtype), Some(*src));
        }
    }

    /// `n` reproducible bytes from `seed` (the high byte of a linear congruential stream):
    /// the raw material of the random weight rows here and in `affine`'s tests.
    pub(super) fn lcg_bytes(n: usize, seed: u32) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                (s >> 24) as u8
            })
            .collect()
    }

    /// `m` rows of `k` values of `dtype`: random bytes with sane scales (finite, small, both
    /// signs: f16 where the type has one, mxfp4's exponent byte near 1); q8_0's first row
    /// holds the extreme bytes −128 and 127.
    fn random_rows(dtype: DType, m: usize, k: usize, seed: u32) -> Vec<u8> {
        let row_bytes = dtype.row_size(k).unwrap();
        let block = dtype.type_size();
        let mut raw = lcg_bytes(m * row_bytes, seed);
        let scale_at = match dtype {
            DType::TQ1_0 => 52,
            DType::TQ2_0 => 64,
            _ => 0,
        };
        for (r, row) in raw.chunks_exact_mut(row_bytes).enumerate() {
            for (bi, blk) in row.chunks_exact_mut(block).enumerate() {
                if dtype == DType::MXFP4 {
                    blk[0] = 118 + ((r * 5 + bi) % 16) as u8;
                    continue;
                }
                let sign = if (r + bi) % 3 == 0 { -1.0 } else { 1.0 };
                let d = half::f16::from_f32(sign * (0.01 + 0.001 * (r * 3 + bi) as f32));
                blk[scale_at..scale_at + 2].copy_from_slice(&d.to_bits().to_ne_bytes());
                if dtype == DType::Q8_0 && r == 0 {
                    blk[2] = 0x80;
                    blk[3] = 0x7f;
                }
            }
        }
        raw
    }

    /// Each source's 32 bytes times its scale are the type's decoded values, bit for bit.
    #[test]
    fn block_ints_times_the_scale_are_the_decoded_values() {
        let k = 512;
        for (dtype, src) in SOURCES {
            let raw = random_rows(dtype, 3, k, 5);
            let mut want = vec![0f32; k];
            for row in raw.chunks_exact(dtype.row_size(k).unwrap()) {
                dtype.row_to_f32(row, &mut want).unwrap();
                for b in 0..k / QK {
                    let (w, d) = block_ints(src, row, b);
                    for j in 0..QK {
                        let got = d * f32::from(w[j]);
                        assert_eq!(
                            got.to_bits(),
                            want[b * QK + j].to_bits(),
                            "{dtype} b {b} j {j}"
                        );
                    }
                }
            }
        }
    }

    /// The SIMD quantizer gives the portable bits, including exact halves (rounded away from
    /// zero), saturation, zeros, subnormals, infinities and NaN.
    #[test]
    fn prepare_row_matches_the_portable_quantizer() {
        let mut x = values(32 * 40, 3);
        for (i, v) in x.iter_mut().enumerate().take(32 * 8) {
            *v *= 10f32.powi((i % 13) as i32 - 6);
        }
        // Block 8: amax 127 so d = 1 and the halves are exact ties.
        for (j, v) in x[32 * 8..32 * 9].iter_mut().enumerate() {
            *v = j as f32 - 15.5;
        }
        x[32 * 8] = 127.0;
        x[32 * 9..32 * 10].iter_mut().for_each(|v| *v = 0.0);
        x[32 * 10 + 3] = f32::NAN;
        x[32 * 11 + 5] = f32::INFINITY;
        x[32 * 12 + 7] = f32::NEG_INFINITY;
        x[32 * 13..32 * 14].iter_mut().for_each(|v| *v *= 1e-39);
        x[32 * 14..32 * 15].iter_mut().for_each(|v| *v *= 1e-44);
        x[32 * 15..32 * 16].iter_mut().for_each(|v| *v *= 3e38);
        let mut want = vec![0u8; act_row_bytes(x.len())];
        let mut got = want.clone();
        prepare_row_portable(&x, &mut want);
        prepare_row(&x, &mut got);
        let first_difference = got.iter().zip(&want).position(|(g, w)| g != w);
        assert_eq!(first_difference, None, "prepared bytes differ");
        // The portable layout is q8_0 offset by 128 with the f16 scale widened.
        let mut q8 = vec![0u8; 40 * Q8_0_BYTES];
        quantize_row_q8_0(&x, &mut q8);
        for b in 0..40 {
            let blk = &q8[b * Q8_0_BYTES..];
            for j in 0..QK {
                assert_eq!(want[b * QK + j], blk[2 + j] ^ 0x80);
            }
            let d = f16_bits_to_f32(u16::from_ne_bytes([blk[0], blk[1]]));
            let got_d = f32::from_ne_bytes(want[x.len() + 4 * b..][..4].try_into().unwrap());
            assert!(got_d.to_bits() == d.to_bits() || (got_d.is_nan() && d.is_nan()));
        }
    }

    /// Every kernel family agrees bit for bit with the written-out arithmetic, for every
    /// source type (q8_0 rows with extreme bytes −128 and 127), every column count and a
    /// partial panel.
    #[test]
    fn every_isa_matches_the_block_arithmetic_bit_for_bit() {
        let k = 256;
        let nb = k / QK;
        // 29 rows: the second half panel partly present; 11: the second half panel empty.
        for ((dtype, src), m) in SOURCES.iter().flat_map(|s| [(*s, 29), (*s, 11)]) {
            let raw = random_rows(dtype, m, k, 7);
            let row_bytes = dtype.row_size(k).unwrap();
            let rows: [Option<&[u8]>; PANEL] =
                std::array::from_fn(|r| (r < m).then(|| &raw[r * row_bytes..(r + 1) * row_bytes]));
            let mut portable = vec![Line([0; 64]); nb * BLOCK_LINES];
            pack_panel_portable(src, &rows, nb, &mut portable);
            let mut panel = Vec::new();
            for isa in Isa::available() {
                pack_panel(isa, dtype, &rows, nb, &mut panel);
                let same = panel.iter().zip(&portable).all(|(a, b)| a.0 == b.0);
                assert!(
                    same,
                    "{dtype} {isa:?}: packed panel differs from the portable one"
                );
            }
            // A panel of 32 present rows is packed over the previous contents (not cleared
            // first): every byte must be written.
            let full: [Option<&[u8]>; PANEL] =
                std::array::from_fn(|r| Some(&raw[(r % m) * row_bytes..(r % m + 1) * row_bytes]));
            let mut want = vec![Line([0; 64]); nb * BLOCK_LINES];
            pack_panel_portable(src, &full, nb, &mut want);
            for isa in Isa::available() {
                let mut stale = vec![Line([0xA5; 64]); nb * BLOCK_LINES];
                pack_panel(isa, dtype, &full, nb, &mut stale);
                assert!(
                    stale.iter().zip(&want).all(|(a, b)| a.0 == b.0),
                    "{dtype} {isa:?}: a full panel left stale bytes"
                );
            }
            let xs: Vec<Vec<f32>> = (0..COLS).map(|c| values(k, 11 + c as u32)).collect();
            for cols in 1..=COLS {
                for isa in Isa::available() {
                    let prepared: Vec<Vec<u8>> = xs[..cols]
                        .iter()
                        .map(|x| {
                            let mut p = vec![0u8; act_row_bytes_for(isa, k)];
                            prepare_row_for(isa, x, &mut p);
                            p
                        })
                        .collect();
                    let acts: Vec<&[u8]> = prepared.iter().map(|p| p.as_slice()).collect();
                    let mut out = [[0f32; PANEL]; COLS];
                    run_tile(isa, &panel, &acts, k, &mut out);
                    for c in 0..cols {
                        for r in 0..m {
                            let want = reference(rows[r].unwrap(), src, &xs[c], k);
                            assert_eq!(
                                out[c][r].to_bits(),
                                want.to_bits(),
                                "{dtype} {isa:?} cols {cols} c {c} r {r}: {} vs {want}",
                                out[c][r]
                            );
                        }
                    }
                }
            }
        }
    }
}
