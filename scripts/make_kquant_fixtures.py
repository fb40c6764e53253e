#!/usr/bin/env python3
"""Writes tests/data/kquant_blocks.bin, the reference data of the K-quant codec tests
(crates/base/src/quant/kquants/tests.rs), and, given ggml's shared library, also
tests/data/kquant_ggml_quantized.bin.

Needs numpy and the `gguf` package (gguf-py). Run from the repository root:

    python scripts/make_kquant_fixtures.py [--ggml-lib path/to/libggml-base.so]

With --ggml-lib (any build of ggml's base library, e.g. the one llama-cpp-python builds;
one compiled without FMA contraction, as its generic x86-64 build is), the second file holds
f32 rows and the bytes ggml's reference quantizers (`quantize_row_*_ref`) make of them, for
q2_K, q3_K, q4_K, q5_K, q6_K, q8_K and iq4_xs: u32 value count n, n f32 values, then per type
(in that order) n/256 super-blocks.

For q2_K, q3_K, q4_K, q5_K, q6_K and iq4_xs: random super-blocks (every byte random, then
the f16 scale fields overwritten with finite values: normal, subnormal, zero, negative
zero, large) and their values as decoded by `gguf.quants.dequantize`. For q8_K: random f32
rows (including an all-zero super-block and single outliers) and their q8_K bytes by a
numpy restatement of ggml's `quantize_row_q8_K_ref` (f32 arithmetic throughout).

File layout (little-endian): magic b"KQF1", u32 section count, then per section: u32 ggml
type id, u32 super-block count n, u32 bytes per super-block, and then
* for the decoded types: n super-blocks of bytes, then n*256 f32 values;
* for q8_K (type 15): n*256 f32 input values, then n super-blocks of bytes.
"""

import argparse
import ctypes
import struct

import numpy as np
from fixture_support import finite_f16_bits, write_sections
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

QK_K = 256
SEED = 20240611
BLOCKS = 6

# type, bytes per super-block, byte offsets of its f16 fields
DECODED = [
    (T.Q2_K, 84, [80, 82]),
    (T.Q3_K, 110, [108]),
    (T.Q4_K, 144, [0, 2]),
    (T.Q5_K, 176, [0, 2]),
    (T.Q6_K, 210, [208]),
    (T.IQ4_XS, 136, [0]),
]


def q8_k_ref(x: np.ndarray) -> bytes:
    """ggml's quantize_row_q8_K_ref for one super-block, in float32."""
    x = x.astype(np.float32)
    ax = np.abs(x)
    amax = ax.max()
    if amax == 0:
        return bytes(4 + QK_K + 32)
    mx = x[int(np.argmax(ax))]  # the first of the largest magnitudes
    iscale = np.float32(-127.0) / mx
    v = (iscale * x).astype(np.float32) + np.float32(12582912.0)
    q = (v.view(np.int32) & 0x007FFFFF) - 0x00400000
    q = np.minimum(127, q).astype(np.int8)
    bsums = q.astype(np.int32).reshape(16, 16).sum(axis=1).astype(np.int16)
    d = np.float32(1.0) / iscale
    return d.astype("<f4").tobytes() + q.tobytes() + bsums.astype("<i2").tobytes()


QUANTIZED = [
    ("q2_K", 84),
    ("q3_K", 110),
    ("q4_K", 144),
    ("q5_K", 176),
    ("q6_K", 210),
    ("q8_K", 292),
    ("iq4_xs", 136),
]


def ggml_quantized(lib_path: str) -> bytes:
    """Rows of several kinds and ggml's reference quantizations of them."""
    lib = ctypes.CDLL(lib_path)
    rng = np.random.default_rng(SEED + 1)
    rows = [
        0.1 + 2 * np.cos(np.arange(1024) + 0.5),  # ggml's synthetic row
        rng.standard_normal(1024),
        rng.uniform(-1, 1, 1024) * 50,
    ]
    spiky = rng.standard_normal(512) * 1e-3
    spiky[::97] *= 3000
    rows.append(spiky)
    mixed = np.zeros(512)
    mixed[300] = 5.0  # a single outlier in an otherwise empty super-block
    mixed[256 + 3] = -7.25
    mixed[256 + 100 : 256 + 140] = rng.standard_normal(40) * 1e-3
    rows.append(mixed)
    x = np.concatenate(rows).astype(np.float32)
    out = bytearray(struct.pack("<I", x.size)) + x.astype("<f4").tobytes()
    for name, size in QUANTIZED:
        buf = ctypes.create_string_buffer(x.size // QK_K * size)
        f = getattr(lib, f"quantize_row_{name}_ref")
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        f(x.ctypes.data, buf, x.size)
        out += buf.raw
    return bytes(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ggml-lib", help="ggml's base shared library (libggml-base.so)")
    args = parser.parse_args()
    rng = np.random.default_rng(SEED)
    sections = []
    for qtype, size, f16_fields in DECODED:
        raw = rng.integers(0, 256, size=(BLOCKS, size), dtype=np.uint8)
        for b in range(BLOCKS):
            for at in f16_fields:
                bits = finite_f16_bits(rng)
                raw[b, at] = bits & 0xFF
                raw[b, at + 1] = bits >> 8
        # A few whole-block extremes: all quant/scale bits set, all clear.
        raw[0, :] = 0xFF
        raw[1, :] = 0x00
        for b in (0, 1):
            for at in f16_fields:
                raw[b, at] = 0x00
                raw[b, at + 1] = 0x3C  # 1.0
        values = dequantize(raw, qtype).astype(np.float32).reshape(-1)
        assert values.shape == (BLOCKS * QK_K,)
        assert np.all(np.isfinite(values))
        sec = struct.pack("<III", int(qtype), BLOCKS, size)
        sec += raw.tobytes() + values.astype("<f4").tobytes()
        sections.append(sec)

    # q8_K: random rows of a few magnitudes, one all-zero super-block, single outliers.
    n = 5
    x = (rng.standard_normal(n * QK_K) * rng.choice([1e-3, 1.0, 40.0], size=n * QK_K)).astype(
        np.float32
    )
    x[QK_K : 2 * QK_K] = 0.0
    x[2 * QK_K : 3 * QK_K] = 0.0
    x[2 * QK_K + 17] = -3.5
    x[3 * QK_K + 200] = 1e4
    q8 = b"".join(q8_k_ref(x[i * QK_K : (i + 1) * QK_K]) for i in range(n))
    sections.append(struct.pack("<III", int(T.Q8_K), n, 292) + x.astype("<f4").tobytes() + q8)

    path = write_sections("kquant_blocks.bin", b"KQF1", sections)
    if args.ggml_lib:
        data = ggml_quantized(args.ggml_lib)
        path = path.parent / "kquant_ggml_quantized.bin"
        path.write_bytes(data)
        print(f"wrote {path} ({len(data)} bytes)")


if __name__ == "__main__":
    main()
