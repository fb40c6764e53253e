"""Writes ``tests/data/legacy_blocks.bin``: reference bytes and values for the 32-value block
types q4_1, q5_0, q5_1, q8_1 and iq4_nl, which ``crates/base/src/quant/legacy.rs`` compares
against bit for bit. Run once from the repository root and commit the output::

    /path/to/venv/bin/python scripts/make_block_fixtures.py

Needs numpy and the ``gguf`` package (gguf-py). The output is deterministic for a given gguf
version (0.19.0 made the committed file).

Where the references come from:

* q4_1, q5_0, q5_1: ``gguf.quants.quantize`` (f32 -> bytes) and ``gguf.quants.dequantize``
  (bytes -> f32).
* iq4_nl: gguf only decodes it, so there are decode cases only (random bytes).
* q8_1: gguf implements neither direction (and its size table still lists the old 40-byte
  layout with f32 scales). Its ``d`` and quants equal q8_0's under ggml's reference rules, so
  they come from gguf's Q8_0 quantizer; ``s`` (the f16 of ``sum(q) * d`` with ``d`` the f32
  scale before rounding) and the decoded values (``q * f16(d)``) are computed here with numpy
  float32 arithmetic.

With ``--ggml-lib PATH/libggml-base.so`` (a build of ggml's C library), the file also holds
encode cases computed by ggml itself: ``quantize_iq4_nl`` without importance weights (the scale
search) and ``quantize_row_q8_1_ref``, plus q4_1/q5_0/q5_1 from their ``_ref`` quantizers. The
committed file was made with such a build (ggml 0.25.3, loaded with ctypes), and the Rust test
expects these cases; without the option they are left out (and that test's case count fails).

File layout (little-endian)::

    b"FGLB", u32 version (1), u32 case count, then per case:
    u8 ggml type id, u8 kind, u16 zero, u32 block count n, then
      kind 0 (quantize): f32 x[32 n], u8 bytes[n * size], f32 decoded[32 n]
      kind 1 (decode):   u8 bytes[n * size], f32 decoded[32 n]
      kind 2 (quantize, ggml's C library): as kind 0
"""

from __future__ import annotations

import argparse
import ctypes
import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "legacy_blocks.bin"

# ggml type id, bytes per block of 32 values.
SIZES = {T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24, T.Q8_1: 36, T.IQ4_NL: 18}


def edge_blocks() -> np.ndarray:
    """Blocks that exercise the quantizers' rules: zeros, one outlier, a negative extreme,
    ties, values on half steps, constant blocks, subnormal and large scales."""
    b = np.zeros((12, 32), dtype=np.float32)
    # 0: all zero.
    b[1, 7] = 1000.0  # 1: a single positive outlier.
    b[2, :] = 0.25  # 2: negative extreme with small positives.
    b[2, 20] = -6.5
    b[3, :] = np.linspace(-1.0, 1.0, 32, dtype=np.float32)  # 3: symmetric ramp
    b[3, 31] = 1.0  # (+1 and -1 tie for the largest magnitude; -1 comes first)
    b[4, :] = np.arange(32, dtype=np.float32) * 0.5 - 8.0  # 4: half steps
    b[5, :] = 3.0  # 5: constant block (d = 0 for the min/max types)
    b[6, :] = -(2.0**-30) * np.arange(32, dtype=np.float32)  # 6: scale below f16's normals
    b[7, :] = np.float32(6e4) * np.sin(np.arange(32, dtype=np.float32))  # 7: large values
    b[8, ::2] = 1.0  # 8: two levels
    b[8, 1::2] = -1.0
    b[9, :] = np.float32(7.5) * (np.arange(32) % 3 - 1)  # 9: exact multiples
    b[10, 0] = -1.0  # 10: a single negative outlier at index 0, a positive one later
    b[10, 17] = 1.0
    b[11, :] = np.arange(32, dtype=np.float32) ** 2 / 31.0  # 11: skewed positive values
    return b


def random_blocks(rng: np.random.Generator, n: int) -> np.ndarray:
    scales = np.float32(2.0) ** rng.integers(-12, 8, size=(n, 1)).astype(np.float32)
    return (rng.standard_normal((n, 32)).astype(np.float32) * scales).astype(np.float32)


