"""CPU kernels side by side with their peers, measured in one run (issue: CPU kernels).

Run with ``python benches/compare_kernels.py`` after ``bash scripts/dev.sh test`` (which builds
the release module into ./.venv). Every workload is one ferrograph graph computed on the CPU
backend with ``--threads`` threads, timed as the best of ``--repeat`` rounds, beside numpy (its
BLAS limited to the same thread count through threadpoolctl when installed) and PyTorch CPU
when installed. Prints GFLOPS or GB/s and the ratio ferrograph / peer (above 1: ferrograph is
faster), plus the fraction of this machine's peaks: ``--peak-gflops`` (default: measured here,
``fg.cpu.fma_peak_gflops(--threads)``: every thread running fused multiply-add chains on the
widest vector ISA the kernels use) and ``--bandwidth``. Matrix products are timed in
interleaved rounds (ferrograph, numpy, torch, ferrograph, ...), best of ``--repeat``, so load
on a shared machine hits every peer alike. ``--quick`` shrinks the big workloads for a smoke
run; ``--only-matmul`` runs the matrix products alone. numpy's OpenBLAS picks its kernel when
it loads: for its best one, run with ``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE`` unset
(``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benches/compare_kernels.py``); the
kernel that ran is printed first.

The peers' worker threads are told not to spin once a call returns (``OMP_WAIT_POLICY``
for PyTorch's OpenMP, ``OPENBLAS_THREAD_TIMEOUT`` for numpy's OpenBLAS; both only when not
set already): by default they busy-wait for a while after each call, and on a 2-core machine
that spinning steals the cores from whatever is measured next (it cut ferrograph's figures
by up to a third when measured right after a peer).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from collections.abc import Callable
from typing import Any

import numpy as np
from _bench_timing import best_seconds as _best_seconds
from _bench_timing import streaming_read_gbs

import ferrograph as fg

try:  # optional peer
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    torch = None

try:  # optional: limit numpy's BLAS threads to ours
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover
    threadpool_limits = None


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    """Best time of one call (short rounds: the kernels here run for milliseconds)."""
    return _best_seconds(fn, repeat, min_time=0.05)


def interleaved_best_seconds(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Best time of one call of each function, measured in interleaved rounds (one round of
    each in turn, ``repeat`` times): on a shared machine a burst of load then hits every peer
    alike instead of whichever happened to run during it."""
    calls: dict[str, int] = {}
    for name, fn in fns.items():
        fn()
        start = time.perf_counter()
        n = 0
        while time.perf_counter() - start < 0.05:
            fn()
            n += 1
        calls[name] = max(n // 2, 1)
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls[name])
    return best


class Table:
    """Collects rows: workload, implementation, figure, unit, ratio to ferrograph."""

    def __init__(self, peak_gflops: float, bandwidth: float, int8_peak: float) -> None:
        self.rows: list[tuple[str, str, float, str, str]] = []
        self.peak_gflops = peak_gflops
        self.bandwidth = bandwidth
        self.int8_peak = int8_peak

    def add(
        self,
        workload: str,
        amount: float,
        unit: str,
        timings: dict[str, float],
        integer: bool = False,
        flops: float = 0.0,
    ) -> None:
        """One workload's rows; ``integer``: a q8_0/q4_0 product, quoted against the integer
        peak (GFLOPS) — GB/s rows against the measured streaming read and, given the
        product's ``flops``, also against the compute peak (whichever binds)."""
        ours = timings["ferrograph"]
        compute_peak = self.int8_peak if integer else self.peak_gflops
        for name, seconds in timings.items():
            figure = amount / seconds / 1e9
            if name == "ferrograph":
                if unit == "GB/s":
                    note = f"{figure / self.bandwidth:.0%} of the streaming read"
                    if flops and compute_peak:
                        share = flops / seconds / 1e9 / compute_peak
                        note += f", {share:.0%} of the {'int8' if integer else 'f32'} peak"
                else:
                    of = "int8" if integer else "f32"
                    note = f"{figure / compute_peak:.0%} of the {of} peak" if compute_peak else ""
            else:
                note = f"{seconds / ours:.2f}x"
            self.rows.append((workload, name, figure, unit, note))
            print(f"  {workload:<44} {name:<18} {figure:>9.2f} {unit:<7} {note}", flush=True)


