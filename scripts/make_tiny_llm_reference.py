"""Writes llama.cpp's logits for the test suite's tiny random models, for tests that run
without llama.cpp:

* ``tests/python/data/block_types_llamacpp.npz``: a model stored in each of ggml's weight block
  types (``write_tiny_model`` in tests/python/test_llm.py: llama, 2 layers, width 256,
  feed-forward 512, a byte vocabulary of 264 tokens, seed 6);
* ``tests/python/data/archs_llamacpp.npz``: an f32 model of each architecture llama.cpp reads
  from these files (llama, qwen2, qwen3: width 128, feed-forward 96, seed 3), and qwen3 and
  llama with heads of 64 values (twice width / heads, as Qwen3 files have them).

Each file's SHA-256 is stored beside its logits so the tests know they rebuilt the same file.
llama.cpp (through llama-cpp-python, 2 threads, f32 KV cache) evaluates the token ids one per
batch; ``<name>.logits`` holds every position's logits.

Run from the repository root (needs ``pip install llama-cpp-python`` and ferrograph built):
``python scripts/make_tiny_llm_reference.py``.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "python" / "data"
BLOCK_TYPE_IDS = [9, 18, 27, 36, 45, 54]
ARCH_IDS = [5, 80, 17, 200, 33, 120, 7, 99]
# name: (architecture, head size or None for width / heads)
ARCHITECTURES: dict[str, tuple[str, int | None]] = {
    "llama": ("llama", None),
    "qwen2": ("qwen2", None),
    "qwen3": ("qwen3", None),
    "qwen3-heads64": ("qwen3", 64),
    "llama-heads64": ("llama", 64),
}


def _references(out: Path, ids: list[int], models: dict[str, Callable[[Path], object]]) -> None:
    """Writes `out` with the logits of each model (`models[name](path)` writes its file)."""
    import llama_cpp

    found: dict[str, np.ndarray] = {"ids": np.array(ids, np.int32)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, write in models.items():
            path = Path(tmp) / f"{name}.gguf"
            write(path)
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            llm = llama_cpp.Llama(
                str(path),
                n_ctx=64,
                n_batch=1,
                n_ubatch=1,
                logits_all=True,
                verbose=False,
                n_threads=2,
                type_k=0,  # f32 cache, as the tests use
                type_v=0,
            )
            llm.eval(ids)
            found[f"{name}.logits"] = np.array(llm.scores[: len(ids)], np.float32)
            found[f"{name}.sha256"] = np.array(digest)
            del llm
            print(name, digest[:12])
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **found)
    print(f"wrote {out} ({out.stat().st_size} bytes)")


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    from test_llm import SUPERBLOCK_TYPES, write_tiny_model

    def block_type(dtype: str) -> Callable[[Path], object]:
        return lambda p: write_tiny_model(p, seed=6, dtype=dtype, width=256, n_ff=512)

    def architecture(arch: str, head_dim: int | None) -> Callable[[Path], object]:
        return lambda p: write_tiny_model(p, arch, seed=3, width=128, n_ff=96, head_dim=head_dim)

    _references(
        DATA / "block_types_llamacpp.npz",
        BLOCK_TYPE_IDS,
        {dtype: block_type(dtype) for dtype in SUPERBLOCK_TYPES},
    )
    _references(
        DATA / "archs_llamacpp.npz",
        ARCH_IDS,
        {name: architecture(*spec) for name, spec in ARCHITECTURES.items()},
    )


if __name__ == "__main__":
    main()
