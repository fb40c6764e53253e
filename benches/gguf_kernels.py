"""Matrix products with GGUF's block types, beside the machine's bandwidth and f32, in one run.

Run with ``python benches/gguf_kernels.py`` after ``bash scripts/dev.sh test`` (which builds the
release module into ./.venv). For each weight type:

* **mat-vec**: a ``rows x k`` weight (default 14336 x 4096, an FFN matrix of a 7B model) times
  one column, reported as GB/s of weight bytes read, beside a plain streaming read measured in
  the same run (ferrograph's SUM over a 1 GiB f32 array at the same thread count, and numpy's
  single-threaded sum; the larger is "bandwidth"). Three copies of each weight are used in turn
  so the 32 MiB L3 never holds the next call's weights.
* **GEMM**: a 4096 x 4096 weight times 512 columns, in GFLOPS beside the f32 weight's product
  measured in the same run (the ratio is throughput over f32's).

Weights are random (normal, 0.1 scale) quantized with ferrograph's reference quantizers.
``--quick`` shrinks the shapes for a smoke run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from _bench_timing import best_seconds

import ferrograph as fg

TYPES = ["f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "q2_K", "q3_K"]
TYPES += ["q4_K", "q5_K", "q6_K", "iq4_xs"]


def streaming_read(cpu: fg.Backend, nbytes: int, repeat: int) -> tuple[float, float]:
    """GB/s of a plain read: ferrograph's SUM over ``nbytes`` of f32 (the backend's threads),
    numpy's ``sum`` (one thread)."""
    n = nbytes // 4
    ctx = fg.Context(no_alloc=False)
    x = ctx.new_tensor(fg.float32, (n,), name="x")
    x.set(np.ones(n, np.float32))
    g = fg.Graph.build(fg.ops.sum(x, ctx=ctx))
    t_fg = best_seconds(lambda: cpu.graph_compute(g), repeat)
    arr = np.ones(n, np.float32)
    t_np = best_seconds(lambda: arr.sum(), repeat)
    return nbytes / t_fg / 1e9, nbytes / t_np / 1e9


def product(
    cpu: fg.Backend, dtype: str, m: int, k: int, n: int, copies: int
) -> tuple[Callable[[], None], int]:
    """A function computing ``copies`` products in turn (one per call) and the weight bytes of
    one copy."""
    rng = np.random.default_rng(0)
    wn = (rng.standard_normal((m, k)) * 0.1).astype(np.float32)
    xn = rng.standard_normal((n, k)).astype(np.float32)
    graphs = []
    nbytes = 0
    for c in range(copies):
        ctx = fg.Context(no_alloc=False)
        w = ctx.new_tensor(dtype, (m, k), name=f"w{c}")
        x = ctx.new_tensor(fg.float32, (n, k), name="x")
        w.set(wn.astype(np.float16) if dtype == "f16" else wn)
        x.set(xn)
        nbytes = w.nbytes
        graphs.append((ctx, fg.Graph.build(fg.ops.mul_mat(w, x, ctx=ctx))))
    turn = [0]

    def run() -> None:
        cpu.graph_compute(graphs[turn[0] % copies][1])
        turn[0] += 1

    return run, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--types", default=",".join(TYPES))
    args = parser.parse_args()
    types = args.types.split(",")
    rows, k, gemm_n = (14336, 4096, 512) if not args.quick else (2048, 1024, 64)
    cpu = fg.init_backend("CPU", n_threads=args.threads)
    fg_bw, np_bw = streaming_read(cpu, (1 << 30) if not args.quick else (1 << 26), args.repeat)
    bandwidth = max(fg_bw, np_bw)
    print(f"# {args.threads} threads; streaming read: ferrograph SUM {fg_bw:.1f} GB/s, ", end="")
    print(f"numpy sum (1 thread) {np_bw:.1f} GB/s -> bandwidth {bandwidth:.1f} GB/s")
    print(f"# mat-vec {rows}x{k} x 1 column; GEMM {k}x{k} x {gemm_n} columns")
    print(f"{'type':8} {'matvec GB/s':>12} {'% bw':>6} {'ms':>7} {'GEMM GFLOPS':>12} {'x f32':>6}")
    f32_gflops = None
    for dtype in types:
        start = time.perf_counter()
        run, nbytes = product(cpu, dtype, rows, k, 1, 3)
        t = best_seconds(run, args.repeat)
        gbs = nbytes / t / 1e9
        gemm, _ = product(cpu, dtype, k, k, gemm_n, 1)
        tg = best_seconds(gemm, max(2, args.repeat // 2), min_time=0.05)
        gflops = 2.0 * k * k * gemm_n / tg / 1e9
        if dtype == "f32":
            f32_gflops = gflops
        ratio = gflops / f32_gflops if f32_gflops else float("nan")
        print(
            f"{dtype:8} {gbs:12.1f} {100 * gbs / bandwidth:5.0f}% {t * 1e3:7.2f} "
            f"{gflops:12.1f} {ratio:6.2f}   (setup {time.perf_counter() - start:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