def compute_fn(cpu: fg.Backend, graph: fg.Graph) -> Callable[[], None]:
    return lambda: cpu.graph_compute(graph)


def mul_mat_case(
    table: Table,
    cpu: fg.Backend,
    repeat: int,
    dtype: fg.DType,
    m: int,
    k: int,
    n: int,
    label: str,
    peers: bool,
) -> None:
    rng = np.random.default_rng(0)
    ctx = fg.Context(no_alloc=False)
    w = ctx.new_tensor(dtype, (m, k), name="w")
    x = ctx.new_tensor(fg.float32, (n, k), name="x")
    y = fg.ops.mul_mat(w, x, ctx=ctx)
    g = fg.Graph.build(y)
    wn = (rng.standard_normal((m, k)) * 0.1).astype(np.float32)
    xn = rng.standard_normal((n, k)).astype(np.float32)
    w.set(
        fg.fp32_to_bf16(wn)
        if dtype == fg.bfloat16
        else wn.astype(np.float16)
        if dtype == fg.float16
        else wn
    )
    x.set(xn)
    flops = 2.0 * m * k * n
    fns: dict[str, Callable[[], object]] = {"ferrograph": compute_fn(cpu, g)}
    if peers:
        out = np.empty((n, m), np.float32)
        wt = wn.T
        fns["numpy"] = lambda: np.matmul(xn, wt, out=out)
        if torch is not None:
            tw, tx = torch.from_numpy(wn), torch.from_numpy(xn)
            if dtype == fg.float16:
                tw16, tx16 = tw.half(), tx.half()
                fns["torch"] = lambda: torch.matmul(tx16, tw16.T)
            else:
                fns["torch"] = lambda: torch.matmul(tx, tw.T)
    timings = interleaved_best_seconds(fns, repeat)
    integer = dtype in (fg.q8_0, fg.q4_0)
    if n <= 32 and m * k >= 1 << 24:
        # Products with few columns and weights larger than the caches are bound by reading
        # the weights: report GB/s of weight bytes.
        table.add(
            f"{label} [GB/s of weights]", w.nbytes, "GB/s", timings, integer, flops if n > 1 else 0
        )
    else:
        table.add(label, flops, "GFLOPS", timings, integer)


def binary_case(
    table: Table,
    cpu: fg.Backend,
    repeat: int,
    name: str,
    fn: Callable[..., fg.Tensor],
    npfn: Callable[..., Any],
    an: np.ndarray,
    bn: np.ndarray,
) -> None:
    ctx = fg.Context(no_alloc=False)
    a = ctx.new_tensor(fg.float32, an.shape)
    b = ctx.new_tensor(fg.float32, bn.shape)
    c = fn(a, b, ctx=ctx)
    a.set(an)
    b.set(bn)
    g = fg.Graph.build(c)
    out = np.empty_like(an)
    timings = {
        "ferrograph": best_seconds(compute_fn(cpu, g), repeat),
        "numpy": best_seconds(lambda: npfn(an, bn, out=out), repeat),
    }
    if torch is not None:
        ta, tb, tc = torch.from_numpy(an), torch.from_numpy(bn), torch.empty(an.shape)
        tfn = torch.add if name == "ADD" else torch.mul
        timings["torch"] = best_seconds(lambda: tfn(ta, tb, out=tc), repeat)
    size = an.shape[0]
    table.add(f"{name} f32 {size}x{size} [3 arrays moved]", 3 * an.nbytes, "GB/s", timings)


