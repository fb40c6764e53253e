#!/usr/bin/env python3
"""Writes tests/data/iq2_blocks.bin, the reference data of the iq2_xxs / iq2_xs / iq2_s codec
tests (crates/base/src/quant/iq2/tests.rs).

Needs numpy and the `gguf` package (gguf-py). Run from the repository root:

    python scripts/make_iq2_fixtures.py

Per type: random super-blocks (every byte random, then the f16 scale `d` at bytes 0..2
overwritten with a finite value: normal, subnormal, zero, negative zero or large), plus one
super-block of all-ones bytes and one of all-zero bytes (both with d = 1.0), and their values
as decoded by `gguf.quants.dequantize`.

File layout (little-endian): magic b"IQ2F", u32 section count, then per section: u32 ggml
type id, u32 super-block count n, u32 bytes per super-block, n super-blocks of bytes, then
n*256 f32 values.
"""

import struct

import numpy as np
from fixture_support import finite_f16_bits, write_sections
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

QK_K = 256
SEED = 20250302
BLOCKS = 40

TYPES = [(T.IQ2_XXS, 66), (T.IQ2_XS, 74), (T.IQ2_S, 82)]


def main() -> None:
    rng = np.random.default_rng(SEED)
    sections = []
    for qtype, size in TYPES:
        raw = rng.integers(0, 256, size=(BLOCKS, size), dtype=np.uint8)
        for b in range(BLOCKS):
            bits = finite_f16_bits(rng)
            raw[b, 0] = bits & 0xFF
            raw[b, 1] = bits >> 8
        # The largest sign and both extreme scale nibbles, the first grid point: all bits
        # set / all clear, d = 1.0; and every kind of d at least once.
        raw[0, :] = 0xFF
        raw[1, :] = 0x00
        for b in (0, 1):
            raw[b, 0], raw[b, 1] = 0x00, 0x3C
        for b, bits in zip(
            range(2, 8), (0x0000, 0x8000, 0x0001, 0x83FF, 0x7BFF, 0xFBFF), strict=True
        ):
            raw[b, 0], raw[b, 1] = bits & 0xFF, bits >> 8
        values = dequantize(raw, qtype).astype(np.float32).reshape(-1)
        assert values.shape == (BLOCKS * QK_K,)
        assert np.all(np.isfinite(values))
        sec = struct.pack("<III", int(qtype), BLOCKS, size)
        sec += raw.tobytes() + values.astype("<f4").tobytes()
        sections.append(sec)
    write_sections("iq2_blocks.bin", b"IQ2F", sections)


if __name__ == "__main__":
    main()
