"""ggml's newer block types (the i-quants, ternary, FP4 and 1-/2-bit types) against ggml itself:
the decoded values, the reference quantizers' bytes and the CPU dot products that ggml's own
library (the build inside llama-cpp-python) computed, checked in by
scripts/make_ggml_block_reference.py — so these run without ggml."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ferrograph as fg

DATA = Path(__file__).parent / "data" / "ggml_block_types.npz"
TYPES = ["iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"]
TYPES += ["tq1_0", "tq2_0", "mxfp4", "nvfp4", "q1_0", "q2_0"]
ROWS = 3


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(DATA) as data:
        return {k: data[k] for k in data.files}


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal bits where ggml's value is finite, and non-finite exactly where ggml's is."""
    ok = np.isfinite(want)
    return bool(
        np.array_equal(np.isfinite(got), ok)
        and np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))
    )


@pytest.mark.parametrize("name", TYPES)
def test_decoding_equals_ggml(ref: dict[str, np.ndarray], name: str) -> None:
    want = ref[f"{name}.decoded"]
    got = fg.dequantize(ref[f"{name}.blocks"], name, want.size)
    assert same_bits(got, want)


def test_every_mxfp4_exponent_decodes_as_ggml(ref: dict[str, np.ndarray]) -> None:
    want = ref["mxfp4.edge_decoded"]
    assert same_bits(fg.dequantize(ref["mxfp4.edge_blocks"], "mxfp4", want.size), want)


@pytest.mark.parametrize("name", TYPES)
def test_quantizing_equals_ggml_where_ggml_has_a_reference_quantizer(
    ref: dict[str, np.ndarray], name: str
) -> None:
    if f"{name}.x" not in ref:
        with pytest.raises(fg.UnsupportedOpError, match=name):
            fg.quantize(np.ones(fg.DType(name).block_size, np.float32), name)
        return
    got = fg.quantize(ref[f"{name}.x"], name)
    assert np.array_equal(got.reshape(-1), ref[f"{name}.quantized"])


@pytest.mark.parametrize("name", TYPES)
def test_dot_products_agree_with_ggml(ref: dict[str, np.ndarray], name: str) -> None:
    """Same weight and activation bytes: only the order of float operations differs from
    ggml's kernel, so the results agree to float32 rounding of the terms' magnitudes."""
    traits = fg.cpu.type_traits(name)
    partner = traits.vec_dot_type.name
    blocks, act = ref[f"{name}.blocks"], ref[f"{name}.act"]
    n = ref[f"{name}.decoded"].size // ROWS
    row_bytes = blocks.size // ROWS
    y = fg.dequantize(act, partner, n).astype(np.float64)
    for r in range(ROWS):
        w = blocks[r * row_bytes : (r + 1) * row_bytes]
        got = traits.vec_dot(w, act, n)
        want = float(ref[f"{name}.dot"][r])
        wf = fg.dequantize(w, name, n).astype(np.float64)
        magnitude = float(np.abs(wf * y).sum())
        assert abs(got - want) <= 2e-5 * magnitude + 1e-6, (name, r, got, want, magnitude)
        # and both are the product of the decoded rows, up to the same rounding
        assert abs(got - float(wf @ y)) <= 2e-5 * magnitude + 1e-6, (name, r)
