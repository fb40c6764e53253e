"""Side-by-side throughput of ferrograph and its peers, measured in one run.

Run with ``python benches/compare.py`` (after ``bash scripts/dev.sh test`` or ``maturin develop
--release``). Prints one table per workload: GB/s of output for each implementation and the
ratio of ferrograph to each peer. PyTorch is included when it is installed.

Peers for the row conversions: numpy's ``astype`` (with ``out=`` via ``np.copyto``), a plain
``np.copyto`` of the same number of output bytes (the memory-bandwidth yardstick), and
PyTorch's ``Tensor.copy_`` with 2 threads.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from _bench_timing import best_seconds

import ferrograph as fg

try:  # optional peer
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    torch = None


def report(title: str, out_bytes: int, timings: dict[str, float]) -> None:
    ours = timings["ferrograph"]
    print(f"\n{title}  ({out_bytes / 1e6:.1f} MB of output)")
    print(f"  {'implementation':<22} {'GB/s':>8} {'ferrograph / peer':>18}")
    for name, seconds in timings.items():
        ratio = "" if name == "ferrograph" else f"{seconds / ours:>17.2f}x"
        print(f"  {name:<22} {out_bytes / seconds / 1e9:>8.2f} {ratio:>18}")


def bench_conversions(n: int, repeat: int) -> None:
    rng = np.random.default_rng(0)
    x32 = rng.standard_normal(n).astype(np.float32)
    x16 = x32.astype(np.float16)
    out16 = np.empty(n, np.float16)
    out32 = np.empty(n, np.float32)
    bits_out = np.empty(n, np.uint16)
    copy_src16 = np.empty(n, np.float16)
    copy_src32 = np.empty(n, np.float32)

    timings = {
        "ferrograph": best_seconds(lambda: fg.fp32_to_fp16(x32, out=out16), repeat),
        "numpy astype": best_seconds(lambda: np.copyto(out16, x32, casting="unsafe"), repeat),
        "memcpy (np.copyto)": best_seconds(lambda: np.copyto(out16, copy_src16), repeat),
    }
    if torch is not None:
        t32 = torch.from_numpy(x32)
        t16 = torch.empty(n, dtype=torch.float16)
        timings["torch copy_"] = best_seconds(lambda: t16.copy_(t32), repeat)
    report(f"f32 -> f16 rows, n={n}", out16.nbytes, timings)

    timings = {
        "ferrograph": best_seconds(lambda: fg.fp16_to_fp32(x16, out=out32), repeat),
        "numpy astype": best_seconds(lambda: np.copyto(out32, x16, casting="unsafe"), repeat),
        "memcpy (np.copyto)": best_seconds(lambda: np.copyto(out32, copy_src32), repeat),
    }
    if torch is not None:
        h16 = torch.from_numpy(x16)
        f32 = torch.empty(n, dtype=torch.float32)
        timings["torch copy_"] = best_seconds(lambda: f32.copy_(h16), repeat)
    report(f"f16 -> f32 rows, n={n}", out32.nbytes, timings)

    bf_out = fg.fp32_to_bf16(x32)
    timings = {
        "ferrograph": best_seconds(lambda: fg.fp32_to_bf16(x32, out=bf_out), repeat),
        "memcpy (np.copyto)": best_seconds(
            lambda: np.copyto(bits_out, copy_src16.view(np.uint16)), repeat
        ),
    }
    try:
        import ml_dtypes

        bf_np = np.empty(n, ml_dtypes.bfloat16)
        timings["numpy astype (ml_dtypes)"] = best_seconds(
            lambda: np.copyto(bf_np, x32, casting="unsafe"), repeat
        )
    except ImportError:
        pass
    if torch is not None:
        tb = torch.empty(n, dtype=torch.bfloat16)
        t32 = torch.from_numpy(x32)
        timings["torch copy_"] = best_seconds(lambda: tb.copy_(t32), repeat)
    report(f"f32 -> bf16 rows, n={n}", n * 2, timings)

    timings = {
        "ferrograph": best_seconds(lambda: fg.bf16_to_fp32(bf_out, out=out32), repeat),
        "memcpy (np.copyto)": best_seconds(lambda: np.copyto(out32, copy_src32), repeat),
    }
    report(f"bf16 -> f32 rows, n={n}", out32.nbytes, timings)


def bench_tensor_io(n: int, repeat: int) -> None:
    """Tensor set/get between numpy and a CPU tensor, beside a plain numpy copy."""
    rng = np.random.default_rng(1)
    src = rng.standard_normal(n).astype(np.float32)
    dst = np.empty_like(src)
    ctx = fg.Context()
    t = ctx.new_tensor(fg.float32, (n,), name="t")
    cpu = fg.init_backend("CPU")
    buf = fg.alloc_ctx_tensors(ctx, cpu)
    assert buf is not None
    timings = {
        "ferrograph": best_seconds(lambda: t.set(src), repeat),
        "memcpy (np.copyto)": best_seconds(lambda: np.copyto(dst, src), repeat),
    }
    report(f"tensor.set(numpy) f32, n={n}", src.nbytes, timings)
    timings = {
        "ferrograph": best_seconds(lambda: t.numpy(), repeat),
        "np.array copy": best_seconds(lambda: np.array(src, copy=True), repeat),
    }
    report(f"tensor.numpy() f32, n={n}", src.nbytes, timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 24, help="elements per row conversion")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (best is kept)")
    parser.add_argument("--threads", type=int, default=2, help="threads for every implementation")
    args = parser.parse_args()

    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    if torch is not None:
        torch.set_num_threads(args.threads)
    print(f"ferrograph {fg.__version__}; {fg.cpu.system_info()}")
    print(f"threads={args.threads}; torch={'yes' if torch is not None else 'not installed'}")
    bench_conversions(args.n, args.repeat)
    bench_tensor_io(args.n, args.repeat)


if __name__ == "__main__":
    main()