def elementwise_cases(table: Table, cpu: fg.Backend, repeat: int, size: int) -> None:
    rng = np.random.default_rng(1)
    an = rng.standard_normal((size, size)).astype(np.float32)
    bn = rng.standard_normal((size, size)).astype(np.float32)
    for name, fn, npfn in (
        ("ADD", fg.ops.add, np.add),
        ("MUL", fg.ops.mul, np.multiply),
    ):
        binary_case(table, cpu, repeat, name, fn, npfn, an, bn)

    # CPY f32 -> f16
    ctx = fg.Context(no_alloc=False)
    a = ctx.new_tensor(fg.float32, an.shape)
    h = ctx.new_tensor(fg.float16, an.shape)
    c = fg.ops.cpy(a, h, ctx=ctx)
    a.set(an)
    g = fg.Graph.build(c)
    out16 = np.empty(an.shape, np.float16)
    timings = {
        "ferrograph": best_seconds(compute_fn(cpu, g), repeat),
        "numpy": best_seconds(lambda: np.copyto(out16, an, casting="unsafe"), repeat),
    }
    if torch is not None:
        ta, th = torch.from_numpy(an), torch.empty(an.shape, dtype=torch.float16)
        timings["torch"] = best_seconds(lambda: th.copy_(ta), repeat)
    table.add(f"CPY f32->f16 {size}x{size} [read+write]", an.nbytes + out16.nbytes, "GB/s", timings)


def row_cases(table: Table, cpu: fg.Backend, repeat: int) -> None:
    rng = np.random.default_rng(2)
    # Softmax over MiniLM's attention scores: 12 heads x 128 x 128.
    sn = rng.standard_normal((12, 128, 128)).astype(np.float32)
    ctx = fg.Context(no_alloc=False)
    s = ctx.new_tensor(fg.float32, sn.shape)
    p = fg.ops.soft_max(s, scale=0.125, ctx=ctx)
    s.set(sn)
    g = fg.Graph.build(p)

    def np_softmax() -> None:
        z = sn * 0.125
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        e /= e.sum(axis=-1, keepdims=True)

    timings = {
        "ferrograph": best_seconds(compute_fn(cpu, g), repeat),
        "numpy": best_seconds(np_softmax, repeat),
    }
    if torch is not None:
        ts = torch.from_numpy(sn)
        timings["torch"] = best_seconds(lambda: torch.softmax(ts * 0.125, dim=-1), repeat)
    table.add("SOFT_MAX 12x128x128 [read+write]", 2 * sn.nbytes, "GB/s", timings)

    rn = rng.standard_normal((512, 4096)).astype(np.float32)
    ctx = fg.Context(no_alloc=False)
    r = ctx.new_tensor(fg.float32, rn.shape)
    q = fg.ops.rms_norm(r, 1e-6, ctx=ctx)
    r.set(rn)
    g = fg.Graph.build(q)

    def np_rms() -> None:
        _ = rn / np.sqrt(np.mean(rn * rn, axis=-1, keepdims=True) + 1e-6)

    timings = {
        "ferrograph": best_seconds(compute_fn(cpu, g), repeat),
        "numpy": best_seconds(np_rms, repeat),
    }
    if torch is not None:
        tr = torch.from_numpy(rn)
        timings["torch"] = best_seconds(
            lambda: tr * torch.rsqrt(tr.pow(2).mean(-1, keepdim=True) + 1e-6), repeat
        )
    table.add("RMS_NORM 4096x512 [read+write]", 2 * rn.nbytes, "GB/s", timings)


