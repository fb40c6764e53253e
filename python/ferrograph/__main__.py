"""Command line: ``python -m ferrograph demo``.

``demo`` prints the version and the CPU's detected SIMD features, builds a small graph (a
two-layer MLP block with a residual, layer norm and a softmax head), computes it on the CPU
backend and checks every output against numpy.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import ferrograph as fg


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.sqrt(2.0 / np.pi)
    return 0.5 * x * (1.0 + np.tanh(c * (x + 0.044715 * x**3)))


def _nmse(actual: np.ndarray, expected: np.ndarray) -> float:
    expected64 = expected.astype(np.float64)
    denominator = float(np.sum(expected64**2)) or 1.0
    return float(np.sum((actual.astype(np.float64) - expected64) ** 2)) / denominator


def demo(n_threads: int, batch: int, hidden: int) -> int:
    """Runs the demo; returns a process exit code."""
    print(f"ferrograph {fg.__version__}")
    print(f"system: {fg.cpu.system_info()}")
    detected = [name for name, on in fg.cpu.features().items() if on is True]
    print(f"SIMD features: {', '.join(detected) or 'none'}; row conversions use {fg.simd_path()}")
    print("devices:")
    for device in fg.devices():
        free, total = device.memory
        print(f"  {device.name:<6} {device.type.name:<6} {device.description} "
              f"({free / 2**30:.1f} of {total / 2**30:.1f} GiB free)")

    rng = np.random.default_rng(42)
    inner = 4 * hidden
    x_np = rng.standard_normal((batch, hidden), dtype=np.float32)
    w1_np = (rng.standard_normal((inner, hidden)) / np.sqrt(hidden)).astype(np.float16)
    b1_np = rng.standard_normal(inner).astype(np.float32) * 0.1
    w2_np = (rng.standard_normal((hidden, inner)) / np.sqrt(inner)).astype(np.float32)

    # Metadata first (no memory), then one allocation for every tensor of the context.
    ctx = fg.Context(no_alloc=False)
    with ctx:
        x = ctx.new_tensor(fg.float32, x_np.shape, name="x")
        w1 = ctx.new_tensor(fg.float16, w1_np.shape, name="w1")
        b1 = ctx.new_tensor(fg.float32, b1_np.shape, name="b1")
        w2 = ctx.new_tensor(fg.float32, w2_np.shape, name="w2")
        x.set_input()
        h = fg.ops.gelu(fg.ops.add(fg.ops.mul_mat(w1, x), b1))  # (batch, inner) = x @ w1.T + b1
        y = fg.ops.add(fg.ops.mul_mat(w2, h), x)  # residual
        y = fg.ops.norm(y, 1e-5)
        probs = fg.ops.soft_max(y)
        probs.name = "probs"
        probs.set_output()
    graph = fg.Graph.build(probs)
    print(f"graph: {graph.n_nodes} nodes, {graph.n_leafs} leafs")

    for tensor, value in ((x, x_np), (w1, w1_np), (b1, b1_np), (w2, w2_np)):
        tensor.set(value)

    cpu = fg.init_backend("CPU", n_threads=n_threads)
    start = time.perf_counter()
    status = cpu.graph_compute(graph)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    print(f"compute on {cpu.name} with {n_threads} threads: {status} in {elapsed_ms:.2f} ms")

    h_ref = _gelu_tanh(x_np @ w1_np.astype(np.float32).T + b1_np)
    y_ref = h_ref @ w2_np.T + x_np
    y_ref = (y_ref - y_ref.mean(axis=1, keepdims=True)) / np.sqrt(y_ref.var(axis=1, keepdims=True) + 1e-5)
    e = np.exp(y_ref - y_ref.max(axis=1, keepdims=True))
    probs_ref = e / e.sum(axis=1, keepdims=True)

    error = _nmse(probs.numpy(), probs_ref)
    limit = 5e-4
    ok = error <= limit
    print(f"check against numpy: NMSE {error:.2e} (limit {limit:.0e}) -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ferrograph", description="ferrograph command line")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="detect SIMD, compute a small graph, check it against numpy")
    demo_parser.add_argument("--threads", type=int, default=2)
    demo_parser.add_argument("--batch", type=int, default=8)
    demo_parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args(argv)
    if args.command == "demo":
        try:
            return demo(args.threads, args.batch, args.hidden)
        except fg.Error as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
