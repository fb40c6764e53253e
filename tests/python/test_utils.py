"""Utilities: clocks, status strings, GUIDs, abort callbacks, thread pools, host compute,
graph copies and the two-backend comparison."""

from __future__ import annotations

import time

import numpy as np
import pytest

import ferrograph as fg
from ferrograph.plugins import NumpyRegistration


def test_clocks_and_strings() -> None:
    t0, m0, c0 = fg.time_us(), fg.time_ms(), fg.cycles()
    time.sleep(0.005)
    assert fg.time_us() - t0 >= 4000 and fg.time_ms() - m0 >= 4
    assert fg.cycles() > c0 and fg.cycles_per_ms() > 0
    assert isinstance(fg.commit(), str)
    assert fg.status_to_string(0) == "success"
    assert "aborted" in fg.status_to_string(1)
    # ggml's answer for a code that is none of its statuses.
    assert fg.status_to_string(42) == "unknown status"
    cpu = fg.init_backend("CPU")
    assert fg.guid_matches(cpu.guid, fg.init_backend("CPU").guid)
    assert not fg.guid_matches(cpu.guid, b"x" * 16)


def _small_graph(ctx: fg.Context) -> tuple[fg.Tensor, fg.Tensor, fg.Graph]:
    x = ctx.new_tensor(fg.float32, (6, 10), name="x")
    with ctx:
        y = fg.ops.soft_max(fg.ops.scale(fg.ops.sqr(x), 0.1))
    return x, y, fg.Graph.build(y)


def test_graph_compute_with_ctx_and_global_abort(rng: np.random.Generator) -> None:
    ctx = fg.Context(no_alloc=False)
    x, y, g = _small_graph(ctx)
    xn = rng.standard_normal((6, 10)).astype(np.float32)
    x.set(xn)
    fg.graph_compute_with_ctx(g, n_threads=2)
    z = 0.1 * xn.astype(np.float64) ** 2
    ref = np.exp(z - z.max(axis=1, keepdims=True))
    ref /= ref.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-6)
    fg.set_global_abort_callback(lambda: True)
    try:
        with pytest.raises(fg.AbortedError):
            fg.graph_compute_with_ctx(g, n_threads=1)
        with pytest.raises(fg.AbortedError):
            fg.init_backend("CPU").graph_compute(g)
    finally:
        fg.set_global_abort_callback(None)
    fg.graph_compute_with_ctx(g)
    with pytest.raises(fg.InvalidArgumentError):
        fg.graph_compute_with_ctx(g, n_threads=0)


def test_threadpool_attach_pause_resume(rng: np.random.Generator) -> None:
    pool = fg.Threadpool(2, paused=True)
    assert pool.n_threads == 2 and pool.is_paused
    pool.resume()
    assert not pool.is_paused
    pool.pause()
    cpu = fg.init_backend("CPU")
    pool.attach(cpu)
    ctx = fg.Context(no_alloc=False)
    x, y, g = _small_graph(ctx)
    x.set(rng.standard_normal((6, 10)).astype(np.float32))
    cpu.graph_compute(g)
    np.testing.assert_allclose(y.numpy().sum(axis=1), 1.0, rtol=1e-5)
    assert "Threadpool" in repr(pool)
    with pytest.raises(fg.InvalidArgumentError):
        fg.Threadpool(0)


def test_graph_copy_and_compare_cpu_with_numpy_plugin(rng: np.random.Generator) -> None:
    ctx = fg.Context(no_alloc=False)
    a = ctx.new_tensor(fg.float32, (4, 9), name="a")
    w = ctx.new_tensor(fg.float32, (5, 9), name="w")
    with ctx:
        y = fg.ops.relu(fg.ops.add(fg.ops.mul_mat(w, a), fg.ops.scale(fg.ops.mul_mat(w, a), -0.5)))
    g = fg.Graph.build(y)
    a.set(rng.standard_normal((4, 9)).astype(np.float32))
    w.set(rng.standard_normal((5, 9)).astype(np.float32))
    fg.register_backend(NumpyRegistration("NPCMP"))
    try:
        other = fg.init_backend("NPCMP")
        copy = fg.graph_copy(other, g)
        a2 = copy.copy_of(a)
        assert a2 is not None and not copy.buffer.is_host
        np.testing.assert_array_equal(a2.numpy(), a.numpy())
        seen: list[int] = []

        def check(i: int, t1: fg.Tensor, t2: fg.Tensor) -> bool:
            np.testing.assert_allclose(t1.numpy(), t2.numpy(), rtol=1e-5, atol=1e-5)
            seen.append(i)
            return True

        cpu = fg.init_backend("CPU")
        assert fg.compare_graph_backend(cpu, other, g, check)
        assert seen == list(range(g.n_nodes))
        assert not fg.compare_graph_backend(cpu, other, g, lambda i, t1, t2: False)

        def boom(i: int, t1: fg.Tensor, t2: fg.Tensor) -> bool:
            raise ValueError("callback failed")

        with pytest.raises(ValueError, match="callback failed"):
            fg.compare_graph_backend(cpu, other, g, boom)
    finally:
        fg.unregister_backend("NPCMP")
