"""The split buffer type: a weight's rows spread over several devices, and a row-split
``mul_mat`` that equals the unsplit one."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest

import ferrograph as fg

TOKEN = "pytest-split-token"


def _unsplit(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``mul_mat(w, x)`` on the CPU, unsplit."""
    ctx = fg.Context(no_alloc=False)
    wt = ctx.new_tensor(fg.float32, w.shape).set(w)
    xt = ctx.new_tensor(fg.float32, x.shape).set(x)
    y = fg.ops.mul_mat(wt, xt, ctx=ctx)
    fg.graph_compute_with_ctx(fg.Graph.build(y), 1)
    return y.numpy()


def _cpu() -> fg.Device:
    cpu = fg.dev_by_type("cpu")
    assert cpu is not None
    return cpu


def _data(rows: int, k: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, k)).astype(np.float32)
    x = rng.standard_normal((n, k)).astype(np.float32)
    return w, x


@pytest.mark.parametrize("shares", [[], [1.0, 1.0, 1.0], [1.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
def test_row_split_mul_mat_on_cpu_devices_equals_the_unsplit_one(shares: list[float]) -> None:
    cpu = _cpu()
    split = fg.SplitBufferType([cpu, cpu, cpu], tensor_split=shares)
    rows, k, n = 37, 64, 5
    w, x = _data(rows, k, n)
    weight = split.alloc_weight((rows, k))
    assert weight.shape == (rows, k) and weight.dtype is fg.float32
    assert weight.set(w) is weight
    ranges = split.row_ranges(rows)
    # Contiguous, in order, covering every row once; a zero share holds nothing.
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    parts = weight.parts()
    assert [p[1] for p in parts] == [r for r in ranges if r[1] > r[0]]
    for _, (start, stop), tensor in parts:
        assert tensor.shape == (stop - start, k)
        np.testing.assert_array_equal(tensor.numpy(), w[start:stop])
    # Each part computes whole dot products, and a CPU product's element depends only on its
    # own weight row and column, so the parts give the unsplit product's bits.
    got = weight.mul_mat(x)
    assert got.shape == (n, rows) and got.dtype == np.float32
    np.testing.assert_array_equal(got, _unsplit(w, x))
    np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(weight.mul_mat(x[1]), got[1])


def test_proportions_follow_the_shares() -> None:
    cpu = _cpu()
    split = fg.SplitBufferType([cpu, cpu, cpu], [1.0, 2.0, 1.0])
    assert split.row_ranges(8) == [(0, 2), (2, 6), (6, 8)]
    assert split.row_ranges(1) == [(0, 0), (0, 1), (1, 1)]
    assert len(split.devices) == 3 and "CPU" in repr(split)


def test_f16_weight_split_equals_unsplit_f16() -> None:
    cpu = _cpu()
    split = fg.SplitBufferType([cpu, cpu], [1.0, 3.0])
    w, x = _data(19, 32, 3, seed=1)
    w16 = w.astype(np.float16)
    weight = split.alloc_weight((19, 32), fg.float16).set(w16)
    assert weight.dtype is fg.float16
    ctx = fg.Context(no_alloc=False)
    wt = ctx.new_tensor(fg.float16, w.shape).set(w16)
    xt = ctx.new_tensor(fg.float32, x.shape).set(x)
    y = fg.ops.mul_mat(wt, xt, ctx=ctx)
    fg.graph_compute_with_ctx(fg.Graph.build(y), 1)
    np.testing.assert_array_equal(weight.mul_mat(x), y.numpy())


def test_devices_of_one_python_registration() -> None:
    """A registration of three (Python, numpy-kernel) devices: each part lives in its device's
    own memory and is multiplied by that device's backend."""

    class ThreeNumpyDevices(fg.plugins.NumpyRegistration):
        def __init__(self) -> None:
            super().__init__("SPLITNP")
            self._devices = [type(self._devices[0])(f"SPLITNP{i}") for i in range(3)]

    fg.register_backend(ThreeNumpyDevices())
    try:
        registration = fg.reg_by_name("SPLITNP")
        assert registration is not None
        split = fg.SplitBufferType(registration, tensor_split=[2.0, 1.0, 1.0])
        assert split.registration == "SPLITNP"
        assert [d.name for d in split.devices] == ["SPLITNP0", "SPLITNP1", "SPLITNP2"]
        w, x = _data(10, 8, 4, seed=2)
        weight = split.alloc_weight((10, 8)).set(w)
        assert [p[0].name for p in weight.parts()] == ["SPLITNP0", "SPLITNP1", "SPLITNP2"]
        np.testing.assert_allclose(weight.mul_mat(x), _unsplit(w, x), rtol=1e-5, atol=1e-5)
    finally:
        fg.unregister_backend("SPLITNP")


def test_bad_input_is_an_error() -> None:
    cpu = _cpu()
    with pytest.raises(fg.InvalidArgumentError):
        fg.SplitBufferType([cpu, cpu], [1.0])  # one share for two devices
    with pytest.raises(fg.InvalidArgumentError):
        fg.SplitBufferType([cpu, cpu], [1.0, -1.0])
    with pytest.raises(fg.InvalidArgumentError):
        fg.SplitBufferType([cpu, cpu], [1.0, float("nan")])
    with pytest.raises(fg.InvalidArgumentError):
        fg.SplitBufferType([])
    with pytest.raises(fg.InvalidArgumentError):
        fg.SplitBufferType([cpu, "CPU"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        fg.SplitBufferType(3)  # type: ignore[arg-type]
    split = fg.SplitBufferType([cpu, cpu])
    weight = split.alloc_weight((4, 6))
    with pytest.raises(fg.ShapeError):
        weight.set(np.zeros((4, 5), np.float32))
    with pytest.raises(fg.ShapeError):
        weight.mul_mat(np.zeros((2, 5), np.float32))
    with pytest.raises(fg.ShapeError):
        weight.mul_mat(np.zeros((2, 2, 6), np.float32))
    with pytest.raises(fg.Error):
        split.alloc_weight((1 << 40, 1 << 40))


@pytest.fixture(scope="module")
def servers() -> Iterator[list[fg.remote.ServerProcess]]:
    procs = [fg.remote.spawn_server(TOKEN, n_threads=1) for _ in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def test_rows_split_over_two_remote_servers(servers: list[fg.remote.ServerProcess]) -> None:
    """The devices of two servers belong to separate registrations; the split takes a list of
    devices, so a weight's rows can live on both."""
    devices = [fg.remote.connect(s.address, token=TOKEN)[0] for s in servers]
    split = fg.SplitBufferType(devices, tensor_split=[1.0, 2.0])
    w, x = _data(23, 16, 3, seed=3)
    weight = split.alloc_weight((23, 16)).set(w)
    assert [p[0].name for p in weight.parts()] == [d.name for d in devices]
    np.testing.assert_allclose(weight.mul_mat(x), _unsplit(w, x), rtol=1e-6, atol=1e-5)


# ----- split weights in ordinary graphs, placed by the scheduler -----


def _mlp(
    w: np.ndarray, b: np.ndarray, x_shape: tuple[int, ...], buft: fg.BufferType, dtype: fg.DType
) -> tuple[fg.Tensor, fg.Tensor, fg.Graph, list[fg.Buffer]]:
    """``y = mul_mat(w, x) + b`` with ``w`` allocated in ``buft`` and ``b`` in host memory,
    both buffers marked as weights; returns ``(x, y, graph, buffers)``."""
    wctx, bctx, ctx = fg.Context(no_alloc=True), fg.Context(no_alloc=True), fg.Context()
    wt = wctx.new_tensor(dtype, w.shape)
    bt = bctx.new_tensor(fg.float32, b.shape)
    buffers = [fg.alloc_ctx_tensors(wctx, buft), fg.alloc_ctx_tensors(bctx, fg.cpu_buffer_type())]
    kept = [buf for buf in buffers if buf is not None]
    for buf in kept:
        buf.usage = fg.BufferUsage.WEIGHTS
    wt.set(w.astype(np.float16) if dtype is fg.float16 else w)
    bt.set(b)
    x = ctx.new_tensor(fg.float32, x_shape).set_input()
    y = fg.ops.add(fg.ops.mul_mat(wt, x, ctx=ctx), bt, ctx=ctx).set_output()
    return x, y, fg.Graph.build(y), kept


def _sched_compute(
    split: fg.SplitBufferType, w: np.ndarray, b: np.ndarray, x: np.ndarray, dtype: fg.DType
) -> tuple[np.ndarray, fg.Scheduler]:
    xt, y, graph, _buffers = _mlp(w, b, x.shape, split, dtype)
    split_device = split.device
    assert split_device is not None
    sched = fg.Scheduler([split_device.init_backend(), fg.init_backend("CPU", n_threads=2)])
    sched.alloc_graph(graph)
    xt.set(x)
    sched.graph_compute(graph)
    return y.numpy(), sched


def _unsplit_mlp(w: np.ndarray, b: np.ndarray, x: np.ndarray, dtype: fg.DType) -> np.ndarray:
    xt, y, graph, _buffers = _mlp(w, b, x.shape, fg.cpu_buffer_type(), dtype)
    cpu = fg.init_backend("CPU", n_threads=2)
    fg.GraphAllocator(cpu).alloc_graph(graph)
    xt.set(x)
    cpu.graph_compute(graph)
    return y.numpy()


@pytest.mark.parametrize("dtype", [fg.float32, fg.float16])
@pytest.mark.parametrize("x_shape", [(4, 64), (40, 64), (2, 3, 64)])
def test_scheduler_runs_a_split_weight_mul_mat_on_the_split_backend(
    dtype: fg.DType, x_shape: tuple[int, ...]
) -> None:
    cpu = _cpu()
    split = fg.SplitBufferType([cpu, cpu, cpu], tensor_split=[1.0, 2.0, 0.5])
    assert isinstance(split, fg.BufferType) and not split.is_host
    rng = np.random.default_rng(5)
    w = rng.standard_normal((37, 64)).astype(np.float32)
    if dtype is fg.float16:
        w = w.astype(np.float16).astype(np.float32)
    b = rng.standard_normal(37).astype(np.float32)
    x = rng.standard_normal(x_shape).astype(np.float32)
    got, sched = _sched_compute(split, w, b, x, dtype)
    want = _unsplit_mlp(w, b, x, dtype)
    assert got.shape == (*x_shape[:-1], 37)
    # Every path (GEMM, register tiles padded at a part's last rows) computes each element
    # from its own weight row and column, so the parts give the unsplit bits.
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, x @ w.T + b, rtol=1e-4, atol=1e-4)
    # What the scheduler did: the product on the split backend because of its weight, the
    # bias add on the CPU, nothing copied (both compute in host memory).
    plan = sched.plan
    assert plan is not None
    assert plan.backend_names[0] == "CPU+CPU+CPU_Split"
    (mm,) = [n for n in plan.nodes if n["op"] == "MUL_MAT"]
    assert (mm["backend"], mm["cause"]) == ("CPU+CPU+CPU_Split", "weight")
    (add,) = [n for n in plan.nodes if n["op"] == "ADD"]
    assert add["backend"] == "CPU"
    assert plan.copies == []
    assert [s["backend"] for s in plan.splits] == ["CPU+CPU+CPU_Split", "CPU"]


def test_split_tensor_parts_and_reads() -> None:
    cpu = _cpu()
    split = fg.SplitBufferType([cpu, cpu, cpu], [1.0, 2.0, 1.0])
    ctx = fg.Context(no_alloc=True)
    w = ctx.new_tensor(fg.float32, (8, 5))
    buffer = fg.alloc_ctx_tensors(ctx, split)
    assert buffer is not None and buffer.buffer_type == split
    data = np.arange(40, dtype=np.float32).reshape(8, 5)
    w.set(data)
    parts = split.tensor_parts(w)
    assert [p[1] for p in parts] == [(0, 2), (2, 6), (6, 8)]
    for _, (start, stop), part in parts:
        np.testing.assert_array_equal(part.numpy(), data[start:stop])
    np.testing.assert_array_equal(w.numpy(), data)
    device = split.device
    assert device is not None and device.name == split.name == "CPU+CPU+CPU_Split"
    other = fg.Context().new_tensor(fg.float32, (8, 5))
    with pytest.raises(fg.InvalidArgumentError):
        split.tensor_parts(other)
    # Matrices only: rows of a 3-D tensor cannot be split.
    ctx3 = fg.Context(no_alloc=True)
    ctx3.new_tensor(fg.float32, (2, 3, 4))
    with pytest.raises(fg.ShapeError, match="2-D"):
        fg.alloc_ctx_tensors(ctx3, split)
    weight = split.alloc_weight((8, 5)).set(data)
    np.testing.assert_array_equal(weight.tensor.numpy(), data)


def test_split_weight_under_an_unsupported_op_is_a_clear_error() -> None:
    cpu = _cpu()
    split = fg.SplitBufferType([cpu, cpu])
    wctx = fg.Context(no_alloc=True)
    w = wctx.new_tensor(fg.float32, (6, 8))
    _buffer = fg.alloc_ctx_tensors(wctx, split)
    w.set(np.ones((6, 8), np.float32))
    ctx = fg.Context()
    x = ctx.new_tensor(fg.float32, (6, 8)).set_input()
    split_device = split.device
    assert split_device is not None
    sched = fg.Scheduler([split_device.init_backend(), fg.init_backend("CPU")])
    graph = fg.Graph.build(fg.ops.add(w, x, ctx=ctx))
    with pytest.raises(fg.UnsupportedOpError, match="split by rows") as info:
        sched.alloc_graph(graph)
    assert info.value.op == "ADD"
    # Without the split backend no backend can read the weight at all: also an error, not a
    # silent copy of the whole weight to the CPU.
    graph = fg.Graph.build(fg.ops.mul_mat(w, x, ctx=ctx))
    with pytest.raises(fg.UnsupportedOpError, match="CPU\\+CPU_Split"):
        fg.Scheduler([fg.init_backend("CPU")]).alloc_graph(graph)


def test_scheduler_with_a_weight_split_over_two_remote_servers(
    servers: list[fg.remote.ServerProcess],
) -> None:
    devices = [fg.remote.connect(s.address, token=TOKEN)[0] for s in servers]
    split = fg.SplitBufferType(devices, tensor_split=[1.0, 2.0])
    rng = np.random.default_rng(7)
    w = rng.standard_normal((23, 64)).astype(np.float32)
    b = rng.standard_normal(23).astype(np.float32)
    x = rng.standard_normal((40, 64)).astype(np.float32)
    got, sched = _sched_compute(split, w, b, x, fg.float32)
    # The servers run the same kernels (the GEMM path at 40 columns): identical bits.
    np.testing.assert_array_equal(got, _unsplit_mlp(w, b, x, fg.float32))
    plan = sched.plan
    assert plan is not None
    (mm,) = [n for n in plan.nodes if n["op"] == "MUL_MAT"]
    assert mm["backend"] == split.name and mm["cause"] == "weight"
