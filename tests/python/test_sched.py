"""The scheduler from Python: CPU alone, CPU with a Python backend whose memory is not host
memory (every cross-backend edge is a real copy), pins, the evaluation callback, the plan,
and bad input."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import ferrograph as fg
from ferrograph.plugins import NumpyRegistration


@pytest.fixture
def cpu() -> fg.Backend:
    return fg.init_backend("CPU", n_threads=2)


@pytest.fixture
def npb() -> Iterator[fg.Backend]:
    fg.register_backend(NumpyRegistration("NPSCHED"))
    try:
        yield fg.init_backend("NPSCHED")
    finally:
        fg.unregister_backend("NPSCHED")


def _mlp(
    rng: np.random.Generator, cpu: fg.Backend
) -> tuple[fg.Graph, fg.Tensor, list[fg.Tensor], np.ndarray, np.ndarray, fg.Buffer]:
    wctx = fg.Context()
    w1 = wctx.new_tensor(fg.float32, (16, 8), name="w1")
    w2 = wctx.new_tensor(fg.float32, (8, 16), name="w2")
    weights = fg.alloc_ctx_tensors(wctx, cpu)
    assert weights is not None
    weights.usage = fg.BufferUsage.WEIGHTS
    w1n = rng.standard_normal((16, 8)).astype(np.float32)
    w2n = rng.standard_normal((8, 16)).astype(np.float32)
    w1.set(w1n)
    w2.set(w2n)
    ctx = fg.Context()
    x = ctx.new_tensor(fg.float32, (4, 8), name="x")
    x.set_input()
    with ctx:
        h = fg.ops.relu(fg.ops.mul_mat(w1, x))
        h.name = "h"
        s = fg.ops.scale(h, 0.5)
        s.name = "s"
        y = fg.ops.add(fg.ops.mul_mat(w2, s), x)
        y.name = "y"
    y.set_output()
    return fg.Graph.build(y), x, [h, s, y], w1n, w2n, weights


def _compute_checked(
    sched: fg.Scheduler,
    g: fg.Graph,
    x: fg.Tensor,
    y: fg.Tensor,
    xn: np.ndarray,
    w: tuple[np.ndarray, np.ndarray],
    alloc: bool = True,
) -> None:
    """(Allocates,) sets the input, computes and checks ``y`` against numpy."""
    if alloc:
        sched.alloc_graph(g)
    x.set(xn)
    sched.graph_compute(g)
    np.testing.assert_allclose(y.numpy(), _reference(xn, *w), rtol=1e-4, atol=1e-4)


def _reference(xn: np.ndarray, w1n: np.ndarray, w2n: np.ndarray) -> np.ndarray:
    h = np.maximum(xn @ w1n.T, 0) * 0.5
    return h @ w2n.T + xn


def test_cpu_only_scheduler_reserve_and_recompute(
    cpu: fg.Backend, rng: np.random.Generator
) -> None:
    g, x, (_, _, y), w1n, w2n, _w = _mlp(rng, cpu)
    sched = fg.Scheduler([cpu])
    assert sched.n_backends == 1 and sched.backends[0] == cpu
    sched.reserve(g)
    assert sched.get_buffer_size(cpu) > 0
    for _ in range(3):
        xn = rng.standard_normal((4, 8)).astype(np.float32)
        _compute_checked(sched, g, x, y, xn, (w1n, w2n))
    assert sched.n_splits == 1
    plan = sched.plan
    assert plan is not None and plan.backend_names == ["CPU"]
    assert len(plan.splits) == 1 and plan.copies == []
    # Products follow their weights (a WEIGHTS buffer); the rest expands from them.
    assert {n["cause"] for n in plan.nodes if n["op"] == "MUL_MAT"} == {"weight"}
    assert {n["cause"] for n in plan.nodes if n["op"] != "MUL_MAT"} == {"expand"}
    assert "CPU" in str(plan) and "digraph" in plan.to_dot()
    assert "<table>" in plan._repr_html_()
    # Planned once by reserve; the three allocations reused that plan.
    assert sched.plan_cache_stats == (3, 1)


def test_cpu_and_python_backend_with_pins(
    cpu: fg.Backend, npb: fg.Backend, rng: np.random.Generator
) -> None:
    g, x, (_h, s, y), w1n, w2n, _w = _mlp(rng, cpu)
    sched = fg.Scheduler([npb, cpu])
    sched.set_tensor_backend(s, npb)
    assert sched.get_tensor_backend(s) == npb
    xn = rng.standard_normal((4, 8)).astype(np.float32)
    keep = xn.copy()
    _compute_checked(sched, g, x, y, xn, (w1n, w2n))
    np.testing.assert_array_equal(x.numpy(), keep)  # inputs unchanged
    assert sched.n_splits >= 3  # CPU -> NPSCHED -> CPU
    plan = sched.plan
    assert plan is not None
    by_name = {n["name"]: n for n in plan.nodes}
    assert by_name["s"]["backend"] == "NPSCHED" and by_name["s"]["cause"] == "pinned"
    assert {n["backend"] for n in plan.nodes} == {"NPSCHED", "CPU"}
    assert len(plan.copies) >= 2
    assert {c["to_backend"] for c in plan.copies} == {"NPSCHED", "CPU"}
    assert plan.buffer_sizes["NPSCHED"] > 0
    # Recompute with new inputs; the plan is reused.
    xn2 = rng.standard_normal((4, 8)).astype(np.float32)
    _compute_checked(sched, g, x, y, xn2, (w1n, w2n), alloc=False)


def test_pipelined_scheduler_matches(
    cpu: fg.Backend, npb: fg.Backend, rng: np.random.Generator
) -> None:
    g, x, (_, s, y), w1n, w2n, _w = _mlp(rng, cpu)
    sched = fg.Scheduler([npb, cpu], parallel=True)
    assert sched.n_copies > 1
    sched.set_tensor_backend(s, npb)
    for _ in range(3):
        xn = rng.standard_normal((4, 8)).astype(np.float32)
        _compute_checked(sched, g, x, y, xn, (w1n, w2n))
    sched.n_copies = 1
    assert sched.n_copies == 1


def test_eval_callback_order_and_cancel(cpu: fg.Backend, rng: np.random.Generator) -> None:
    g, x, (_, _, _y), *_ = _mlp(rng, cpu)
    sched = fg.Scheduler([cpu])
    seen: list[tuple[str, bool]] = []

    def observe(t: fg.Tensor, ask: bool) -> bool:
        seen.append((t.name, ask))
        if not ask and t.name == "s":
            assert np.all(t.numpy() >= 0)  # relu then scale: data readable here
        return True

    sched.set_eval_callback(observe)
    sched.alloc_graph(g)
    x.set(rng.standard_normal((4, 8)).astype(np.float32))
    sched.graph_compute(g)
    observed = [name for name, ask in seen if not ask]
    assert observed.index("h") < observed.index("s") < observed.index("y")

    sched.set_eval_callback(lambda t, ask: ask or t.name != "s")
    with pytest.raises(fg.AbortedError):
        sched.graph_compute(g)
    sched.set_eval_callback(None)
    sched.graph_compute(g)  # usable again


def test_is_allocated_lets_a_graph_recompute_with_new_inputs(
    cpu: fg.Backend, rng: np.random.Generator
) -> None:
    g, x, (_, _, y), w1n, w2n, _w = _mlp(rng, cpu)
    g2, x2, (_, _, y2), w1m, w2m, _w2 = _mlp(rng, cpu)
    sched = fg.Scheduler([cpu])
    assert not sched.is_allocated(g)
    sched.alloc_graph(g)
    assert sched.is_allocated(g) and not sched.is_allocated(g2)
    for _ in range(3):  # one input after another, allocated once
        _compute_checked(
            sched, g, x, y, rng.standard_normal((4, 8)).astype(np.float32), (w1n, w2n), alloc=False
        )
        assert sched.is_allocated(g)
    sched.alloc_graph(g2)  # another graph: g must be allocated again
    assert sched.is_allocated(g2) and not sched.is_allocated(g)
    _compute_checked(
        sched, g2, x2, y2, rng.standard_normal((4, 8)).astype(np.float32), (w1m, w2m), alloc=False
    )
    sched.reset()
    assert not sched.is_allocated(g2)
    sched.reserve(g)
    assert not sched.is_allocated(g)


def test_reset_makes_tensors_stale_and_realloc(cpu: fg.Backend, rng: np.random.Generator) -> None:
    g, x, (_, _, y), *_ = _mlp(rng, cpu)
    sched = fg.Scheduler([cpu])
    sched.alloc_graph(g)
    x.set(rng.standard_normal((4, 8)).astype(np.float32))
    sched.graph_compute(g)
    sched.reset()
    with pytest.raises((fg.StaleTensorError, fg.NotAllocatedError)):
        y.numpy()
    ctx = fg.Context()
    a = ctx.new_tensor(fg.float32, (3,), name="a")
    a.set_input()
    b = fg.ops.sqr(a, ctx=ctx)
    g2 = fg.Graph.build(b)
    sched.alloc_graph(g2)
    a.set(np.array([1, 2, 3], np.float32))
    sched.graph_compute(g2)
    np.testing.assert_array_equal(b.numpy(), [1, 4, 9])


def test_bad_input(cpu: fg.Backend, npb: fg.Backend) -> None:
    with pytest.raises(fg.InvalidArgumentError, match="CPU"):
        fg.Scheduler([npb])
    with pytest.raises(fg.InvalidArgumentError):
        fg.Scheduler([])
    sched = fg.Scheduler([npb, cpu])
    ctx = fg.Context()
    a = ctx.new_tensor(fg.float32, (8,), name="a")
    sm = fg.ops.soft_max(a, ctx=ctx)  # the numpy plugin has no SOFT_MAX
    with pytest.raises(fg.UnsupportedOpError):
        sched.set_tensor_backend(sm, npb)
    with pytest.raises(fg.InvalidArgumentError):
        sched.offload_policy = "sometimes"
    sched.offload_policy = 32
    assert sched.offload_policy == 32
    with pytest.raises(fg.OutOfBoundsError):
        sched.get_backend(5)
