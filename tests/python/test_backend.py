"""Devices, backends, buffers, the registry and allocation from Python, on the CPU backend."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import ferrograph as fg


@pytest.fixture
def cpu() -> fg.Backend:
    return fg.init_backend("CPU", n_threads=2)


def test_registry_lists_the_cpu() -> None:
    devices = fg.devices()
    assert fg.dev_count() == len(devices) >= 1
    cpu_dev = fg.dev_by_name("cpu")  # case-insensitive
    assert cpu_dev is not None and cpu_dev == fg.dev_get(0)
    assert cpu_dev.type == fg.DeviceType.CPU and cpu_dev.type.name == "CPU"
    assert fg.dev_by_type("cpu") == cpu_dev
    assert fg.dev_by_type(fg.DeviceType.GPU) is None
    free, total = cpu_dev.memory
    assert 0 < free <= total
    props = cpu_dev.props()
    assert props["name"] == "CPU" and set(props["caps"]) >= {"async", "events"}
    assert "CPU" in repr(cpu_dev)
    reg = fg.reg_by_name("CPU")
    assert reg is not None and reg.dev_count == 1
    assert reg.has_proc("set_n_threads") and not reg.has_proc("no_such_function")
    assert "SIMD_PATH" in reg.features()
    assert fg.registrations()[0].name == "CPU"


def test_unknown_backend_and_bad_arguments() -> None:
    with pytest.raises(fg.BackendError, match="NOPE"):
        fg.init_backend("NOPE")
    with pytest.raises(fg.InvalidArgumentError):
        fg.init_backend("CPU", n_threads=0)
    with pytest.raises(fg.InvalidArgumentError):
        fg.init_by_type("quantum")
    with pytest.raises(fg.OutOfBoundsError):
        fg.dev_get(10_000)


def test_backend_properties(cpu: fg.Backend) -> None:
    assert cpu.name == "CPU" and cpu.is_cpu
    assert len(cpu.guid) == 16
    assert cpu.n_threads == 2
    cpu.n_threads = 1
    assert cpu.n_threads == 1
    assert cpu.default_buffer_type == fg.cpu_buffer_type()
    assert cpu.alignment == 64 and cpu.default_buffer_type.is_host
    assert fg.init_best().is_cpu
    assert fg.init_by_type(fg.DeviceType.CPU, n_threads=1).n_threads == 1
    assert fg.reg_by_name("cpu") is not None


def test_buffer_read_write_bounds_and_stale(cpu: fg.Backend) -> None:
    buf = cpu.alloc_buffer(128)
    assert buf.size == len(buf) == 128 and buf.is_host and buf.base is not None
    assert buf.base % buf.alignment == 0
    buf.write(8, b"\x01\x02\x03")
    assert buf.read(8, 3) == b"\x01\x02\x03"
    buf.clear(7)
    assert buf.read(0, 2) == b"\x07\x07"
    with pytest.raises(fg.OutOfBoundsError):
        buf.write(127, b"ab")
    with pytest.raises(fg.OutOfBoundsError):
        buf.read(100, 100)
    empty = cpu.alloc_buffer(0)
    assert empty.size == 0
    assert buf.usage == fg.BufferUsage.ANY
    buf.usage = fg.BufferUsage.WEIGHTS
    assert buf.usage == fg.BufferUsage.WEIGHTS and buf.usage.name == "WEIGHTS"
    buf.free()
    assert buf.is_freed
    with pytest.raises(fg.StaleTensorError):
        buf.read(0, 1)


def test_alloc_ctx_tensors_and_numpy_round_trip(cpu: fg.Backend, rng: np.random.Generator) -> None:
    ctx = fg.Context()
    a = ctx.new_tensor(fg.float32, (3, 5), name="a")
    b = ctx.new_tensor(fg.float16, (5,), name="b")
    assert not a.is_allocated
    with pytest.raises(fg.NotAllocatedError):
        a.numpy()
    size = fg.ctx_tensors_size(ctx, cpu)
    assert size >= 3 * 5 * 4 + 5 * 2
    buf = fg.alloc_ctx_tensors(ctx, cpu)
    assert buf is not None and buf.size == size
    assert a.is_allocated and a.buffer == buf
    assert fg.alloc_ctx_tensors(ctx, cpu) is None  # nothing left
    x = rng.standard_normal((3, 5)).astype(np.float32)
    a.set(x)
    np.testing.assert_array_equal(a.numpy(), x)
    cpu.set_tensor_async(b, np.arange(5, dtype=np.float16))
    cpu.synchronize()
    raw = cpu.get_tensor_async(b)
    np.testing.assert_array_equal(np.frombuffer(raw, np.float16), np.arange(5))
    with pytest.raises(fg.OutOfBoundsError):
        cpu.set_tensor_async(b, np.zeros(6, np.float16))
    buf.reset()
    with pytest.raises(fg.StaleTensorError):
        a.numpy()


def test_graph_compute_with_abort_and_plan(cpu: fg.Backend, rng: np.random.Generator) -> None:
    ctx = fg.Context()
    x = ctx.new_tensor(fg.float32, (4, 8), name="x")
    w = ctx.new_tensor(fg.float32, (6, 8), name="w")
    y = fg.ops.relu(fg.ops.mul_mat(w, x, ctx=ctx), ctx=ctx)
    g = fg.Graph.build(y)
    weights = fg.alloc_ctx_tensors(ctx, cpu)
    assert weights is not None
    xn = rng.standard_normal((4, 8)).astype(np.float32)
    wn = rng.standard_normal((6, 8)).astype(np.float32)
    x.set(xn)
    w.set(wn)
    cpu.graph_compute(g)
    np.testing.assert_allclose(y.numpy(), np.maximum(xn @ wn.T, 0), rtol=1e-5, atol=1e-5)

    plan = cpu.graph_plan_create(g)
    assert isinstance(plan.work_size, int) and "work_size" in repr(plan)
    xn2 = rng.standard_normal((4, 8)).astype(np.float32)
    x.set(xn2)
    plan.compute()  # the plan computes the graph again, on the new input
    np.testing.assert_allclose(y.numpy(), np.maximum(xn2 @ wn.T, 0), rtol=1e-5, atol=1e-5)
    plan.free()
    with pytest.raises(fg.StaleTensorError):
        plan.compute()

    calls: list[int] = []

    def stop() -> bool:
        calls.append(1)
        return True

    cpu.set_abort_callback(stop)
    with pytest.raises(fg.AbortedError):
        cpu.graph_compute(g)
    assert calls
    cpu.set_abort_callback(None)
    cpu.graph_compute(g)  # still usable after an abort

    def broken() -> bool:
        raise RuntimeError("boom")

    cpu.set_abort_callback(broken)
    with pytest.raises(RuntimeError, match="boom"):  # the callback's own exception
        cpu.graph_compute(g)
    cpu.set_abort_callback(None)


def test_unsupported_or_unallocated_compute(cpu: fg.Backend) -> None:
    ctx = fg.Context()
    x = ctx.new_tensor(fg.float32, (4,), name="x")
    y = fg.ops.sqr(x, ctx=ctx)
    with pytest.raises(fg.NotAllocatedError):
        cpu.graph_compute(fg.Graph.build(y))


def test_cpu_buffer_from_array_is_zero_copy() -> None:
    arr = fg.aligned_empty((4, 16), np.float32)
    arr[...] = 1.5
    buf = fg.cpu_buffer_from_array(arr)
    assert buf.size == arr.nbytes and buf.base == arr.ctypes.data
    ctx = fg.Context()
    t = ctx.new_tensor(fg.float32, (4, 16), name="t")
    fg.tensor_alloc(t, buf, 0)
    np.testing.assert_array_equal(t.numpy(), arr)
    t.set(np.full((4, 16), 2.0, np.float32))
    assert arr[0, 0] == 2.0  # same memory
    del arr
    gc.collect()
    # The buffer keeps the array alive.
    assert float(t.numpy()[3, 15]) == 2.0

    misaligned = fg.aligned_empty(80, np.uint8)[1:65]
    with pytest.raises(fg.InvalidArgumentError, match="64 bytes"):
        fg.cpu_buffer_from_array(misaligned)
    readonly = fg.aligned_empty(16, np.float32)
    readonly.flags.writeable = False
    with pytest.raises(fg.InvalidArgumentError, match="writeable"):
        fg.cpu_buffer_from_array(readonly)
    with pytest.raises(fg.InvalidArgumentError):
        fg.cpu_buffer_from_array([1, 2, 3])  # type: ignore[arg-type]


def test_tensor_allocator_and_views(cpu: fg.Backend) -> None:
    ctx = fg.Context()
    a = ctx.new_tensor(fg.float32, (8,), name="a")
    b = ctx.new_tensor(fg.float32, (100,), name="b")
    buf = cpu.alloc_buffer(128)
    talloc = fg.TensorAllocator(buf)
    talloc.alloc(a)
    assert talloc.offset == 64
    with pytest.raises(fg.AllocationError):
        talloc.alloc(b)
    v = fg.ops.view(a, (4,), offset=16, ctx=ctx)
    fg.view_init(v)
    a.set(np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(v.numpy(), [4, 5, 6, 7])


def test_graph_allocator_plan_and_reuse(cpu: fg.Backend, rng: np.random.Generator) -> None:
    ctx = fg.Context()
    x = ctx.new_tensor(fg.float32, (16, 32), name="x")
    x.set_input()
    h = x
    with ctx:
        for _ in range(6):
            h = fg.ops.gelu(fg.ops.scale(h, 0.5))
    h.set_output()
    g = fg.Graph.build(h)
    galloc = fg.GraphAllocator(cpu)
    galloc.reserve(g)
    plan = galloc.plan
    assert plan is not None and plan["n_nodes"] == g.n_nodes
    # in-place reuse: the peak is far below the sum of all intermediates
    assert plan["total"] < plan["tensor_bytes"]
    galloc.check(g)
    galloc.alloc_graph(g)
    xn = rng.standard_normal((16, 32)).astype(np.float32)
    x.set(xn)
    cpu.graph_compute(g)
    ref = xn.astype(np.float64)
    for _ in range(6):
        ref = ref * 0.5
        ref = 0.5 * ref * (1 + np.tanh(np.sqrt(2 / np.pi) * (ref + 0.044715 * ref**3)))
    np.testing.assert_allclose(h.numpy(), ref, rtol=1e-3, atol=1e-3)
    assert galloc.buffer_size(0) == plan["total"]
    assert [b.size for b in galloc.buffers(0)] == [galloc.buffer_size(0)]
    assert galloc.reserve_n_size(g) == [plan["total"]]
    galloc.release()
    with pytest.raises(fg.StaleTensorError):
        h.numpy()
    with pytest.raises(fg.InvalidArgumentError):
        fg.GraphAllocator([])


def test_raw_tensor_io_memset_and_copies(cpu: fg.Backend) -> None:
    from ferrograph.plugins import NumpyRegistration

    ctx = fg.Context()
    a = ctx.new_tensor(fg.float32, (2, 4), name="a")
    b = ctx.new_tensor(fg.float32, (2, 4), name="b")
    c = ctx.new_tensor(fg.float32, (4, 2), name="c")
    buf = fg.alloc_ctx_tensors(ctx, cpu)
    assert buf is not None and buf.name == "CPU" and buf.max_size >= buf.size
    assert buf.alloc_size(a) == 32
    data = np.arange(8, dtype=np.float32)
    fg.tensor_set(a, data)
    assert fg.tensor_get(a) == data.tobytes()
    assert fg.tensor_get(a, offset=4, size=8) == data[1:3].tobytes()
    fg.tensor_memset(a, 0, offset=0, size=8)
    np.testing.assert_array_equal(a.numpy().ravel()[:3], [0, 0, 2])
    with pytest.raises(fg.OutOfBoundsError):
        fg.tensor_set(a, b"\0" * 40)
    with pytest.raises(fg.OutOfBoundsError):
        fg.tensor_memset(a, 1, offset=30, size=4)
    fg.tensor_copy(a, b)
    np.testing.assert_array_equal(b.numpy(), a.numpy())
    with pytest.raises(fg.ShapeError):
        fg.tensor_copy(a, c)  # different layout
    # Across a backend whose memory is not host memory.
    fg.register_backend(NumpyRegistration("NPCOPY"))
    try:
        other = fg.init_backend("NPCOPY")
        octx = fg.Context()
        d = octx.new_tensor(fg.float32, (2, 4), name="d")
        assert fg.alloc_ctx_tensors(octx, other) is not None
        fg.tensor_copy_async(cpu, other, a, d)
        other.synchronize()
        np.testing.assert_array_equal(d.numpy(), a.numpy())
    finally:
        fg.unregister_backend("NPCOPY")
    e = ctx.new_tensor(fg.float32, (4,), name="e")
    spare = cpu.alloc_buffer(64)
    spare.init_tensor(e, 0)
    assert e.buffer == spare
