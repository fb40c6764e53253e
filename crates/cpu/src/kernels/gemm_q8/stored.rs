//! q8_0 weight matrices kept as the integer GEMM's packed panels: the layout of the CPU's
//! repacking buffer type for q8_0 ([`crate::repack`]; q4_0 has its own, [`super::nibbles`]),
//! so a product reads the panels as stored instead of packing every panel on every call.
//!
//! # The layout
//!
//! A matrix of `rows` rows of `k` values (`nb = k / 32` blocks per row) is stored as
//! `⌈rows / 32⌉` panels of `nb` packed blocks each — exactly what the packers write for those
//! rows, with the rows past the last one zero — followed by every block's f16 scale as stored
//! in the file (`rows × nb` of them, row-major), so reads give back the exact plain bytes (an
//! f16 NaN's payload included, which the panels' f32 scales might not keep). Reads and writes
//! of any plain byte range go block by block: a block that a write covers only partly is
//! rebuilt, patched and packed again, so nothing can go stale.

use super::{pack_block, unpack_block_quants, Source, PACKED_BLOCK, PANEL, Q8_0_BYTES, QK};
use crate::dtype::DType;

/// The packed-panel layout of one q8_0 weight matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PanelLayout {
    /// Values per row (a multiple of 32).
    pub k: usize,
    /// Rows of the matrix.
    pub rows: usize,
}

impl PanelLayout {
    /// The layout of `rows` rows of `k` values of `dtype`, if the type is q8_0 and the rows
    /// are whole blocks.
    pub fn new(dtype: DType, k: usize, rows: usize) -> Option<PanelLayout> {
        (dtype == DType::Q8_0 && k > 0 && k.is_multiple_of(QK) && rows > 0)
            .then_some(PanelLayout { k, rows })
    }

    /// The matrix's block type.
    pub fn dtype(&self) -> DType {
        DType::Q8_0
    }

    fn nb(&self) -> usize {
        self.k / QK
    }

    fn block_bytes(&self) -> usize {
        Q8_0_BYTES
    }

    /// Bytes of the matrix stored plainly (what reads and writes address).
    pub fn plain_bytes(&self) -> usize {
        self.rows * self.nb() * self.block_bytes()
    }

    /// Bytes of one panel (`nb` packed blocks).
    pub fn panel_bytes(&self) -> usize {
        self.nb() * PACKED_BLOCK
    }

    fn panels_bytes(&self) -> usize {
        self.rows.div_ceil(PANEL) * self.panel_bytes()
    }

    /// Bytes the layout occupies: the panels, then the f16 scales.
    pub fn stored_bytes(&self) -> usize {
        self.panels_bytes() + self.rows * self.nb() * 2
    }

    /// The stored range of the packed block holding block `b` of `row`, and `row`'s lane in it.
    fn packed(&self, row: usize, b: usize) -> (std::ops::Range<usize>, usize) {
        let at = row / PANEL * self.panel_bytes() + b * PACKED_BLOCK;
        (at..at + PACKED_BLOCK, row % PANEL)
    }

    /// Where the file's f16 scale of block `b` of `row` is kept.
    fn scale_at(&self, row: usize, b: usize) -> std::ops::Range<usize> {
        let at = self.panels_bytes() + (row * self.nb() + b) * 2;
        at..at + 2
    }

    /// Packs the plain block `plain` as block `b` of `row`.
    fn store_block(&self, stored: &mut [u8], row: usize, b: usize, plain: &[u8]) {
        let (blk, lane) = self.packed(row, b);
        pack_block(Source::Q8_0, plain, 0, &mut stored[blk], lane);
        stored[self.scale_at(row, b)].copy_from_slice(&plain[..2]);
    }

    /// Rebuilds the plain bytes of block `b` of `row` into `out` (one block's bytes).
    fn load_block(&self, stored: &[u8], row: usize, b: usize, out: &mut [u8]) {
        let (blk, lane) = self.packed(row, b);
        unpack_block_quants(&stored[blk], lane, &mut out[2..]);
        out[..2].copy_from_slice(&stored[self.scale_at(row, b)]);
    }

    /// Calls `f(row, block, plain offset of the block, covered range inside the block)` for
    /// every block that the plain range `start..start + len` touches.
    fn blocks(
        &self,
        start: usize,
        len: usize,
        mut f: impl FnMut(usize, usize, usize, std::ops::Range<usize>),
    ) {
        let bb = self.block_bytes();
        let end = start + len;
        for blk in start / bb..end.div_ceil(bb) {
            let lo = blk * bb;
            let covered = start.max(lo) - lo..end.min(lo + bb) - lo;
            f(blk / self.nb(), blk % self.nb(), lo, covered);
        }
    }
}

