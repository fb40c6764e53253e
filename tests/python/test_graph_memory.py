"""Bounded graph building: weights loaded once, a graph built per request, memory flat.

An op result built without ``ctx=`` or ``with ctx:`` belongs to no context (its holders keep it,
its first operand's context neither lists nor keeps it), so rebuilding a graph 10,000 times
against a long-lived weights context keeps that context's tensor count, its host memory and the
process RSS flat. A context given explicitly still owns what is built in it (ggml's meaning).
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import ferrograph as fg

REBUILDS = 10_000
# Allowed RSS growth over the 10,000 rebuilds after a warm-up. A leak of the per-request
# tensors would be far above it: each request below leaves at least 8 tensors (~2 KiB of
# metadata and Python objects, 20 MiB in all) and the host-memory loop 16 KiB of data each.
RSS_SLACK = 8 << 20


def rss_bytes() -> int:
    """The resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pytest.skip("no /proc/self/statm: RSS is not measurable here")


def test_rebuilding_against_a_weights_context_keeps_memory_flat(
    rng: np.random.Generator,
) -> None:
    cpu = fg.init_backend("CPU", n_threads=1)
    weights = fg.Context()
    w = weights.new_tensor(fg.float32, (16, 32), name="w")
    bias = weights.new_tensor(fg.float32, (16,), name="bias")
    buffer = fg.alloc_ctx_tensors(weights, cpu)
    assert buffer is not None
    buffer.usage = fg.BufferUsage.WEIGHTS
    wn = rng.standard_normal((16, 32)).astype(np.float32)
    bn = rng.standard_normal(16).astype(np.float32)
    w.set(wn)
    bias.set(bn)
    galloc = fg.GraphAllocator(cpu)
    xn = rng.standard_normal((4, 32)).astype(np.float32)
    want = np.maximum(xn @ wn.T + bn, 0)

    def request(i: int) -> None:
        inputs = fg.Context()  # per request: the inputs
        x = inputs.new_tensor(fg.float32, (4, 32), name="x").set_input()
        y = fg.ops.relu(fg.ops.add(fg.ops.mul_mat(w, x), bias))  # in no context
        graph = fg.Graph.build(y)
        galloc.alloc_graph(graph)
        x.set(xn)
        cpu.graph_compute(graph)
        if i % 1000 == 0:
            np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
            assert y.context == weights and y not in weights.tensors()

    for i in range(1000):  # warm-up: allocator pools, caches, interned strings
        request(i)
    gc.collect()
    before = rss_bytes()
    for i in range(REBUILDS):
        request(i)
    gc.collect()
    grown = rss_bytes() - before
    assert len(weights) == 2 and weights.tensors() == [w, bias]
    assert grown < RSS_SLACK, f"RSS grew by {grown / 2**20:.1f} MiB over {REBUILDS} rebuilds"


def test_host_memory_of_borrowed_results_is_freed_with_them() -> None:
    # An allocating weights context: each result built without ctx= gets its own host memory,
    # freed with it, instead of growing the context's arena.
    weights = fg.Context(no_alloc=False)
    w = weights.new_tensor(fg.float32, (64, 64), name="w")
    w.set(np.eye(64, dtype=np.float32))
    host_bytes = weights.host_bytes

    def request() -> None:
        y = fg.ops.scale(w, 2.0)  # 16 KiB of host memory
        fg.graph_compute_with_ctx(fg.Graph.build(y), 1)
        assert y.numpy()[3, 3] == 2.0

    for _ in range(500):
        request()
    gc.collect()
    before = rss_bytes()
    for _ in range(REBUILDS):
        request()
    gc.collect()
    grown = rss_bytes() - before
    assert len(weights) == 1 and weights.host_bytes == host_bytes
    assert grown < RSS_SLACK, f"RSS grew by {grown / 2**20:.1f} MiB over {REBUILDS} rebuilds"


def test_an_explicit_or_current_context_owns_its_results() -> None:
    weights = fg.Context()
    w = weights.new_tensor(fg.float32, (4, 8))
    x = weights.new_tensor(fg.float32, (2, 8))
    kept = fg.ops.mul_mat(w, x)  # in no context
    assert len(weights) == 2 and kept.context == weights
    fg.ops.mul_mat(w, x, ctx=weights).name = "kept"  # ggml's meaning: the context owns it
    assert len(weights) == 3 and weights.get_tensor("kept") is not None
    per_graph = fg.Context()
    with per_graph:
        fg.ops.relu(fg.ops.mul_mat(w, x))
    assert len(per_graph) == 2 and len(weights) == 3
    del per_graph  # the per-graph context frees its results with it
    assert len(weights) == 3


def test_results_without_a_context_live_as_long_as_their_holders() -> None:
    cpu = fg.init_backend("CPU", n_threads=1)
    ctx = fg.Context()
    a = ctx.new_tensor(fg.float32, (2, 3))
    y = fg.ops.relu(a)
    z = fg.ops.neg(y)  # keeps y alive through its sources
    del y
    assert ctx.tensors() == [a] and z.srcs[0].op_desc == "RELU"
    assert fg.alloc_ctx_tensors(ctx, cpu) is not None and a.is_allocated
    assert not z.is_allocated  # not the context's: a graph allocator places it
    graph = fg.Graph.build(z)
    galloc = fg.GraphAllocator(cpu)
    galloc.alloc_graph(graph)
    a.set(np.array([[1, -2, 3], [-4, 5, -6]], np.float32))
    cpu.graph_compute(graph)
    np.testing.assert_array_equal(z.numpy(), -np.maximum(a.numpy(), 0))
    # ggml's way, an explicit context, puts the results in the context's buffer
    owned = fg.ops.neg(fg.ops.relu(a, ctx=ctx), ctx=ctx)
    assert len(ctx) == 3 and fg.alloc_ctx_tensors(ctx, cpu) is not None and owned.is_allocated
