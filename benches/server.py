"""The OpenAI-compatible server under load, on loopback, driven by the official ``openai`` client.

Starts ``python -m ferrograph api`` (both packaged models) on a free port and measures:

- embeddings: ``--requests`` one-sentence requests made one at a time, then ``--clients``
  concurrent clients each making ``--requests`` requests (the server batches them into shared
  encoder calls); latency p50/p99 and aggregate sentences/s of each, and their ratio;
- chat: ``--streams`` concurrent streams of ``--tokens`` tokens each (``ignore_eos``), beside
  one stream alone; aggregate generated tokens/s and time to first token;
- the server's resident memory (VmRSS) after a warm-up and after each of ``--rounds``
  identical load rounds: a server that keeps nothing per request stays flat.

With ``llama-cpp-python[server]`` installed, the chat part also runs against
``python -m llama_cpp.server`` on the same GGUF file (same threads, ``--n_parallel``-free
defaults: one sequence at a time), for the 1-stream and N-stream aggregate tokens/s.

Every request has a timeout and the counts are bounded; a failed request is counted and
printed. Run: ``python benches/server.py [--clients 32 --requests 20 --streams 4]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import select
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Il pleut depuis ce matin.",
    "Someone in a gorilla costume is playing a set of drums.",
]
PROMPT = "Write a short story about a lighthouse keeper."


def start_server(args: list[str], ready: Callable[[str], str | None], timeout: float) -> Any:
    """A server subprocess and its base URL, read from its output by ``ready``."""
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 1.0)
        if not r:
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        url = ready(line)
        if url:
            # keep draining the output so the server never blocks on a full pipe
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, url
    proc.kill()
    raise RuntimeError(f"server {args[:4]} did not start")


def stop(proc: Any) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_clients(n_clients: int, n_requests: int, call: Callable[[int, int], int]) -> dict[str, Any]:
    """``n_clients`` threads each making ``n_requests`` calls; ``call`` returns a work count."""
    latencies: list[float] = []
    failures: list[str] = []
    work = [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(n_requests):
            t0 = time.perf_counter()
            try:
                done = call(c, r)
            except Exception as e:
                with lock:
                    failures.append(f"{type(e).__name__}: {e}"[:200])
                continue
            with lock:
                latencies.append(time.perf_counter() - t0)
                work[0] += done

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {
        "answered": len(latencies),
        "failed": len(failures),
        "failures": failures[:3],
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "per_s": work[0] / wall,
        "wall_s": wall,
    }


def embedding_bench(client: Any, model: str, clients: int, requests: int) -> dict[str, Any]:
    def one(c: int, r: int) -> int:
        text = SENTENCES[(c * 7 + r) % len(SENTENCES)] + f" ({c}.{r})"
        out = client.embeddings.create(model=model, input=text)
        assert len(out.data) == 1 and len(out.data[0].embedding) == 384
        return 1

    sequential = run_clients(1, requests * 2, one)
    concurrent = run_clients(clients, requests, one)
    return {"sequential": sequential, "concurrent": concurrent}


def chat_bench(
    client: Any, model: str, streams: int, tokens: int, no_eos: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``no_eos``: the request fields that keep a stream going to ``tokens`` (default
    ``ignore_eos``, which llama_cpp.server ignores: it gets a bias against the end token)."""
    first: list[float] = []
    keep_going = no_eos if no_eos is not None else {"extra_body": {"ignore_eos": True}}

    def one(c: int, r: int) -> int:
        t0 = time.perf_counter()
        n = 0
        stream = client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            **keep_going,
        )
        pieces = 0
        for chunk in stream:
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
            elif chunk.choices and chunk.choices[0].text:
                pieces += 1
                if not first_seen[c]:
                    first_seen[c] = True
                    first.append(time.perf_counter() - t0)
        # a server without `stream_options.include_usage` (llama_cpp.server): one streamed
        # piece per token
        return n or pieces

    out = {}
    for n_streams in sorted({1, streams}):
        first.clear()
        first_seen = [False] * n_streams
        result = run_clients(n_streams, 1, one)
        result["first_token_ms"] = statistics.median(first) * 1e3 if first else float("nan")
        out[f"{n_streams}_streams"] = result
    return out


