"""Errors that carry their facts (issue 14 item 3): the attributes of AllocationError,
UnsupportedOpError, OutOfBoundsError and ShapeError, None where a failure did not record them."""

from __future__ import annotations

import pickle

import pytest

import ferrograph as fg


def test_out_of_bounds_carries_offset_size_limit() -> None:
    buf = fg.cpu_buffer_type().alloc_buffer(64)
    with pytest.raises(fg.OutOfBoundsError) as info:
        buf.read(60, 8)
    e = info.value
    assert (e.offset, e.size, e.limit) == (60, 8, 64)
    with pytest.raises(fg.OutOfBoundsError) as info:
        buf.write(2**40, b"xy")
    assert (info.value.offset, info.value.size, info.value.limit) == (2**40, 2, 64)
    assert isinstance(info.value, IndexError)


def test_allocation_error_carries_requested_limit_buffer_type() -> None:
    class Small(fg.plugins._BytesBufferType):
        name = "SMALLBUF"
        max_size = 100

    reg = fg.plugins.NumpyRegistration("SMALLNP")
    reg.devices()[0].buffer_type = Small()
    fg.register_backend(reg)
    try:
        dev = fg.dev_by_name("SMALLNP")
        assert dev is not None
        ctx = fg.Context()
        ctx.new_tensor(fg.float32, (64,), name="big")
        with pytest.raises(fg.AllocationError) as info:
            fg.alloc_ctx_tensors(ctx, dev.buffer_type)
        e = info.value
        assert (e.requested, e.limit, e.buffer_type) == (256, 100, "SMALLBUF")
        assert isinstance(e, MemoryError)
    finally:
        fg.unregister_backend("SMALLNP")


def test_unsupported_op_carries_op_dtypes_backend() -> None:
    cpu = fg.init_backend("CPU")
    nump = fg.plugins.NumpyRegistration("FACTSNP")
    fg.register_backend(nump)
    try:
        other = fg.init_backend("FACTSNP")
        ctx = fg.Context()
        a = ctx.new_tensor(fg.float32, (4, 4))
        with ctx:
            y = fg.ops.soft_max(a)
        sched = fg.Scheduler([other, cpu])
        with pytest.raises(fg.UnsupportedOpError) as info:
            sched.set_tensor_backend(y, other)
        e = info.value
        assert e.op == "SOFT_MAX" and e.backend == "FACTSNP"
        assert e.dtypes == ("f32", "f32")
    finally:
        fg.unregister_backend("FACTSNP")


def test_shape_error_names_operands_and_shapes() -> None:
    ctx = fg.Context()
    a = ctx.new_tensor(fg.float32, (3, 4), name="weights")
    b = ctx.new_tensor(fg.float32, (2, 5), name="acts")
    with pytest.raises(fg.ShapeError) as info:
        fg.ops.mul_mat(a, b)
    assert info.value.names == ("weights", "acts")
    assert info.value.shapes == ((3, 4), (2, 5))
    c = ctx.new_tensor(fg.float32, (3, 3), name="c")
    with pytest.raises(fg.ShapeError) as info:
        fg.ops.add(a, c)
    assert info.value.names == ("weights", "c") and info.value.shapes == ((3, 4), (3, 3))


def test_errors_without_facts_have_none() -> None:
    ctx = fg.Context()
    t = ctx.new_tensor(fg.float32, (2, 2))
    with pytest.raises(fg.ShapeError) as info:
        fg.ops.reshape(t, (3,))
    assert info.value.names is None and info.value.shapes is None
    for cls in (fg.AllocationError, fg.UnsupportedOpError, fg.OutOfBoundsError):
        e = cls("message")
        assert str(e) == "message"
    assert fg.AllocationError("m").requested is None
    assert fg.UnsupportedOpError("m").op is None
    assert fg.OutOfBoundsError("m").offset is None


def test_errors_with_facts_pickle_with_their_message() -> None:
    buf = fg.cpu_buffer_type().alloc_buffer(8)
    with pytest.raises(fg.OutOfBoundsError) as info:
        buf.read(0, 9)
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is fg.OutOfBoundsError and str(again) == str(info.value)
