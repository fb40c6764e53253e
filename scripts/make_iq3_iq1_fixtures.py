#!/usr/bin/env python3
"""Writes tests/data/iq3_iq1_blocks.bin, the reference data of the iq3_xxs, iq3_s, iq1_s and
iq1_m decoder tests (crates/base/src/quant/iq3/tests.rs, crates/base/src/quant/iq1/tests.rs).

Needs numpy and the `gguf` package (gguf-py). Run from the repository root:

    python scripts/make_iq3_iq1_fixtures.py

Per type: random super-blocks (every byte random, then the f16 super-block scale made
finite: normal, subnormal, zero, negative zero or large; iq1_m keeps its scale in the top
nibbles of its four scale words, so those nibbles are set to a finite f16's bits), plus one
block of all-ones bits and one of all-zero bits (scale 1.0), and their values as decoded by
`gguf.quants.dequantize`.

File layout (little-endian): magic b"IQF1", u32 section count, then per section: u32 ggml
type id, u32 super-block count n, u32 bytes per super-block, n super-blocks of bytes, then
n*256 f32 values.
"""

import struct

import numpy as np
from fixture_support import finite_f16_bits, write_sections
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

QK_K = 256
SEED = 20250301
BLOCKS = 16

TYPES = [(T.IQ3_XXS, 98), (T.IQ3_S, 110), (T.IQ1_S, 50), (T.IQ1_M, 56)]


def set_scale(qtype, block: np.ndarray, bits: int) -> None:
    if qtype == T.IQ1_M:
        # Nibble k of the f16 goes to the top nibble of scale word k (bytes 48 + 2k, +1).
        for k in range(4):
            at = 48 + 2 * k + 1
            block[at] = (block[at] & 0x0F) | (((bits >> (4 * k)) & 0xF) << 4)
    else:
        block[0] = bits & 0xFF
        block[1] = bits >> 8


def main() -> None:
    rng = np.random.default_rng(SEED)
    sections = []
    for qtype, size in TYPES:
        raw = rng.integers(0, 256, size=(BLOCKS, size), dtype=np.uint8)
        for b in range(BLOCKS):
            set_scale(qtype, raw[b], finite_f16_bits(rng))
        raw[0, :] = 0xFF
        raw[1, :] = 0x00
        for b in (0, 1):
            set_scale(qtype, raw[b], 0x3C00)  # 1.0
        values = dequantize(raw, qtype).astype(np.float32).reshape(-1)
        assert values.shape == (BLOCKS * QK_K,)
        assert np.all(np.isfinite(values))
        sec = struct.pack("<III", int(qtype), BLOCKS, size)
        sec += raw.tobytes() + values.astype("<f4").tobytes()
        sections.append(sec)
    write_sections("iq3_iq1_blocks.bin", b"IQF1", sections)


if __name__ == "__main__":
    main()
