"""Writes tests/python/data/block_types_llamacpp.npz: llama.cpp's logits for tiny random models
stored in each of ggml's weight block types, for tests that run without llama.cpp.

The models are the test suite's own (``write_tiny_model`` in tests/python/test_llm.py: 2 layers,
width 256, feed-forward 512, a byte vocabulary of 264 tokens, seed 6), one per type; each
file's SHA-256 is stored beside its logits so the test knows it rebuilt the same file. llama.cpp
(through llama-cpp-python, 2 threads, f32 KV cache) evaluates the same token ids one per batch;
``<type>.logits`` holds every position's logits.

Run from the repository root (needs ``pip install llama-cpp-python`` and ferrograph built):
``python scripts/make_block_type_llm_reference.py``.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "python" / "data" / "block_types_llamacpp.npz"
IDS = [9, 18, 27, 36, 45, 54]
SEED = 6


def main() -> None:
    import llama_cpp

    sys.path.insert(0, str(ROOT / "tests" / "python"))
    from test_llm import SUPERBLOCK_TYPES, write_tiny_model

    out: dict[str, np.ndarray] = {"ids": np.array(IDS, np.int32)}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in SUPERBLOCK_TYPES:
            path = Path(tmp) / f"{dtype}.gguf"
            write_tiny_model(path, seed=SEED, dtype=dtype, width=256, n_ff=512)
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
            llm.eval(IDS)
            out[f"{dtype}.logits"] = np.array(llm.scores[: len(IDS)], np.float32)
            out[f"{dtype}.sha256"] = np.array(digest)
            del llm
            print(dtype, digest[:12])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
