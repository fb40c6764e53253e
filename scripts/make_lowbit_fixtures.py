#!/usr/bin/env python3
"""Writes tests/data/lowbit_blocks.bin, the reference data of the ternary / FP4 codec tests
(crates/base/src/quant/lowbit/tests.rs).

Needs numpy and the `gguf` package (gguf-py, 0.19 or later for NVFP4). Run from the
repository root:

    python scripts/make_lowbit_fixtures.py

Three kinds of section:

* kind 0, decoded: random blocks of tq1_0, tq2_0, mxfp4 and nvfp4 (every byte random, then
  the f16 scale fields of tq1_0/tq2_0 overwritten with finite values; the E8M0 and UE4M3
  scale bytes of mxfp4/nvfp4 are all finite, so they stay random) and their values as
  decoded by `gguf.quants.dequantize`.
* kind 1, quantized: random f32 rows (several magnitudes, an all-zero block, single
  outliers, an all-negative block, blocks whose largest magnitude sits just below a power
  of two, and tiny blocks) and the bytes `gguf.quants.quantize` makes of them, for the types
  gguf quantizes: tq1_0, tq2_0 and mxfp4.
* kind 2, ue4m3: f32 values and their UE4M3 bytes by gguf's `NVFP4.fp32_to_ue4m3` (the
  scale rounding of ggml's nvfp4 quantizer; gguf has no nvfp4 quantizer itself).

File layout (little-endian): magic b"LBF1", u32 section count, then per section: u32 kind,
u32 ggml type id, u32 block count n, u32 bytes per block, u32 values per block, then
* kind 0: n blocks of bytes, then n*values f32;
* kind 1: n*values f32, then n blocks of bytes;
* kind 2 (bytes = values = 1): n f32, then n bytes.
"""

import struct

import numpy as np
from fixture_support import finite_f16_bits, write_sections
from gguf import GGMLQuantizationType as T
from gguf.quants import NVFP4, dequantize, quantize

SEED = 20250817

# type, values per block, bytes per block, byte offset of its f16 scale (None: none)
DECODED = [
    (T.TQ1_0, 256, 54, 52),
    (T.TQ2_0, 256, 66, 64),
    (T.MXFP4, 32, 17, None),
    (T.NVFP4, 64, 36, None),
]
QUANTIZED = [(T.TQ1_0, 256, 54), (T.TQ2_0, 256, 66), (T.MXFP4, 32, 17)]


def decoded_section(rng, qtype, qk, size, f16_at, n) -> bytes:
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    raw[0, :] = 0xFF
    raw[1, :] = 0x00
    if f16_at is not None:
        for b in range(n):
            bits = 0x3C00 if b < 2 else finite_f16_bits(rng)
            raw[b, f16_at] = bits & 0xFF
            raw[b, f16_at + 1] = bits >> 8
    if qtype == T.MXFP4:
        # every exponent byte at least once
        raw[2:258, 0] = np.arange(256, dtype=np.uint8)
    if qtype == T.NVFP4:
        # every UE4M3 byte at least once
        raw[2:66, 0:4] = np.arange(256, dtype=np.uint8).reshape(64, 4)
    with np.errstate(over="ignore"):
        values = dequantize(raw, qtype).astype(np.float32).reshape(-1)
    assert values.shape == (n * qk,)
    # large E8M0 exponents times the level 12 overflow to infinity; never NaN
    assert not np.any(np.isnan(values))
    head = struct.pack("<IIIII", 0, int(qtype), n, size, qk)
    return head + raw.tobytes() + values.astype("<f4").tobytes()


def rows(rng, qk, n, tiny) -> np.ndarray:
    """n blocks of qk values of several kinds; tiny blocks (below 2^-120) only if `tiny`:
    ggml's ternary quantizers overflow 1/amax there (undefined behaviour in C)."""
    blocks = []
    for b in range(n):
        kind = b % 8
        if kind == 0:
            v = np.zeros(qk)
        elif kind == 1:
            v = np.zeros(qk)
            v[rng.integers(0, qk)] = rng.choice([-1, 1]) * rng.uniform(0.1, 1e4)
        elif kind == 2:
            v = -np.abs(rng.standard_normal(qk)) * rng.uniform(1e-3, 10)
        elif kind == 3:
            v = rng.standard_normal(qk) * 1e-3
            v[rng.integers(0, qk, 3)] *= 3000
        elif kind == 4:
            # largest magnitude a few f32 steps below a power of two
            v = rng.uniform(-1, 1, qk) * 0.5
            k = int(rng.integers(-20, 16))
            top = np.float32(2.0**k) * (np.float32(1) - np.float32(2**-24) * rng.integers(0, 60))
            v = v * 2.0**k
            v[rng.integers(0, qk)] = top * rng.choice([-1, 1])
        elif kind == 5 and tiny:
            # tiny: E8M0 exponents below the f32 normal range
            v = rng.standard_normal(qk) * 2.0 ** float(rng.integers(-140, -120))
        elif kind == 5 and not tiny:
            v = rng.standard_normal(qk) * 2.0 ** float(rng.integers(-30, 0))
        elif kind == 6:
            # exactly representable levels and midpoints
            v = rng.integers(-12, 13, qk) * 0.25
        else:
            v = rng.standard_normal(qk) * rng.choice([1e-2, 1.0, 100.0])
        blocks.append(v)
    return np.concatenate(blocks).astype(np.float32)


def quantized_section(rng, qtype, qk, size, n) -> bytes:
    x = rows(rng, qk, n, tiny=qtype == T.MXFP4)
    q = quantize(x.reshape(1, -1), qtype).reshape(-1)
    assert q.size == n * size
    head = struct.pack("<IIIII", 1, int(qtype), n, size, qk)
    return head + x.astype("<f4").tobytes() + q.astype(np.uint8).tobytes()


def ue4m3_section(rng) -> bytes:
    x = np.concatenate(
        [
            rng.uniform(0, 500, 400),
            np.exp2(rng.uniform(-14, 10, 600)),
            np.exp2(rng.integers(-12, 10, 100).astype(np.float64)),
            # the midpoints between adjacent codes, and a step either side
            np.array([(1 + (m + 0.5) / 8) * 2.0**e for e in range(-6, 9) for m in range(8)]),
            np.array([(m + 0.5) * 2.0**-9 for m in range(8)]),
            [0.0, -1.0, 448.0, 449.0, 1e30, 2.0**-130],
        ]
    ).astype(np.float32)
    x = np.concatenate([x, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(0))])
    b = NVFP4.fp32_to_ue4m3(x).astype(np.uint8)
    head = struct.pack("<IIIII", 2, int(T.NVFP4), x.size, 1, 1)
    return head + x.astype("<f4").tobytes() + b.tobytes()


def main() -> None:
    rng = np.random.default_rng(SEED)
    sections = []
    for qtype, qk, size, f16_at in DECODED:
        n = 300 if qtype in (T.MXFP4, T.NVFP4) else 40
        sections.append(decoded_section(rng, qtype, qk, size, f16_at, n))
    for qtype, qk, size in QUANTIZED:
        n = 400 if qtype == T.MXFP4 else 48
        sections.append(quantized_section(rng, qtype, qk, size, n))
    sections.append(ue4m3_section(rng))
    write_sections("lowbit_blocks.bin", b"LBF1", sections)


if __name__ == "__main__":
    main()
