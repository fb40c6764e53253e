//! The AVX2 kernels of the integer block products (see the parent module for the layout and
//! the arithmetic).
//!
//! AVX2 has no `vpdpbusd`. Its byte product `vpmaddubsw` adds pairs into saturating i16
//! lanes (offset activations up to 255 times weights down to −128 overflow), and the usual
//! sign trick around it costs three multiplier-port instructions per 32 products; on Zen 3
//! that measured no faster than the f32 GEMM. This kernel widens instead: weights to i16 as
//! they are loaded (`vpmovsxbw`, four rows by four `k`), activations to i16 once when they
//! are prepared, and `vpmaddwd` gives 16 exact products per instruction, summed in i32 with
//! no offset, so the block sums start at 0 rather than at the offset correction: the same
//! exact integers as the VNNI kernel's, hence the same f32 arithmetic and the same bits.

use super::{Line, Source, BLOCK_LINES, COLS, COMP_AT, PANEL, QK, SCALES_AT, STEPS};
use std::arch::x86_64::*;

/// Rows of one 256-bit vector of a packed line (four `k` each).
const ROWS: usize = 8;

/// Transposes eight rows of eight i32 (`r[i]` lane `j`) into `r[j]` lane `i`.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose8(r: &mut [__m256i; 8]) {
    let t: [__m256i; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[(i / 2) * 2], r[(i / 2) * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_epi32(a, b)
        } else {
            _mm256_unpackhi_epi32(a, b)
        }
    });
    // t[0] = r0/r1 interleaved (elements 0,1 | 4,5), t[1] = (2,3 | 6,7), t[2] = r2/r3 ...
    let u: [__m256i; 8] = std::array::from_fn(|i| {
        let pair = (i / 4) * 4 + (i % 2);
        let (a, b) = (t[pair], t[pair + 2]);
        if (i / 2) % 2 == 0 {
            _mm256_unpacklo_epi64(a, b)
        } else {
            _mm256_unpackhi_epi64(a, b)
        }
    });
    // u[0] = element 0 of r0..r3 | element 4; u[1] = element 2 | 6; u[2] = 1 | 5; u[3] = 3 | 7;
    // u[4..8] the same for r4..r7.
    let order = [0, 2, 1, 3];
    for (j, &q) in order.iter().enumerate() {
        r[j] = _mm256_permute2x128_si256::<0x20>(u[q], u[q + 4]);
        r[j + 4] = _mm256_permute2x128_si256::<0x31>(u[q], u[q + 4]);
    }
}

/// [`super::pack_panel`] with AVX2: each group of eight rows' 32 quants of a block is one
/// 8 × 8 transpose of 4-byte groups; the offset corrections' sums come from `vpmaddubsw` with
/// ones and the scales from F16C.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; every present row holds `nb` blocks of 32 of
/// `src`'s type and `out` holds `nb` zeroed packed blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn pack_panel(
    src: Source,
    rows: &[Option<&[u8]>; PANEL],
    nb: usize,
    out: &mut [Line],
) {
    // SAFETY: forwarded from the caller.
    unsafe { super::per_source!(src, pack_panel_of(rows, nb, out)) }
}

/// [`pack_panel`] for the source at index `S` ([`Source::at`]: each source its own packer).
///
/// # Safety
/// As [`pack_panel`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_panel_of<const S: u8>(rows: &[Option<&[u8]>; PANEL], nb: usize, out: &mut [Line]) {
    let src = const { Source::at(S) };
    let ones8 = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    for b in 0..nb {
        // SAFETY: packed block `b` exists in `out` (caller).
        let blk = unsafe { out.as_mut_ptr().add(b * BLOCK_LINES) }.cast::<u8>();
        for g in 0..PANEL / ROWS {
            let group = &rows[g * ROWS..(g + 1) * ROWS];
            if group.iter().all(Option::is_none) {
                continue;
            }
            let mut scales = [0f32; ROWS];
            let mut r = [_mm256_setzero_si256(); ROWS];
            load_row_blocks!(group, b, src, r, scales);
            transpose8(&mut r);
            // Line `v` holds rows 16v..16v + 16: this group is its low or high half.
            let (v, half) = (g / 2, (g % 2) * 32);
            let mut sum = _mm256_setzero_si256();
            for (s, &q) in r.iter().enumerate() {
                // SAFETY: each store writes 32 bytes of line `2s + v` of packed block `b`.
                unsafe { _mm256_storeu_si256(blk.add((s * 2 + v) * 64 + half).cast(), q) };
                sum = _mm256_add_epi32(
                    sum,
                    _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, q), ones16),
                );
            }
            let comp = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<7>(sum));
            // SAFETY: 8 scales and 8 corrections (32 bytes each) inside packed block `b`;
            // `scales` holds 8 f32.
            unsafe {
                let d = _mm256_loadu_ps(scales.as_ptr());
                _mm256_storeu_ps(blk.add(SCALES_AT + v * 64 + half).cast(), d);
                _mm256_storeu_si256(blk.add(COMP_AT + v * 64 + half).cast(), comp);
            }
        }
    }
}

