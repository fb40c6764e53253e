"""The suite's tiny random models against llama.cpp's logits for the same files — checked in by
scripts/make_tiny_llm_reference.py, so this runs without llama.cpp:

* a model stored in each of ggml's weight block types, decoded token by token (mat-vecs:
  integer block dot products against activations quantized to the partner type, as
  llama.cpp computes them);
* an f32 model of each architecture llama.cpp reads from these files (llama, qwen2, qwen3),
  and qwen3 / llama with heads of 64 values (twice width / heads, as Qwen3 files have)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from ferrograph.models import llm as llm_mod
from test_llm import SUPERBLOCK_TYPES, write_tiny_model

DATA = Path(__file__).parent / "data"


def _load(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / name) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def block_types() -> dict[str, np.ndarray]:
    return _load("block_types_llamacpp.npz")


@pytest.fixture(scope="module")
def archs() -> dict[str, np.ndarray]:
    return _load("archs_llamacpp.npz")


def _agree(path: Path, ref: dict[str, np.ndarray], name: str) -> None:
    """The file at `path` is the reference's model `name`, and its logits (token by token,
    f32 cache) equal llama.cpp's up to float summation order."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    # A different file means the model builder (numpy's random stream, or a quantizer's bytes)
    # changed: regenerate the reference with the script rather than compare different models.
    assert digest == str(ref[f"{name}.sha256"]), f"{name}: not the reference's model file"
    ids = [int(i) for i in ref["ids"]]
    want = ref[f"{name}.logits"]
    got = llm_mod.LLM(path, n_ctx=64, n_batch=1, kv_dtype="f32").logits(ids)
    # same bytes, same activation quantization; only float summation order differs
    assert np.abs(got - want).max() < 1e-5 * max(1.0, float(np.abs(want).max())), name
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("dtype", SUPERBLOCK_TYPES)
def test_token_by_token_logits_equal_llama_cpp(
    tmp_path: Path, block_types: dict[str, np.ndarray], dtype: str
) -> None:
    path = tmp_path / f"{dtype}.gguf"
    write_tiny_model(path, seed=6, dtype=dtype, width=256, n_ff=512)
    _agree(path, block_types, dtype)


@pytest.mark.parametrize(
    ("name", "arch", "head_dim"),
    [
        ("llama", "llama", None),
        ("qwen2", "qwen2", None),
        ("qwen3", "qwen3", None),
        ("qwen3-heads64", "qwen3", 64),
        ("llama-heads64", "llama", 64),
    ],
)
def test_architectures_equal_llama_cpp(
    tmp_path: Path, archs: dict[str, np.ndarray], name: str, arch: str, head_dim: int | None
) -> None:
    path = tmp_path / f"{name}.gguf"
    write_tiny_model(path, arch, seed=3, width=128, n_ff=96, head_dim=head_dim)
    _agree(path, archs, name)
