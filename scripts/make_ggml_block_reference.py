"""Writes tests/python/data/ggml_block_types.npz: what ggml itself computes for its block types,
for the tests of ferrograph's codecs and dot products that run without ggml.

ggml is the build inside llama-cpp-python (``pip install llama-cpp-python``, which compiles
llama.cpp; its ``lib/`` holds ``libggml-base.so`` and ``libggml-cpu.so``). Through ctypes, for
every type in ``TYPES``:

* ``<type>.blocks``: random blocks (every byte random, then the scale fields made finite) and
  ``<type>.decoded``: ggml's ``dequantize_row_<type>`` of them;
* ``<type>.act``: the activation row in the type's partner format (ggml's ``quantize_row_q8_K``
  or ``quantize_row_q8_0`` of random values) and ``<type>.dot``: ggml's CPU ``vec_dot`` of one
  weight row with it (float32; ggml's own SIMD kernel for this CPU);
* for types ggml quantizes, ``<type>.x``: f32 rows (a synthetic row, normal values, an empty
  block, outliers) and ``<type>.quantized``: ggml's ``quantize_row_<type>_ref`` bytes.

Run from the repository root: ``python scripts/make_ggml_block_reference.py``.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "python" / "data" / "ggml_block_types.npz"
SEED = 20261127

# name: (ggml id, values per block, bytes per block, partner, quantized here, scale fields): the
# i-quants below 4 bits are only decoded and multiplied (ferrograph has no quantizer for them).
# scale fields: ("f16", byte offset) for an f16 scale, ("e8m0", byte offset) for a power-of-two
# exponent (moderate ones here; the extremes are in "mxfp4.edge_*"), ("iq1_m",) for iq1_m's f16.
TYPES: dict[str, tuple[int, int, int, str, bool, tuple]] = {
    "iq2_xxs": (16, 256, 66, "q8_K", False, (("f16", 0),)),
    "iq2_xs": (17, 256, 74, "q8_K", False, (("f16", 0),)),
    "iq3_xxs": (18, 256, 98, "q8_K", False, (("f16", 0),)),
    "iq1_s": (19, 256, 50, "q8_K", False, (("f16", 0),)),
    "iq3_s": (21, 256, 110, "q8_K", False, (("f16", 0),)),
    "iq2_s": (22, 256, 82, "q8_K", False, (("f16", 0),)),
    "iq1_m": (29, 256, 56, "q8_K", False, (("iq1_m",),)),
    "tq1_0": (34, 256, 54, "q8_K", True, (("f16", 52),)),
    "tq2_0": (35, 256, 66, "q8_K", True, (("f16", 64),)),
    "mxfp4": (39, 32, 17, "q8_0", True, (("e8m0", 0),)),
    "nvfp4": (40, 64, 36, "q8_0", True, ()),
    "q1_0": (41, 128, 18, "q8_0", True, (("f16", 0),)),
    "q2_0": (42, 64, 18, "q8_0", True, (("f16", 0),)),
}
ROW = 1024  # values per row: 4 super-blocks of 256, 8 blocks of 128, ...
ROWS = 3


def finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 scales: mostly moderate, some subnormal, zero, negative zero, large."""
    out = rng.uniform(-0.05, 0.05, n).astype(np.float16)
    kind = rng.integers(0, 12, n)
    out[kind == 0] = np.float16(3e-6)
    out[kind == 1] = np.float16(0.0)
    out[kind == 2] = np.float16(-0.0)
    out[kind == 3] = np.float16(1.5)
    return out


def random_blocks(rng: np.random.Generator, name: str, n_blocks: int) -> np.ndarray:
    _, _, size, _, _, fields = TYPES[name]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for field in fields:
        bits = finite_f16(rng, n_blocks).view(np.uint16)
        if field[0] == "e8m0":
            raw[:, field[1]] = rng.integers(112, 136, n_blocks).astype(np.uint8)
        elif field[0] == "f16":
            raw[:, field[1]] = (bits & 0xFF).astype(np.uint8)
            raw[:, field[1] + 1] = (bits >> 8).astype(np.uint8)
        else:  # iq1_m: nibble i of the f16 is the top nibble of scale word i (last 8 bytes)
            for i in range(4):
                nibble = ((bits >> (4 * i)) & 0xF).astype(np.uint8)
                at = size - 8 + 2 * i + 1
                raw[:, at] = (raw[:, at] & 0x0F) | (nibble << 4)
    return raw


