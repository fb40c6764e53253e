//! q4_0 weight matrices kept as nibble panels: the repacking buffer type's layout for q4_0
//! ([`crate::repack`]), a permutation of the plain bytes that the integer GEMM's fused VNNI
//! micro-kernel ([`tile`]) reads as stored — a few vector instructions per line separate the
//! nibbles — instead of gathering 32 rows side by side and transposing them on every call.
//! CPUs without that kernel rebuild a panel's plain rows and pack them ([`expand_panel`]).
//!
//! # The layout
//!
//! A matrix of `rows` rows of `k` values (`nb = k / 32` blocks per row) is stored as
//! `⌈rows / 32⌉` panels of `nb` stored blocks, each [`STORED_BLOCK`] bytes for the panel's 32
//! rows: eight lines of 64 bytes, line `2g + v` holding bytes `4g..4g + 4` of the 16 nibble
//! bytes of rows `16v..16v + 16` (row `16v + i` at bytes `4i..4i + 4`), then the 32 rows'
//! f16 scales as in the file. A line's low nibbles are values `4g..4g + 4` of its 16 rows, its
//! high nibbles values `16 + 4g..16 + 4g + 4`: each is one packed line of the GEMM once the
//! nibbles are separated and offset by −8. Rows past the matrix's last one are zero bytes.
//! The stored bytes are the plain bytes moved (plus that padding), so reads give back exactly
//! what was written, scales' NaN payloads included, and a write of any range moves its bytes
//! into place: nothing can go stale.

use super::{pack_any, Isa, Line, COLS, PANEL, QK};
use crate::dtype::DType;
use crate::kernels::quant_dot::Q4_0_BYTES;

/// Bytes of one stored block of a panel: the 32 rows' nibbles as eight lines, then their 32
/// f16 scales.
pub const STORED_BLOCK: usize = PANEL * Q4_0_BYTES;

/// Where a stored block's scales start.
const SCALES: usize = 8 * 64;

/// The nibble-panel layout of one q4_0 weight matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NibbleLayout {
    /// Values per row (a multiple of 32).
    pub k: usize,
    /// Rows of the matrix.
    pub rows: usize,
}

impl NibbleLayout {
    /// The layout of `rows` rows of `k` values of `dtype`, if the type is q4_0 and the rows
    /// are whole blocks.
    pub fn new(dtype: DType, k: usize, rows: usize) -> Option<NibbleLayout> {
        (dtype == DType::Q4_0 && k > 0 && k.is_multiple_of(QK) && rows > 0)
            .then_some(NibbleLayout { k, rows })
    }

    /// Blocks per row.
    pub fn nb(&self) -> usize {
        self.k / QK
    }

    /// Bytes of the matrix stored plainly (what reads and writes address).
    pub fn plain_bytes(&self) -> usize {
        self.rows * self.nb() * Q4_0_BYTES
    }

    /// Bytes of one panel (`nb` stored blocks).
    pub fn panel_bytes(&self) -> usize {
        self.nb() * STORED_BLOCK
    }

    /// Bytes the layout occupies (whole panels).
    pub fn stored_bytes(&self) -> usize {
        self.rows.div_ceil(PANEL) * self.panel_bytes()
    }

    /// The stored offset of byte `t` (0..18) of block `b` of `row`.
    fn stored_at(&self, row: usize, b: usize, t: usize) -> usize {
        let (p, lane) = (row / PANEL, row % PANEL);
        let base = p * self.panel_bytes() + b * STORED_BLOCK;
        if t < 2 {
            return base + SCALES + 2 * lane + t;
        }
        let j = t - 2;
        let (g, v, i) = (j / 4, lane / 16, lane % 16);
        base + (2 * g + v) * 64 + 4 * i + j % 4
    }

    /// Calls `f(plain offset, stored offset, length)` for runs of bytes that stay together
    /// in the plain range `start..start + len`: the scale and the four 4-byte groups of every
    /// block it touches (parts of them at its ends).
    fn runs(&self, start: usize, len: usize, mut f: impl FnMut(usize, usize, usize)) {
        const PIECES: [(usize, usize); 5] = [(0, 2), (2, 6), (6, 10), (10, 14), (14, 18)];
        let end = start + len;
        let nb = self.nb();
        for blk in start / Q4_0_BYTES..end.div_ceil(Q4_0_BYTES) {
            let lo = blk * Q4_0_BYTES;
            let (row, b) = (blk / nb, blk % nb);
            for (a, z) in PIECES {
                let (a, z) = ((lo + a).max(start), (lo + z).min(end));
                if a < z {
                    f(a, self.stored_at(row, b, a - lo), z - a);
                }
            }
        }
    }
}