def bench_ferrograph(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    command = [sys.executable, "-m", "ferrograph", "api", "--port", "0", "--log-level", "warning"]
    command += ["--parallel", str(args.streams), "--threads", str(args.threads)]
    proc, url = start_server(
        command, lambda line: line.strip() if line.startswith("http://") else None, 300
    )
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        ids = [m.id for m in client.models.list().data]
        embedding = next(m for m in ids if "MiniLM" in m)
        chat = next(m for m in ids if "SmolLM2" in m)
        embedding_bench(client, embedding, 4, 3)  # warm-up: graphs of every batch shape
        chat_bench(client, chat, args.streams, 8)
        rss = [rss_mib(proc.pid)]
        result = {"embeddings": [], "chat": []}
        for _ in range(args.rounds):
            result["embeddings"].append(
                embedding_bench(client, embedding, args.clients, args.requests)
            )
            result["chat"].append(chat_bench(client, chat, args.streams, args.tokens))
            rss.append(rss_mib(proc.pid))
        result["rss_mib"] = rss
        return result
    finally:
        stop(proc)


def bench_llamacpp(args: argparse.Namespace) -> dict[str, Any] | None:
    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("uvicorn") is None:
        return None
    import socket

    import openai

    from ferrograph.models.llm import find_packaged_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = str(find_packaged_model())
    command = [sys.executable, "-m", "llama_cpp.server", "--model", path, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--n_threads", str(args.threads), "--n_ctx", "2048"]
    proc, url = start_server(
        command,
        lambda line: f"http://127.0.0.1:{port}" if "Uvicorn running" in line else None,
        300,
    )
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        import ferrograph as fg

        eos = fg.gguf.GGUFFile(path).metadata.get("tokenizer.ggml.eos_token_id", 2)
        no_eos = {"logit_bias": {str(int(eos)): -100}}
        chat_bench(client, path, 1, 8, no_eos)
        return chat_bench(client, path, args.streams, args.tokens, no_eos)
    finally:
        stop(proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32, help="concurrent embedding clients")
    parser.add_argument("--requests", type=int, default=20, help="requests per client")
    parser.add_argument("--streams", type=int, default=4, help="concurrent chat streams")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per chat stream")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each model")
    parser.add_argument(
        "--rounds", type=int, default=3, help="load rounds (the server's RSS after each)"
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()

    ours = bench_ferrograph(args)
    try:
        theirs = bench_llamacpp(args)
        peer_missing = "llama-cpp-python[server] is not installed"
    except RuntimeError as e:  # its server's own dependencies may be missing (fastapi, ...)
        theirs = None
        peer_missing = f"llama_cpp.server did not run: {e}"

    def summary(results: list[dict[str, Any]]) -> str:
        rates = [r["per_s"] for r in results]
        return f"best {max(rates):7.1f}  median {statistics.median(rates):7.1f}"

    # the machine may be shared: each figure is the best and the median over the rounds
    print(
        f"embeddings ({args.clients} clients x {args.requests} one-sentence requests, "
        f"{args.rounds} rounds; sentences/s):"
    )
    ratios = []
    for e in ours["embeddings"]:
        ratios.append(e["concurrent"]["per_s"] / e["sequential"]["per_s"])
    for key, name in (("sequential", "one at a time"), ("concurrent", f"{args.clients} clients")):
        runs = [e[key] for e in ours["embeddings"]]
        last = runs[-1]
        print(
            f"  {name:<14} {summary(runs)}  last round: p50 {last['p50_ms']:7.1f} ms  "
            f"p99 {last['p99_ms']:7.1f} ms  answered {sum(r['answered'] for r in runs)} "
            f"failed {sum(r['failed'] for r in runs)}"
        )
    print(f"  batched / sequential per round: {', '.join(f'{x:.2f}x' for x in ratios)}")
    print(f"chat ({args.tokens} tokens per stream; aggregate generated tokens/s):")
    for key in ours["chat"][-1]:
        runs = [c[key] for c in ours["chat"]]
        first = statistics.median(r["first_token_ms"] for r in runs)
        print(
            f"  ferrograph {key:<10} {summary(runs)}  first token (median) {first:7.1f} ms  "
            f"failed {sum(r['failed'] for r in runs)}"
        )
    if theirs is not None:
        for key, r in theirs.items():
            print(
                f"  llama.cpp  {key:<10} {r['per_s']:7.1f} tokens/s  first token "
                f"{r['first_token_ms']:7.1f} ms  answered {r['answered']} failed {r['failed']}"
            )
    else:
        print(f"  ({peer_missing}: no llama_cpp.server comparison)")
    rss = ours["rss_mib"]
    rounds = ", ".join(f"{r:.0f}" for r in rss[1:])
    print(f"server RSS: {rss[0]:.0f} MiB after warm-up; after each round: {rounds} MiB")
    failures = [
        r["failures"]
        for part in ("embeddings", "chat")
        for e in ours[part]
        for r in e.values()
        if r["failed"]
    ]
    if failures:
        print(f"failures: {failures}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"ferrograph": ours, "llama_cpp": theirs}, f, indent=1)
    return 0 if not failures else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