/// The micro-kernel for `C` activation rows and the eight panel rows `8 q..8 q + 8`: 2·`C`
/// integer accumulators (two k-partial sums per row, joined by `vphaddd` once per block) and
/// `C` f32 accumulators in `vphaddd`'s row order (0, 1, 4, 5, 2, 3, 6, 7: its own inverse
/// permutation), written to `out[c][8 q..8 q + 8]`.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `panel` holds `k / 32` packed blocks and every `acts[c]`
/// (`c < C`) a wide prepared activation row of `k` elements (see [`super::act_row_bytes`]).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn part<const C: usize>(
    panel: &[Line],
    acts: &[&[u8]],
    k: usize,
    q: usize,
    out: &mut [[f32; PANEL]],
) {
    let nb = k / QK;
    debug_assert!(panel.len() >= nb * BLOCK_LINES && acts.len() >= C && out.len() >= C);
    let ap: [*const i16; C] = std::array::from_fn(|c| acts[c].as_ptr().cast());
    // Byte offset of this group of eight rows inside a line (and inside the scale lines).
    let at = (q / 2) * 64 + (q % 2) * 32;
    let order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    let mut accf = [_mm256_setzero_ps(); C];
    for b in 0..nb {
        // SAFETY: block `b` of the panel and elements `32 b .. 32 b + 32` and the scale of
        // block `b` (at byte `2 k + 4 b`) of every activation row exist (caller).
        unsafe {
            let blk = panel.as_ptr().add(b * BLOCK_LINES).cast::<u8>();
            let mut acci = [[_mm256_setzero_si256(); 2]; C];
            for s in 0..STEPS {
                let line = blk.add(s * 128 + at);
                // Rows 0-3 and 4-7 of the group, four k each, widened to i16.
                let w0 = _mm256_cvtepi8_epi16(_mm_load_si128(line.cast()));
                let w1 = _mm256_cvtepi8_epi16(_mm_load_si128(line.add(16).cast()));
                for c in 0..C {
                    // The four activations of step `s`, repeated for the four rows.
                    let x = ap[c].add(b * QK + 4 * s).cast::<i64>().read_unaligned();
                    let a = _mm256_set1_epi64x(x);
                    acci[c][0] = _mm256_add_epi32(acci[c][0], _mm256_madd_epi16(w0, a));
                    acci[c][1] = _mm256_add_epi32(acci[c][1], _mm256_madd_epi16(w1, a));
                }
            }
            let dw =
                _mm256_permutevar8x32_ps(_mm256_load_ps(blk.add(SCALES_AT + at).cast()), order);
            for c in 0..C {
                let scale = ap[c].cast::<u8>().add(2 * k + 4 * b).cast::<f32>();
                let da = _mm256_set1_ps(scale.read_unaligned());
                let isum = _mm256_hadd_epi32(acci[c][0], acci[c][1]);
                accf[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, da), accf[c]);
            }
        }
    }
    for c in 0..C {
        // SAFETY: `out[c]` holds 32 f32; lanes 8 q .. 8 q + 8.
        unsafe {
            let sums = _mm256_permutevar8x32_ps(accf[c], order);
            _mm256_storeu_ps(out[c].as_mut_ptr().add(8 * q), sums);
        }
    }
}

/// Columns per [`part`] call (its accumulators and operands fill the 16 vector registers).
const PART_COLS: usize = 6;

/// The AVX2 micro-tile: `out[c][r]` for panel row `r` and activation row `acts[c]`
/// (`acts.len()` in 1..=COLS), as [`part`] calls over the four groups of eight rows.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `panel` holds `k / 32` packed blocks (64-byte aligned
/// lines) and every `acts[c]` a wide prepared activation row of `k` elements.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn tile(panel: &[Line], acts: &[&[u8]], k: usize, out: &mut [[f32; PANEL]; COLS]) {
    for q in 0..PANEL / ROWS {
        for c0 in (0..acts.len()).step_by(PART_COLS) {
            let (a, o) = (&acts[c0..], &mut out[c0..]);
            // SAFETY: forwarded from the caller; `a` and `o` hold at least as many rows as
            // the chosen `C`.
            unsafe {
                match a.len().min(PART_COLS) {
                    1 => part::<1>(panel, a, k, q, o),
                    2 => part::<2>(panel, a, k, q, o),
                    3 => part::<3>(panel, a, k, q, o),
                    4 => part::<4>(panel, a, k, q, o),
                    5 => part::<5>(panel, a, k, q, o),
                    _ => part::<PART_COLS>(panel, a, k, q, o),
                }
            }
        }
    }
}