/// Writes the plain bytes `data` at plain offset `start` of a matrix laid out by `layout`
/// whose stored bytes are `stored`.
///
/// # Panics
/// If the range exceeds the matrix or `stored` is shorter than the layout (callers check).
pub fn copy_in(layout: &NibbleLayout, stored: &mut [u8], start: usize, data: &[u8]) {
    assert!(start + data.len() <= layout.plain_bytes() && stored.len() >= layout.stored_bytes());
    layout.runs(start, data.len(), |at, to, n| {
        stored[to..to + n].copy_from_slice(&data[at - start..at - start + n]);
    });
}

/// Reads the plain bytes at plain offset `start` into `out` from a matrix laid out by
/// `layout` whose stored bytes are `stored`.
///
/// # Panics
/// As [`copy_in`].
pub fn copy_out(layout: &NibbleLayout, stored: &[u8], start: usize, out: &mut [u8]) {
    assert!(start + out.len() <= layout.plain_bytes() && stored.len() >= layout.stored_bytes());
    layout.runs(start, out.len(), |at, from, n| {
        out[at - start..at - start + n].copy_from_slice(&stored[from..from + n]);
    });
}

/// Panel `p` of a matrix stored in `layout` (`panel`: its [`NibbleLayout::panel_bytes`]
/// bytes) as the GEMM's packed panel in `out`: the panel's plain rows rebuilt into `plain`
/// and packed by the packer of `isa` (the kernels without a fused nibble kernel: AVX2 and
/// portable). A first version expanded the nibbles straight into packed lines on AVX-512; the
/// fused kernel ([`tile`]) replaced it (see DECISIONS).
pub(super) fn expand_panel(
    isa: Isa,
    layout: &NibbleLayout,
    p: usize,
    panel: &[u8],
    plain: &mut Vec<u8>,
    out: &mut Vec<Line>,
) {
    let nb = layout.nb();
    assert!(panel.len() >= layout.panel_bytes());
    let row_bytes = nb * Q4_0_BYTES;
    let present = (layout.rows - p * PANEL).min(PANEL);
    plain.resize(present * row_bytes, 0);
    for r in 0..present {
        for b in 0..nb {
            let block = &mut plain[r * row_bytes + b * Q4_0_BYTES..][..Q4_0_BYTES];
            for (t, byte) in block.iter_mut().enumerate() {
                *byte = panel[layout.stored_at(r, b, t)];
            }
        }
    }
    let rows: [Option<&[u8]>; PANEL] =
        std::array::from_fn(|r| (r < present).then(|| &plain[r * row_bytes..(r + 1) * row_bytes]));
    pack_any(isa, DType::Q4_0, None, &rows, nb, out);
}

/// For the fused kernel ([`tile`]): `−8 ·` the sum of each block's activation quants of the
/// prepared activation row `act` (`k` unsigned bytes `q + 128`, then the scales) into `out`,
/// one `i32` per block: the nibbles' offset, the integer sum's starting value.
pub(super) fn offset_terms(act: &[u8], k: usize, out: &mut [i32]) {
    for (term, block) in out.iter_mut().zip(act[..k].chunks_exact(QK)) {
        let sum: i32 = block.iter().map(|&u| i32::from(u) - 128).sum();
        *term = -8 * sum;
    }
}

/// Whether [`tile`] runs on `isa` (else the caller rebuilds and packs panels:
/// [`expand_panel`]).
pub(super) fn has_fused_tile(isa: Isa) -> bool {
    cfg!(target_arch = "x86_64") && isa == Isa::Vnni512
}

