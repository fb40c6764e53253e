"""ferrograph's GGUF language model beside llama.cpp (llama-cpp-python), same file, one run.

Each measurement runs in its own process (so peak RSS and load time are its own), the two
implementations alternating round by round; the table shows medians over ``--rounds``. Cases:
``load`` (model ready, ms), ``pp128``/``pp512`` (prompt processing, tokens/s, from an empty
cache), ``tg128`` (128 tokens decoded one at a time after a one-token prompt, tokens/s), and the
peak RSS of the process (MiB). Both use ``--threads`` threads, an f16 KV cache, ``n_batch`` 512;
llama.cpp with flash attention on, as its CPU default for this model resolves.

Run after ``bash scripts/dev.sh test`` with llama-cpp-python installed (it builds llama.cpp from
source: ``CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF" pip install --no-binary
llama-cpp-python llama-cpp-python``): ``python benches/llm.py [--model FILE.gguf]``.
``--requantize q4_0`` (or ``q8_0``, ``q4_k_m``, ...) first rewrites the model with llama.cpp's
own quantizer (``llama_model_quantize``, cached in the system temp directory) and measures both
on that file: the packaged SmolLM2 is q4_1, and other block types take other kernels.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
from _bench_timing import streaming_read_gbs


def _prompt(n: int, n_vocab: int, start: int = 100) -> list[int]:
    # a fixed pseudo-random prompt of ordinary tokens (ids 100..30000, wrapped into a smaller
    # vocabulary)
    return [(start + (i * 7919) % 29900) % n_vocab for i in range(n)]


def worker_ferrograph(model: str | None, threads: int) -> dict[str, float]:
    from ferrograph.models import LLM

    t0 = time.perf_counter()
    llm = LLM(model, n_threads=threads, n_ctx=1024, n_batch=512)
    out = {"load": (time.perf_counter() - t0) * 1e3}
    vocab = llm.config.n_vocab
    for n in (128, 512):
        llm.reset()
        t0 = time.perf_counter()
        llm._prefill(_prompt(n, vocab), all_logits=False)
        out[f"pp{n}"] = n / (time.perf_counter() - t0)
    llm.reset()
    llm._prefill(_prompt(1, vocab), all_logits=False)
    steps = _prompt(128, vocab, start=200)
    t0 = time.perf_counter()
    for i, token in enumerate(steps):
        llm._eval([token], 1 + i, False)
        llm._cached_tokens.append(token)
    out["tg128"] = 128 / (time.perf_counter() - t0)
    out.update(_decode_breakdown(llm, 129))
    return out


def _decode_breakdown(llm: Any, position: int, steps: int = 32) -> dict[str, float]:
    """Where a decoding step's time goes: the share of ``LLM._eval`` spent outside the
    scheduler's compute (graph lookup, inputs, logits read back, Python), the share of the
    compute outside the nodes (one profiled step), and the weight bytes one step reads (every
    matrix once; the token embedding's one row unless it is also the output)."""

    class TimedScheduler:
        """Forwards to the model's scheduler, adding up the time its computes take."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.seconds = 0.0

        def graph_compute(self, graph: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return self.inner.graph_compute(graph, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    timed = TimedScheduler(llm.scheduler)
    llm.scheduler = timed
    total = 0.0
    try:
        for i, token in enumerate(_prompt(steps, llm.config.n_vocab, start=300)):
            t0 = time.perf_counter()
            llm._eval([token], position + i, False)
            total += time.perf_counter() - t0
    finally:
        llm.scheduler = timed.inner
    # one more step, profiled (through the public API: it sets the step's inputs)
    at = position + steps
    llm.evaluate([1], [at], [at], np.ones((1, at + 1), dtype=bool), profile=True)
    profile = llm.last_profile
    tied = "output.weight" not in llm.weights
    weight_bytes = sum(
        t.nbytes for name, t in llm.weights.items() if name != "token_embd.weight" or tied
    )
    return {
        "outside_share": (total - timed.seconds) / total,
        "between_nodes_share": 1.0 - profile.node_seconds / profile.total_seconds,
        "weight_bytes": float(weight_bytes),
    }


def worker_llamacpp(model: str | None, threads: int) -> dict[str, float]:
    import llama_cpp

    path = model or str(_packaged())
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        path,
        n_ctx=1024,
        n_batch=512,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,
        verbose=False,
    )
    out = {"load": (time.perf_counter() - t0) * 1e3}
    vocab = llm.n_vocab()
    for n in (128, 512):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(_prompt(n, vocab))
        out[f"pp{n}"] = n / (time.perf_counter() - t0)
    llm.reset()
    llm.eval(_prompt(1, vocab))
    steps = _prompt(128, vocab, start=200)
    t0 = time.perf_counter()
    for token in steps:
        llm.eval([token])
    out["tg128"] = 128 / (time.perf_counter() - t0)
    return out


def _packaged() -> object:
    from ferrograph.models.llm import find_packaged_model

    return find_packaged_model()


# llama.cpp's file types (``llama_ftype``) by the names ``--requantize`` takes.
_FTYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q4_k_m": 15, "q5_k_m": 17}


def _requantized(model: str, kind: str) -> str:
    """``model`` rewritten in llama.cpp's file type ``kind`` (cached in the temp directory)."""
    import ctypes
    import hashlib
    import os
    import tempfile

    import llama_cpp

    tag = hashlib.sha256(f"{os.path.abspath(model)}:{os.path.getsize(model)}".encode()).hexdigest()
    out = os.path.join(tempfile.gettempdir(), f"ferrograph-bench-{tag[:12]}-{kind}.gguf")
    if not os.path.exists(out):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = _FTYPES[kind]
        params.allow_requantize = True
        params.nthread = 2
        partial = out + ".part"
        rc = llama_cpp.llama_model_quantize(model.encode(), partial.encode(), ctypes.byref(params))
        if rc != 0:
            raise SystemExit(f"llama_model_quantize failed ({rc}) for {kind}")
        os.replace(partial, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: packaged SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--requantize",
        choices=sorted(_FTYPES),
        default=None,
        help="measure a copy of the model requantized by llama.cpp to this type",
    )
    parser.add_argument("--worker", choices=["ferrograph", "llama.cpp"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.requantize and not args.worker:
        args.model = _requantized(args.model or str(_packaged()), args.requantize)
        print(f"# {args.model} (requantized to {args.requantize} by llama.cpp)")
    if args.worker:
        fn = worker_ferrograph if args.worker == "ferrograph" else worker_llamacpp
        result = fn(args.model, args.threads)
        result["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return
    names = ["ferrograph", "llama.cpp"]
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            cmd = [sys.executable, __file__, "--worker", name, "--threads", str(args.threads)]
            if args.model:
                cmd += ["--model", args.model]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(f"{name} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"# {args.threads} threads, median of {args.rounds} interleaved rounds")
    print(f"{'case':14} {'ferrograph':>12} {'llama.cpp':>12} {'ratio':>7}")
    for key, label, higher in [
        ("pp128", "pp128 tok/s", True),
        ("pp512", "pp512 tok/s", True),
        ("tg128", "tg128 tok/s", True),
        ("load", "load ms", False),
        ("rss", "peak RSS MiB", False),
    ]:
        vals = [
            statistics.median(x[key] for x in runs[n]) if runs[n] else float("nan") for n in names
        ]
        ratio = vals[0] / vals[1] if higher else vals[1] / vals[0]
        print(f"{label:14} {vals[0]:12.1f} {vals[1]:12.1f} {ratio:6.2f}x")
    if runs["ferrograph"]:
        mine = runs["ferrograph"]
        bandwidth, read_by = streaming_read_gbs(args.threads)
        weight_gb = mine[0]["weight_bytes"] / 1e9
        bound = bandwidth / weight_gb
        tg = statistics.median(x["tg128"] for x in mine)
        outside = statistics.median(x["outside_share"] for x in mine)
        between = statistics.median(x["between_nodes_share"] for x in mine)
        print(
            f"# decoding: {weight_gb * 1e3:.1f} MB of weights per token; memory reads at "
            f"{bandwidth:.1f} GB/s on {args.threads} threads ({read_by}), a bound of "
            f"{bound:.0f} tokens/s: "
            f"ferrograph at {tg / bound:.0%} of it, llama.cpp at "
            f"{statistics.median(x['tg128'] for x in runs['llama.cpp']) / bound:.0%}"
            if runs["llama.cpp"]
            else f"# decoding: bound {bound:.0f} tokens/s, ferrograph at {tg / bound:.0%}"
        )
        print(
            f"# a decoding step: {outside:.1%} outside the compute (inputs, logits, Python), "
            f"{between:.1%} of the compute between nodes"
        )


if __name__ == "__main__":
    main()
