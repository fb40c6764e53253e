"""Shared timing helpers of the Python benchmark scripts in this folder."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def best_seconds(fn: Callable[[], object], repeat: int, min_time: float = 0.2) -> float:
    """Best wall time of one call of ``fn`` over ``repeat`` rounds; each round makes enough
    calls to last about ``min_time / 2`` so short calls are timed reliably."""
    fn()
    start = time.perf_counter()
    calls = 0
    while time.perf_counter() - start < min_time:
        fn()
        calls += 1
    calls = max(calls // 2, 1)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def streaming_read_gbs(threads: int, nbytes: int = 1 << 29) -> tuple[float, str]:
    """The fastest read of ``nbytes`` from memory this process can measure on ``threads``
    threads, best of 3 each, and what gave it: numpy reductions split over Python threads
    (they release the interpreter), and OpenBLAS's f32 matrix-vector product over rows of
    4096 values (limited to ``threads`` through threadpoolctl, or used only when ``threads``
    is the machine's core count), and ferrograph's own f32 matrix-vector product (one column,
    ``threads`` threads: every weight byte read once). The BLAS product streams with several
    rows and software prefetch and reads measurably faster than the reductions on these
    machines; taking the fastest of all keeps the bound honest. (The host's bandwidth itself
    moves by half between minutes on these shared machines: quote it beside figures measured
    in the same run only.)"""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    def best_of_3(fn: Any) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / 1e9

    results: dict[str, float] = {}
    for name, dtype in (("numpy int64 sum", np.int64), ("numpy f32 max", np.float32)):
        parts = np.array_split(np.ones(nbytes // np.dtype(dtype).itemsize, dtype), threads)
        with ThreadPoolExecutor(threads) as pool:
            op = np.sum if dtype == np.int64 else np.max
            results[name] = best_of_3(lambda op=op, parts=parts: list(pool.map(op, parts)))
    matrix = np.ones((nbytes // (4 * 4096), 4096), np.float32)
    vector = np.ones(4096, np.float32)
    try:
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=threads, user_api="blas"):
            results["OpenBLAS f32 gemv"] = best_of_3(lambda: matrix @ vector)
    except ImportError:
        if threads == os.cpu_count():
            results["OpenBLAS f32 gemv"] = best_of_3(lambda: matrix @ vector)
    try:
        import ferrograph as fg

        cpu = fg.init_backend("CPU", n_threads=threads)
        ctx = fg.Context(no_alloc=False)
        weights = ctx.new_tensor(fg.float32, (nbytes // (4 * 4096), 4096))
        x = ctx.new_tensor(fg.float32, (1, 4096))
        graph = fg.Graph.build(fg.ops.mul_mat(weights, x, ctx=ctx))
        weights.set(matrix)
        x.set(vector[None, :])
        results["ferrograph f32 mat-vec"] = best_of_3(lambda: cpu.graph_compute(graph))
    except ImportError:
        pass
    name = max(results, key=lambda k: results[k])
    return results[name], name