/// The fused micro-tile on a stored panel (`panel`: `nb` stored blocks) for the activation
/// rows `acts` (1..=[`COLS`] prepared rows, with their [`offset_terms`] in `terms`): the
/// nibbles are separated in registers and multiplied as unsigned bytes by the signed
/// activation quants, each block's sum starting from its offset term — the same exact
/// integers as the packed panel's kernel, scaled and accumulated by the same steps, so the
/// same bits, without writing the expanded panel. Only where [`has_fused_tile`] holds.
pub(super) fn tile(
    isa: Isa,
    panel: &[u8],
    acts: &[&[u8]],
    terms: &[&[i32]],
    k: usize,
    out: &mut [[f32; PANEL]; COLS],
) {
    let nb = k / QK;
    assert!(has_fused_tile(isa), "no fused nibble kernel on {isa:?}");
    assert!(!acts.is_empty() && acts.len() <= COLS && terms.len() == acts.len());
    assert!(panel.len() >= nb * STORED_BLOCK);
    assert!(acts.iter().all(|a| a.len() >= k + 4 * nb) && terms.iter().all(|t| t.len() >= nb));
    // SAFETY: `Vnni512` (asserted) is only chosen on CPUs with AVX-512F/BW/VNNI and F16C; the
    // sizes were checked above.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        x86::tile_nibbles(panel, acts, terms, k, out)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = out;
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::x86::{scale_block, store_tile};
    use super::super::{COLS, PANEL, QK};
    use super::{SCALES, STORED_BLOCK};
    use crate::kernels::simd::prefetch_ahead;
    use std::arch::x86_64::*;

    /// [`super::tile`] for `C` columns: per block and half panel, four stored lines give the
    /// eight lines of nibbles (low: values `4g..4g + 4`, high: `16 + 4g..`), each column's
    /// integer sums start from its block's offset term and take `vpdpbusd` of the nibbles by
    /// its signed quants (the prepared `q + 128` with the top bit flipped), then
    /// `fma(isum, dw · da, acc)` as the packed panel's kernel does.
    ///
    /// # Safety
    /// The CPU must support AVX-512F/BW/VNNI and F16C; `panel` holds `k / 32` stored blocks,
    /// every `acts[c]` a prepared activation row of `k` elements and every `terms[c]` its
    /// `k / 32` offset terms.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    unsafe fn tile_c<const C: usize>(
        panel: &[u8],
        acts: &[&[u8]],
        terms: &[&[i32]],
        k: usize,
        out: &mut [[f32; PANEL]; COLS],
    ) {
        let nb = k / QK;
        let low = _mm512_set1_epi8(0x0f);
        let ap: [*const u8; C] = std::array::from_fn(|c| acts[c].as_ptr());
        let tp: [*const i32; C] = std::array::from_fn(|c| terms[c].as_ptr());
        let mut accf = [[_mm512_setzero_ps(); 2]; C];
        for b in 0..nb {
            // SAFETY: stored block `b` of the panel, bytes `32 b .. 32 b + 32` and
            // `k + 4 b .. k + 4 b + 4` of every activation row and term `b` of every column
            // exist (the caller's contract).
            unsafe {
                let src = panel.as_ptr().add(b * STORED_BLOCK);
                prefetch_ahead(src, STORED_BLOCK);
                let mut acci: [[__m512i; 2]; C] = std::array::from_fn(|c| {
                    let t = _mm512_set1_epi32(tp[c].add(b).read_unaligned());
                    [t, t]
                });
                for g in 0..4 {
                    let x0 = _mm512_loadu_si512(src.add(2 * g * 64).cast());
                    let x1 = _mm512_loadu_si512(src.add((2 * g + 1) * 64).cast());
                    let lo0 = _mm512_and_si512(x0, low);
                    let lo1 = _mm512_and_si512(x1, low);
                    let hi0 = _mm512_and_si512(_mm512_srli_epi16::<4>(x0), low);
                    let hi1 = _mm512_and_si512(_mm512_srli_epi16::<4>(x1), low);
                    for c in 0..C {
                        let q = ap[c].add(b * QK + 4 * g).cast::<u32>();
                        let a_lo = _mm512_set1_epi32((q.read_unaligned() ^ 0x8080_8080) as i32);
                        let a_hi =
                            _mm512_set1_epi32((q.add(4).read_unaligned() ^ 0x8080_8080) as i32);
                        acci[c][0] = _mm512_dpbusd_epi32(acci[c][0], lo0, a_lo);
                        acci[c][1] = _mm512_dpbusd_epi32(acci[c][1], lo1, a_lo);
                        acci[c][0] = _mm512_dpbusd_epi32(acci[c][0], hi0, a_hi);
                        acci[c][1] = _mm512_dpbusd_epi32(acci[c][1], hi1, a_hi);
                    }
                }
                let dw0 = _mm512_cvtph_ps(_mm256_loadu_si256(src.add(SCALES).cast()));
                let dw1 = _mm512_cvtph_ps(_mm256_loadu_si256(src.add(SCALES + 32).cast()));
                scale_block(&mut accf, &acci, [dw0, dw1], &ap, k + 4 * b);
            }
        }
        // SAFETY: AVX-512F, which this function has.
        unsafe { store_tile(&accf, out) };
    }

    /// Dispatches [`tile_c`] on the column count (1..=COLS).
    ///
    /// # Safety
    /// As [`tile_c`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub(super) unsafe fn tile_nibbles(
        panel: &[u8],
        acts: &[&[u8]],
        terms: &[&[i32]],
        k: usize,
        out: &mut [[f32; PANEL]; COLS],
    ) {
        // SAFETY: forwarded from the caller.
        unsafe { per_cols!(acts.len(), tile_c(panel, acts, terms, k, out)) }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{pack_panel_portable, Source, BLOCK_LINES, PACKED_BLOCK};
    use super::*;
    use crate::kernels::testing::{bytes, check_range_mapping};

    /// Every ISA's expansion of every panel (rows rebuilt from the stored bytes, then packed)
    /// gives the portable packer's bytes for the panel's rows (a partial last panel: its
    /// rows' lanes), and any plain range reads back and writes exactly.
    #[test]
    fn expanded_panels_are_the_packers_and_ranges_map_exactly() {
        for (k, rows) in [(64usize, 70usize), (32, 1), (160, 32), (96, 45)] {
            let layout = NibbleLayout::new(DType::Q4_0, k, rows).unwrap();
            let mut plain = bytes(layout.plain_bytes(), k as u32 + rows as u32);
            // An f16 signalling NaN and infinities must read back as written.
            plain[..2].copy_from_slice(&0x7C01u16.to_ne_bytes());
            if plain.len() >= 2 * Q4_0_BYTES {
                plain[Q4_0_BYTES..Q4_0_BYTES + 2].copy_from_slice(&0xFC00u16.to_ne_bytes());
            }
            let mut stored = vec![0u8; layout.stored_bytes()];
            copy_in(&layout, &mut stored, 0, &plain);
            let nb = layout.nb();
            let row_bytes = nb * Q4_0_BYTES;
            for p in 0..rows.div_ceil(PANEL) {
                let present = (rows - p * PANEL).min(PANEL);
                let rows_of: [Option<&[u8]>; PANEL] = std::array::from_fn(|r| {
                    let row = p * PANEL + r;
                    (r < present).then(|| &plain[row * row_bytes..(row + 1) * row_bytes])
                });
                let mut want = vec![Line([0; 64]); nb * BLOCK_LINES];
                pack_panel_portable(Source::Q4_0, &rows_of, nb, &mut want);
                let panel = &stored[p * layout.panel_bytes()..(p + 1) * layout.panel_bytes()];
                for isa in Isa::available() {
                    let mut got = Vec::new();
                    expand_panel(isa, &layout, p, panel, &mut Vec::new(), &mut got);
                    assert_eq!(got.len(), want.len());
                    for b in 0..nb {
                        let (g, w) = (&got[b * BLOCK_LINES..], &want[b * BLOCK_LINES..]);
                        for line in 0..BLOCK_LINES {
                            for lane in 0..present {
                                // every line of a packed block (quants, scales,
                                // corrections) belongs to the rows of half `line % 2`
                                let (v, i) = (lane / 16, lane % 16);
                                if line % 2 != v {
                                    continue;
                                }
                                let word = |l: &Line| {
                                    u32::from_ne_bytes(l.0[4 * i..4 * i + 4].try_into().unwrap())
                                };
                                let (gw, ww) = (word(&g[line]), word(&w[line]));
                                // F16C quiets a signalling NaN scale, the portable
                                // conversion keeps it: either is a NaN scale.
                                let nan = |x: u32| f32::from_bits(x).is_nan();
                                let scale_line = line / 2 == super::super::STEPS;
                                assert!(
                                    gw == ww || (scale_line && nan(gw) && nan(ww)),
                                    "{isa:?} k {k} rows {rows} panel {p} block {b} line {line} \
                                     row {lane}: {gw:#x} vs {ww:#x}"
                                );
                            }
                        }
                    }
                }
            }
            assert_eq!(PACKED_BLOCK, BLOCK_LINES * 64);
            check_range_mapping(
                &plain,
                Q4_0_BYTES,
                &mut stored,
                |st, at, data| copy_in(&layout, st, at, data),
                |st, at, out| copy_out(&layout, st, at, out),
            );
        }
    }

    #[test]
    fn only_whole_q4_0_blocks_have_nibble_panels() {
        assert!(NibbleLayout::new(DType::Q4_0, 32, 1).is_some());
        assert!(NibbleLayout::new(DType::Q4_0, 48, 3).is_none());
        assert!(NibbleLayout::new(DType::Q8_0, 64, 3).is_none());
        assert!(NibbleLayout::new(DType::Q4_0, 64, 0).is_none());
    }
}
