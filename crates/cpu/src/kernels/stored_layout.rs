//! The layouts in which the CPU's repacking buffer type stores weight matrices: one type over
//! the kernels' own layouts, with the plain and stored sizes and the exact byte mapping of
//! each.

use super::gemm_q8::nibbles::{self, NibbleLayout};
use super::gemm_q8::stored::{self as panels, PanelLayout};
use super::interleaved::{self, Layout};

/// How a weight matrix is laid out by the CPU's repacking buffer type (`crate::repack`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredLayout {
    /// q4_1 rows interleaved eight at a time (the same bytes, permuted).
    Interleaved(Layout),
    /// q8_0 rows as the integer GEMM's packed panels (more bytes than plain).
    Panels(PanelLayout),
    /// q4_0 rows as nibble panels (the same bytes, permuted; whole panels of 32 rows).
    Nibbles(NibbleLayout),
}

impl StoredLayout {
    /// Bytes of the tensor stored plainly: the range reads and writes address.
    pub fn plain_bytes(&self) -> usize {
        match self {
            StoredLayout::Interleaved(l) => l.bytes(),
            StoredLayout::Panels(l) => l.plain_bytes(),
            StoredLayout::Nibbles(l) => l.plain_bytes(),
        }
    }

    /// Bytes the layout occupies in the buffer (at least [`Self::plain_bytes`]).
    pub fn stored_bytes(&self) -> usize {
        match self {
            StoredLayout::Interleaved(l) => l.bytes(),
            StoredLayout::Panels(l) => l.stored_bytes(),
            StoredLayout::Nibbles(l) => l.stored_bytes(),
        }
    }

    /// Writes the plain bytes `data` at plain offset `start` into `stored`.
    pub fn copy_in(&self, stored: &mut [u8], start: usize, data: &[u8]) {
        match self {
            StoredLayout::Interleaved(l) => interleaved::copy_in(l, stored, start, data),
            StoredLayout::Panels(l) => panels::copy_in(l, stored, start, data),
            StoredLayout::Nibbles(l) => nibbles::copy_in(l, stored, start, data),
        }
    }

    /// Reads the plain bytes at plain offset `start` from `stored` into `out`.
    pub fn copy_out(&self, stored: &[u8], start: usize, out: &mut [u8]) {
        match self {
            StoredLayout::Interleaved(l) => interleaved::copy_out(l, stored, start, out),
            StoredLayout::Panels(l) => panels::copy_out(l, stored, start, out),
            StoredLayout::Nibbles(l) => nibbles::copy_out(l, stored, start, out),
        }
    }
}
