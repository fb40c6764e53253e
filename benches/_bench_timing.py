"""Shared timing helper of the Python benchmark scripts in this folder."""

from __future__ import annotations

import time
from collections.abc import Callable


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