def blas_description() -> str:
    """Which BLAS numpy calls and which of its kernels runs (OpenBLAS picks one at load time,
    from the CPU or ``OPENBLAS_CORETYPE``): threadpoolctl's report when installed, else
    ``numpy.show_runtime``'s."""
    if threadpool_limits is not None:
        from threadpoolctl import threadpool_info

        found = [
            f"{i.get('internal_api')} {i.get('version')} kernel {i.get('architecture')}, "
            f"{i.get('num_threads')} threads"
            for i in threadpool_info()
            if i.get("user_api") == "blas"
        ]
        if found:
            return "; ".join(found)
    try:
        import contextlib
        import io

        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            np.show_runtime()
        lines = [line.strip() for line in buffer.getvalue().splitlines()]
        keys = ("internal_api", "architecture", "version")
        return ", ".join(line for line in lines if line.strip("'\",").startswith(keys)) or "?"
    except Exception as exc:  # pragma: no cover - depends on numpy's version
        return f"unknown ({exc})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--peak-gflops",
        type=float,
        default=None,
        help="f32 FMA peak of the threads used (default: measured on this machine with "
        "fg.cpu.fma_peak_gflops)",
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        help="memory GB/s (default: the fastest plain streaming read measured here)",
    )
    parser.add_argument("--quick", action="store_true", help="smaller shapes (smoke run)")
    parser.add_argument(
        "--only-matmul", action="store_true", help="the matrix products alone (f32 and typed)"
    )
    args = parser.parse_args()
    peak_source = "given"
    if args.peak_gflops is None:
        # best of a few measurements: a noisy neighbour can only make one lower
        args.peak_gflops = max(fg.cpu.fma_peak_gflops(args.threads) for _ in range(3))
        peak_source = "measured"

    if torch is not None:
        torch.set_num_threads(args.threads)
    limiter: Any = threadpool_limits(limits=args.threads) if threadpool_limits is not None else None
    cpu = fg.init_backend("CPU", n_threads=args.threads)
    print(f"ferrograph {fg.__version__}; {fg.cpu.system_info()}")
    print(
        f"threads={args.threads}; torch={'yes' if torch is not None else 'not installed'}; "
        f"numpy BLAS limited={'yes' if limiter is not None else 'no (threadpoolctl missing)'}; "
        f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '-')}, "
        f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE', '-')}"
    )
    print(f"numpy BLAS: {blas_description()}")
    print(f"f32 FMA peak of {args.threads} threads: {args.peak_gflops:.1f} GFLOPS ({peak_source})")
    int8_peak = max(fg.cpu.int8_peak_gops(args.threads) for _ in range(3))
    print(f"integer GEMM peak of {args.threads} threads: {int8_peak:.1f} GOPS (measured)")
    if args.bandwidth is None:
        args.bandwidth, read_by = streaming_read_gbs(args.threads)
        print(f"streaming read on {args.threads} threads: {args.bandwidth:.1f} GB/s ({read_by})")
    table = Table(args.peak_gflops, args.bandwidth, int8_peak)
    big_k, big_m = (1024, 2048) if args.quick else (4096, 14336)
    square = 1024 if args.quick else 4096
    r = args.repeat
    print("\nmatrix products")
    mul_mat_case(
        table,
        cpu,
        r,
        fg.float32,
        square,
        square,
        512,
        f"MUL_MAT f32 {square}x{square} by 512",
        True,
    )
    for m, k in ((384, 1536), (1536, 384), (384, 384)):
        for n in (128, 4096 if not args.quick else 512):
            mul_mat_case(
                table, cpu, r, fg.float32, m, k, n, f"MUL_MAT f32 MiniLM {m}x{k} by {n}", True
            )
    # (columns, weight types, the type measured beside its peers)
    # Low-precision weights on the MiniLM shapes (beside the f32 rows above: goal >= 1.6x).
    for m, k in ((384, 1536), (1536, 384), (384, 384)):
        for n in (128, 4096 if not args.quick else 512):
            for dtype in (fg.bfloat16, fg.q8_0):
                label = f"MUL_MAT {dtype} MiniLM {m}x{k} by {n}"
                mul_mat_case(table, cpu, r, dtype, m, k, n, label, False)
    every = (fg.float32, fg.float16, fg.bfloat16, fg.q8_0, fg.q4_0)
    # 512 columns: compute-bound; 1, 16 and 32: bound by streaming the weights (GB/s).
    for n, dtypes, with_peers in (
        (512, every, fg.float16),
        (1, every, fg.float32),
        (16, every, None),
        (32, every, None),
    ):
        for dtype in dtypes:
            label = f"MUL_MAT {dtype} {big_k}x{big_m} by {n}"
            mul_mat_case(table, cpu, r, dtype, big_m, big_k, n, label, dtype == with_peers)
    if args.only_matmul:
        return
    print("\nelementwise and copies")
    elementwise_cases(table, cpu, r, square)
    print("\nrow kernels")
    row_cases(table, cpu, r)


if __name__ == "__main__":
    main()