def random_bytes(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """Random block bytes: every quant byte pattern; scales mostly finite f16 values of
    moderate size, some arbitrary bit patterns (incl. subnormals, inf and NaN)."""
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    n_scales = 2 if size in (20, 24, 36) else 1
    for i in range(n):
        for s in range(n_scales):
            if i % 4 == 3:
                continue  # keep the random bit pattern
            v = np.float16(rng.standard_normal() * 2.0 ** int(rng.integers(-14, 6)))
            raw[i, 2 * s : 2 * s + 2] = np.frombuffer(v.tobytes(), dtype=np.uint8)
    # A few hand-picked scale patterns: +0, -0, smallest subnormal, largest normal, +inf, NaN.
    for i, bits in enumerate([0x0000, 0x8000, 0x0001, 0x7BFF, 0x7C00, 0x7E01]):
        if i < n:
            raw[i, 0:2] = np.frombuffer(np.uint16(bits).tobytes(), dtype=np.uint8)
    return raw


def q8_1_quantize(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_1_ref: q8_0's d and quants, plus s = f16(sum(q) * d)."""
    q8_0 = quants.quantize(x, T.Q8_0).reshape(-1, 34)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    qs = q8_0[:, 2:].view(np.int8)
    total = qs.astype(np.int32).sum(axis=-1, keepdims=True).astype(np.float32)
    s = (total * d).astype(np.float16).view(np.uint8)
    return np.concatenate([q8_0[:, :2], s, q8_0[:, 2:]], axis=-1)


def q8_1_decode(raw: np.ndarray) -> np.ndarray:
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
    qs = raw[:, 4:].view(np.int8).astype(np.float32)
    return (qs * d).astype(np.float32)


def decode(raw: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.Q8_1:
        return q8_1_decode(raw)
    return quants.dequantize(raw.reshape(-1), qtype).reshape(-1, 32)


def ggml_quantize(lib: ctypes.CDLL, qtype: T, x: np.ndarray) -> np.ndarray:
    """Quantizes whole rows of 32 with ggml's own C functions."""
    size = SIZES[qtype]
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], size), dtype=np.uint8)
    src = x.ctypes.data_as(ctypes.c_void_p)
    dst = out.ctypes.data_as(ctypes.c_void_p)
    if qtype == T.IQ4_NL:
        f = lib.quantize_iq4_nl
        f.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
        ]
        f.restype = ctypes.c_size_t
        f(src, dst, x.shape[0], 32, None)
    else:
        name = {T.Q4_1: "q4_1", T.Q5_0: "q5_0", T.Q5_1: "q5_1", T.Q8_1: "q8_1"}[qtype]
        f = getattr(lib, f"quantize_row_{name}_ref")
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        f.restype = None
        f(src, dst, x.size)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ggml-lib", help="path of libggml-base.so for encode cases from ggml")
    args = parser.parse_args()
    rng = np.random.default_rng(20240601)
    cases: list[bytes] = []
    with np.errstate(over="ignore", invalid="ignore"):
        for qtype, size in SIZES.items():
            if qtype != T.IQ4_NL:
                x = np.concatenate([edge_blocks(), random_blocks(rng, 8)]).astype(np.float32)
                if qtype == T.Q8_1:
                    raw = q8_1_quantize(x)
                else:
                    raw = quants.quantize(x, qtype).reshape(-1, size)
                y = decode(raw, qtype)
                head = struct.pack("<BBHI", int(qtype), 0, 0, x.shape[0])
                cases.append(head + x.tobytes() + raw.tobytes() + y.astype("<f4").tobytes())
            raw = random_bytes(rng, 16, size)
            y = decode(raw, qtype)
            head = struct.pack("<BBHI", int(qtype), 1, 0, raw.shape[0])
            cases.append(head + raw.tobytes() + y.astype("<f4").tobytes())
        if args.ggml_lib:
            lib = ctypes.CDLL(args.ggml_lib)
            for qtype in SIZES:
                n = 36 if qtype == T.IQ4_NL else 4
                x = np.concatenate([edge_blocks(), random_blocks(rng, n)]).astype(np.float32)
                raw = ggml_quantize(lib, qtype, x)
                y = decode(raw, qtype)
                head = struct.pack("<BBHI", int(qtype), 2, 0, x.shape[0])
                cases.append(head + x.tobytes() + raw.tobytes() + y.astype("<f4").tobytes())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_bytes(b"FGLB" + struct.pack("<II", 1, len(cases)) + b"".join(cases))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(cases)} cases)")


if __name__ == "__main__":
    main()