/// Writes the plain bytes `data` at plain offset `start` of a matrix laid out by `layout`
/// whose stored bytes are `stored`.
///
/// # Panics
/// If the range exceeds the matrix or `stored` is shorter than the layout (callers check).
pub fn copy_in(layout: &PanelLayout, stored: &mut [u8], start: usize, data: &[u8]) {
    assert!(start + data.len() <= layout.plain_bytes() && stored.len() >= layout.stored_bytes());
    let bb = layout.block_bytes();
    layout.blocks(start, data.len(), |row, b, lo, covered| {
        let mut plain = [0u8; Q8_0_BYTES];
        let plain = &mut plain[..bb];
        if covered.len() < bb {
            layout.load_block(stored, row, b, plain);
        }
        let from = lo + covered.start - start;
        plain[covered.clone()].copy_from_slice(&data[from..from + covered.len()]);
        layout.store_block(stored, row, b, plain);
    });
}

/// Reads the plain bytes at plain offset `start` into `out` from a matrix laid out by
/// `layout` whose stored bytes are `stored`.
///
/// # Panics
/// As [`copy_in`].
pub fn copy_out(layout: &PanelLayout, stored: &[u8], start: usize, out: &mut [u8]) {
    assert!(start + out.len() <= layout.plain_bytes() && stored.len() >= layout.stored_bytes());
    let bb = layout.block_bytes();
    layout.blocks(start, out.len(), |row, b, lo, covered| {
        let mut plain = [0u8; Q8_0_BYTES];
        let plain = &mut plain[..bb];
        layout.load_block(stored, row, b, plain);
        let to = lo + covered.start - start;
        out[to..to + covered.len()].copy_from_slice(&plain[covered]);
    });
}

#[cfg(test)]
mod tests {
    use super::super::{pack_panel_portable, Line, BLOCK_LINES, PANEL};
    use super::*;
    use crate::kernels::testing::{bytes, check_range_mapping};

    #[test]
    fn panels_are_the_packers_and_ranges_map_exactly() {
        for (dtype, k, rows) in [
            (DType::Q8_0, 96, 29),
            (DType::Q8_0, 64, 70),
            (DType::Q8_0, 32, 1),
            (DType::Q8_0, 160, 32),
        ] {
            let layout = PanelLayout::new(dtype, k, rows).unwrap();
            let mut plain = bytes(layout.plain_bytes(), k as u32 + rows as u32);
            let bb = layout.block_bytes();
            // An f16 signalling NaN scale and an infinity must read back as written.
            plain[..2].copy_from_slice(&0x7C01u16.to_ne_bytes());
            if plain.len() >= 2 * bb {
                plain[bb..bb + 2].copy_from_slice(&0xFC00u16.to_ne_bytes());
            }
            let mut stored = vec![0u8; layout.stored_bytes()];
            copy_in(&layout, &mut stored, 0, &plain);
            // Each panel is what the portable packer makes of those rows.
            let nb = k / QK;
            let row_bytes = nb * bb;
            for p in 0..rows.div_ceil(PANEL) {
                let rows_of: [Option<&[u8]>; PANEL] = std::array::from_fn(|r| {
                    let row = p * PANEL + r;
                    (row < rows).then(|| &plain[row * row_bytes..(row + 1) * row_bytes])
                });
                let mut want = vec![Line([0; 64]); nb * BLOCK_LINES];
                pack_panel_portable(Source::of(dtype).unwrap(), &rows_of, nb, &mut want);
                let got = &stored[p * layout.panel_bytes()..(p + 1) * layout.panel_bytes()];
                let want: Vec<u8> = want.iter().flat_map(|l| l.0).collect();
                assert_eq!(got, &want[..], "{dtype} panel {p}");
            }
            check_range_mapping(
                &plain,
                bb,
                &mut stored,
                |st, at, data| copy_in(&layout, st, at, data),
                |st, at, out| copy_out(&layout, st, at, out),
            );
        }
    }

    #[test]
    fn only_whole_blocks_of_q8_0_have_panels() {
        assert!(PanelLayout::new(DType::Q8_0, 64, 3).is_some());
        assert!(PanelLayout::new(DType::Q8_0, 32, 1).is_some());
        assert!(PanelLayout::new(DType::Q4_0, 32, 1).is_none());
        assert!(PanelLayout::new(DType::Q8_0, 48, 3).is_none());
        assert!(PanelLayout::new(DType::Q4_1, 64, 3).is_none());
        assert!(PanelLayout::new(DType::Q8_0, 64, 0).is_none());
    }
}
