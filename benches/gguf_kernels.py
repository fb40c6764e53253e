"""Matrix products with GGUF's block types, beside the machine's bandwidth and f32, in one run.

Run with ``python benches/gguf_kernels.py`` after ``bash scripts/dev.sh test`` (which builds the
release module into ./.venv). For each weight type:

* **mat-vec**: a ``rows x k`` weight (default 14336 x 4096, an FFN matrix of a 7B model) times
  one column, reported as GB/s of weight bytes read, beside a plain streaming read measured in
  the same run (numpy's integer sum over 1 GiB on one thread and split over ``--threads``
  threads; the larger, or the f32 mat-vec's own rate when it reads faster, is "bandwidth").
  Three copies of each weight are used in turn so the 32 MiB L3 never holds the next call's
  weights.
* **few columns** (``--columns 1,2,4,8``): the same weight times each of those column counts
  (several decoding sequences, short prompts), each as GB/s of weight bytes and % of the
  bandwidth: up to where the products turn compute-bound they should stay near the read.
* **GEMM**: a 4096 x 4096 weight times 512 columns, in GFLOPS beside the f32 weight's product
  measured in the same run (the ratio is throughput over f32's).

Weights are random (normal, 0.1 scale) quantized with ferrograph's reference quantizers; the
i-quants below 4 bits, which ferrograph does not quantize, get random blocks of that scale.
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
TYPES += ["q4_K", "q5_K", "q6_K", "iq4_xs", "iq3_s", "iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs"]
TYPES += ["iq1_m", "iq1_s", "tq2_0", "tq1_0", "mxfp4", "nvfp4", "q1_0", "q2_0"]


def streaming_read(nbytes: int, threads: int, repeat: int) -> tuple[float, float]:
    """GB/s of a plain read of ``nbytes``: numpy's integer sum of an int64 array on one
    thread, and on ``threads`` Python threads each summing its own slice (numpy releases the
    interpreter in reductions)."""
    from concurrent.futures import ThreadPoolExecutor

    arr = np.ones(nbytes // 8, np.int64)
    t_one = best_seconds(lambda: np.add.reduce(arr), repeat)
    parts = np.array_split(arr, threads)
    with ThreadPoolExecutor(threads) as pool:
        t_all = best_seconds(lambda: list(pool.map(np.add.reduce, parts)), repeat)
    return nbytes / t_one / 1e9, nbytes / t_all / 1e9


def random_blocks(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a type without a quantizer, the f16 scale (first, or for iq1_m spread
    over the trailing scale words' top nibbles) small enough for values of about 0.1."""
    dt = fg.DType(dtype)
    raw = rng.integers(0, 256, (n // dt.block_size, dt.type_size), dtype=np.uint8)
    bits = int(np.float16(0.004).view(np.uint16))
    if dtype == "iq1_m":
        for i in range(4):
            at = dt.type_size - 7 + 2 * i
            raw[:, at] = (raw[:, at] & 0x0F) | (((bits >> (4 * i)) & 0xF) << 4)
    else:
        raw[:, 0], raw[:, 1] = bits & 0xFF, bits >> 8
    return raw.reshape(-1)


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
        if fg.DType(dtype).is_quantized and not fg.cpu.type_traits(dtype).has_from_float:
            fg.tensor_set(w, random_blocks(dtype, m * k, rng))
        else:
            if dtype == "f16":
                w.set(wn.astype(np.float16))
            elif dtype == "bf16":  # the upper halves of the f32 bits
                w.set((wn.view(np.uint32) >> 16).astype(np.uint16))
            else:
                w.set(wn)
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
    parser.add_argument(
        "--columns", default="1", help="column counts of the weight-streaming products (1,2,4,8)"
    )
    parser.add_argument("--no-gemm", action="store_true", help="skip the 512-column GEMM")
    args = parser.parse_args()
    types = args.types.split(",")
    columns = [int(c) for c in args.columns.split(",")]
    rows, k, gemm_n = (14336, 4096, 512) if not args.quick else (2048, 1024, 64)
    cpu = fg.init_backend("CPU", n_threads=args.threads)
    one, many = streaming_read(
        (1 << 30) if not args.quick else (1 << 26), args.threads, args.repeat
    )
    bandwidth = max(one, many)
    print(
        f"# streaming read (numpy int64 sum): 1 thread {one:.1f} GB/s, {args.threads} threads "
        f"{many:.1f} GB/s -> bandwidth {bandwidth:.1f} GB/s"
    )
    print(f"# mat-vec {rows}x{k} x {args.columns} columns; GEMM {k}x{k} x {gemm_n} columns")
    heads = " ".join(f"{f'n={n} GB/s':>12} {'% bw':>6}" for n in columns)
    print(f"{'type':8} {heads} {'ms':>7} {'GEMM GFLOPS':>12} {'x f32':>6}")
    if "f32" in types:
        # the f32 mat-vec is itself one plain pass over its weights: when it reads faster than
        # numpy's sum, the machine's bandwidth is at least that
        run, nbytes = product(cpu, "f32", rows, k, 1, 3)
        f32_read = nbytes / best_seconds(run, args.repeat) / 1e9
        if f32_read > bandwidth:
            print(f"# the f32 mat-vec reads {f32_read:.1f} GB/s: percentages are of that")
            bandwidth = f32_read
    f32_gflops = None
    for dtype in types:
        start = time.perf_counter()
        cells, times = [], []
        for n in columns:
            run, nbytes = product(cpu, dtype, rows, k, n, 3)
            times.append(best_seconds(run, args.repeat))
            gbs = nbytes / times[-1] / 1e9
            cells.append(f"{gbs:12.1f} {100 * gbs / bandwidth:5.0f}%")
        t = times[0]  # the "ms" column: the first column count's product
        gflops = ratio = float("nan")
        if not args.no_gemm:
            gemm, _ = product(cpu, dtype, k, k, gemm_n, 1)
            tg = best_seconds(gemm, max(2, args.repeat // 2), min_time=0.05)
            gflops = 2.0 * k * k * gemm_n / tg / 1e9
            if dtype == "f32":
                f32_gflops = gflops
            ratio = gflops / f32_gflops if f32_gflops else float("nan")
        print(
            f"{dtype:8} {' '.join(cells)} {t * 1e3:7.2f} "
            f"{gflops:12.1f} {ratio:6.2f}   (setup {time.perf_counter() - start:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