def rows_to_quantize(rng: np.random.Generator) -> np.ndarray:
    x = np.stack(
        [
            0.1 + 2 * np.cos(np.arange(ROW) + 0.5),
            rng.standard_normal(ROW) * 0.3,
            rng.uniform(-1, 1, ROW) * 40,
        ]
    ).astype(np.float32)
    x[1, :256] = 0.0  # an empty super-block
    x[2, 300] = 900.0  # an outlier
    x[2, 700:760] = -np.abs(x[2, 700:760])  # all negative
    return x


def main() -> None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise SystemExit("needs llama-cpp-python (pip install llama-cpp-python)")
    libdir = Path(spec.origin).parent / "lib"
    base = ctypes.CDLL(str(libdir / "libggml-base.so"))
    cpu = ctypes.CDLL(str(libdir / "libggml-cpu.so"))
    cpu.ggml_cpu_init()
    rng = np.random.default_rng(SEED)
    out: dict[str, np.ndarray] = {}
    row_fn = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    for name, (_, block, size, partner, quantizes, _) in TYPES.items():
        n_blocks = ROWS * ROW // block
        raw = random_blocks(rng, name, n_blocks)
        decode = getattr(base, f"dequantize_row_{name}")
        decode.argtypes = row_fn
        decoded = np.zeros(ROWS * ROW, np.float32)
        decode(raw.ctypes.data, decoded.ctypes.data, decoded.size)
        out[f"{name}.blocks"] = raw.reshape(-1)
        out[f"{name}.decoded"] = decoded
        # the dot product of each weight row with one activation row
        y = (rng.standard_normal(ROW) * 0.5).astype(np.float32)
        psize = 292 if partner == "q8_K" else 34
        pblock = 256 if partner == "q8_K" else 32
        act = np.zeros(ROW // pblock * psize, np.uint8)
        quant = getattr(base, f"quantize_row_{partner}_ref")
        quant.argtypes = row_fn
        quant(y.ctypes.data, act.ctypes.data, ROW)
        vec_dot = getattr(cpu, f"ggml_vec_dot_{name}_{partner}")
        vec_dot.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
        ]
        row_bytes = ROW // block * size
        flat = raw.reshape(-1)
        dots = np.zeros(ROWS, np.float32)
        for r in range(ROWS):
            s = ctypes.c_float(0.0)
            w = flat[r * row_bytes : (r + 1) * row_bytes].copy()
            vec_dot(ROW, ctypes.byref(s), 0, w.ctypes.data, 0, act.ctypes.data, 0, 1)
            dots[r] = s.value
        out[f"{name}.act"] = act
        out[f"{name}.dot"] = dots
        if quantizes:
            x = rows_to_quantize(rng)
            q = np.zeros(ROWS * row_bytes, np.uint8)
            f = getattr(base, f"quantize_row_{name}_ref")
            f.argtypes = row_fn
            f(x.ctypes.data, q.ctypes.data, x.size)
            out[f"{name}.x"] = x.reshape(-1)
            out[f"{name}.quantized"] = q
    # every E8M0 exponent byte (0 and 1 are ggml's subnormal halves, 255 its largest power)
    edge = rng.integers(0, 256, size=(256, 17), dtype=np.uint8)
    edge[:, 0] = np.arange(256, dtype=np.uint8)
    decode = base.dequantize_row_mxfp4
    decode.argtypes = row_fn
    edge_decoded = np.zeros(256 * 32, np.float32)
    decode(edge.ctypes.data, edge_decoded.ctypes.data, edge_decoded.size)
    out["mxfp4.edge_blocks"] = edge.reshape(-1)
    out["mxfp4.edge_decoded"] = edge_decoded
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(TYPES)} types)")


if __name__ == "__main__":
    main()
