from __future__ import annotations

import numpy as np
import pytest

import ferrograph as fg
from conftest import HAVE_ML_DTYPES

PLAIN = [np.float32, np.float16, np.int8, np.int16, np.int32, np.int64]


def test_new_tensor_shapes_and_ggml_order(ctx: fg.Context) -> None:
    x = ctx.new_tensor(fg.float32, (8, 4096), name="x")
    assert x.shape == (8, 4096) and x.ndim == 2
    assert x.ne == (4096, 8, 1, 1)
    assert x.nb == (4, 4 * 4096, 4 * 4096 * 8, 4 * 4096 * 8)
    assert x.strides == (4 * 4096, 4)
    assert x.nbytes == 8 * 4096 * 4 and x.nelements == 8 * 4096
    assert x.dtype is fg.float32 and x.name == "x" and x.op == "NONE"
    assert x.is_contiguous() and not x.is_transposed() and not x.is_permuted()
    assert not x.is_allocated and x.srcs == [] and x.view_src is None
    v = ctx.new_tensor("f16", 7)
    assert v.shape == (7,) and v.ne == (7, 1, 1, 1)
    t4 = ctx.new_tensor(np.int32, (2, 3, 4, 5))
    assert t4.ne == (5, 4, 3, 2)
    q = ctx.new_tensor(fg.q8_0, (3, 64))
    assert q.nb[:2] == (34, 68) and q.nbytes == 3 * 68


def test_new_tensor_errors(ctx: fg.Context) -> None:
    with pytest.raises(fg.ShapeError):
        ctx.new_tensor(fg.float32, (1, 2, 3, 4, 5))
    with pytest.raises(fg.ShapeError):
        ctx.new_tensor(fg.float32, ())
    with pytest.raises(fg.ShapeError):
        ctx.new_tensor(fg.q8_0, (2, 33))
    with pytest.raises(fg.DTypeError):
        ctx.new_tensor("complex64", (2,))


def test_name_flags_identity_repr(ctx: fg.Context) -> None:
    x = ctx.new_tensor(fg.float32, (8, 4096), name="x")
    assert repr(x) == "Tensor('x', f32, shape=(8, 4096), op=NONE)"
    assert repr(ctx.new_tensor(fg.float32, 3)) == "Tensor(f32, shape=(3,), op=NONE)"
    x.name = "renamed"
    assert x.name == "renamed" and ctx.get_tensor("renamed") == x
    assert x.set_input() is x and x.is_input and x.flags & 1
    x.set_output().set_param()
    assert x.is_output and x.is_param and x.flags == 7
    same = ctx.tensors()[0]
    assert same == x and hash(same) == hash(x) and same is not x
    assert len({x, same}) == 1
    assert x != ctx.new_tensor(fg.float32, 3)
    assert "<table>" in x._repr_html_()
    assert x.context == ctx


@pytest.mark.parametrize("np_dtype", PLAIN)
def test_set_numpy_round_trip(
    host_ctx: fg.Context, np_dtype: type, rng: np.random.Generator
) -> None:
    t = host_ctx.new_tensor(np_dtype, (3, 5, 7))
    assert t.is_allocated
    data: np.ndarray = (rng.standard_normal((3, 5, 7)) * 50).astype(np_dtype)
    assert t.set(data) is t
    got = t.numpy()
    assert got.dtype == np.dtype(np_dtype)
    np.testing.assert_array_equal(got, data)
    np.testing.assert_array_equal(np.asarray(t), data)
    np.testing.assert_array_equal(np.asarray(t, dtype=np.float64), data.astype(np.float64))


@pytest.mark.skipif(not HAVE_ML_DTYPES, reason="ml_dtypes is not installed")
def test_bf16_round_trip(host_ctx: fg.Context) -> None:
    import ml_dtypes

    t = host_ctx.new_tensor(fg.bfloat16, (4, 8))
    data = np.linspace(-4, 4, 32, dtype=np.float32).reshape(4, 8).astype(ml_dtypes.bfloat16)
    t.set(data)
    got = t.numpy()
    assert got.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.view(np.uint16), data.view(np.uint16))
    t.set(data.view(np.uint16))  # bit patterns are accepted too
    np.testing.assert_array_equal(t.numpy().view(np.uint16), data.view(np.uint16))


def test_quantized_set_dequantizes(host_ctx: fg.Context, rng: np.random.Generator) -> None:
    t = host_ctx.new_tensor(fg.q8_0, (4, 64))
    data = rng.standard_normal((4, 64)).astype(np.float32)
    t.set(data)
    got = t.numpy()
    assert got.dtype == np.float32 and got.shape == (4, 64)
    np.testing.assert_allclose(got, data, atol=np.abs(data).max() / 127 * 1.01)
    t.set(data.astype(np.float64))
    with pytest.raises(fg.DTypeError):
        t.set(np.zeros((4, 64), np.int32))


def test_set_checks_shape_and_dtype(host_ctx: fg.Context) -> None:
    t = host_ctx.new_tensor(fg.float32, (2, 3))
    with pytest.raises(fg.ShapeError):
        t.set(np.zeros((3, 2), np.float32))
    with pytest.raises(fg.ShapeError):
        t.set(np.zeros(6, np.float32))
    with pytest.raises(fg.DTypeError):
        t.set(np.zeros((2, 3), np.float64))
    with pytest.raises(fg.DTypeError):
        t.set(np.zeros((2, 3), np.float16))
    t.set([[1, 2, 3], [4, 5, 6]])  # lists convert to the tensor's dtype
    np.testing.assert_array_equal(t.numpy(), [[1, 2, 3], [4, 5, 6]])


def test_non_contiguous_arrays_are_copied(host_ctx: fg.Context) -> None:
    t = host_ctx.new_tensor(fg.float32, (3, 4))
    source = np.arange(24, dtype=np.float32).reshape(4, 6)[:3, ::-1][:, :4]
    assert not source.flags.c_contiguous
    t.set(source)
    np.testing.assert_array_equal(t.numpy(), source)
    t.set(np.asfortranarray(source))
    np.testing.assert_array_equal(t.numpy(), source)


def test_unallocated_tensor_raises(ctx: fg.Context) -> None:
    t = ctx.new_tensor(fg.float32, (2, 2))
    with pytest.raises(fg.NotAllocatedError):
        t.numpy()
    with pytest.raises(fg.NotAllocatedError):
        t.set(np.zeros((2, 2), np.float32))
    with pytest.raises(RuntimeError):
        np.asarray(t)


def test_array_protocol_copy_false_raises(host_ctx: fg.Context) -> None:
    t = host_ctx.new_tensor(fg.float32, 4)
    t.set(np.ones(4, np.float32))
    with pytest.raises(ValueError):
        t.__array__(copy=False)
    assert np.array(t, copy=True).tolist() == [1, 1, 1, 1]


def test_views_read_through(host_ctx: fg.Context) -> None:
    a = host_ctx.new_tensor(fg.float32, (4, 6))
    data = np.arange(24, dtype=np.float32).reshape(4, 6)
    a.set(data)
    t = fg.ops.transpose(a)
    assert t.shape == (6, 4) and t.is_transposed() and not t.is_contiguous()
    np.testing.assert_array_equal(t.numpy(), data.T)
    r = fg.ops.reshape(a, (2, 12))
    np.testing.assert_array_equal(r.numpy(), data.reshape(2, 12))
    v = fg.ops.view(a, (2, 3), (24, 4), 8)
    np.testing.assert_array_equal(v.numpy(), data[:2, 2:5])
    assert v.view_src == a and v.view_offset == 8
    v.set(np.zeros((2, 3), np.float32))
    expected = data.copy()
    expected[:2, 2:5] = 0
    np.testing.assert_array_equal(a.numpy(), expected)
    p = fg.ops.permute(fg.ops.reshape(a, (2, 2, 6)), [1, 0, 2])
    np.testing.assert_array_equal(p.numpy(), expected.reshape(2, 2, 6).transpose(1, 0, 2))
    assert p.op_params["axes"] == (0, 2, 1, 3)


def test_bf16_from_python_numbers(host_ctx: fg.Context) -> None:
    t = host_ctx.new_tensor(fg.bfloat16, 3)
    t.set([1.0, -2.5, 0.15625])
    np.testing.assert_array_equal(fg.bf16_to_fp32(t.numpy()), [1.0, -2.5, 0.15625])
    with pytest.raises(fg.DTypeError):
        t.set(np.zeros(3, np.float32))  # arrays must be bf16 (or uint16 bits)


@pytest.mark.parametrize("dtype", PLAIN)
def test_set_reads_every_layout_of_an_exact_array(host_ctx: fg.Context, dtype: type) -> None:
    """Exact C-contiguous arrays take `set`'s direct path; Fortran-ordered, strided,
    read-only and non-native arrays the general one: every one lands in logical order."""
    fgtype = getattr(fg, np.dtype(dtype).name)
    data = (np.arange(24) - 7).astype(dtype).reshape(2, 3, 4)
    t = host_ctx.new_tensor(fgtype, (2, 3, 4))
    frozen = data.copy()
    frozen.flags.writeable = False
    layouts = [data, np.asfortranarray(data), frozen, np.repeat(data, 2, axis=2)[:, :, ::2]]
    for array in layouts:
        t.set(np.zeros_like(data))
        t.set(array)
        np.testing.assert_array_equal(t.numpy(), data)
    swapped = data.astype(np.dtype(dtype).newbyteorder())
    if np.dtype(dtype).itemsize > 1:
        with pytest.raises(fg.DTypeError):
            t.set(swapped)
    with pytest.raises(fg.ShapeError):
        t.set(data.reshape(6, 4))
    empty = host_ctx.new_tensor(fgtype, (0, 3))
    empty.set(np.zeros((0, 3), dtype))
    assert empty.numpy().shape == (0, 3)


@pytest.mark.parametrize("dtype", PLAIN)
@pytest.mark.parametrize("n", [1, 7, 4096, 20000])
def test_numpy_reads_views_of_every_size(host_ctx: fg.Context, dtype: type, n: int) -> None:
    """`numpy()` of small tensors (built without Python calls) and of large ones gives a new,
    writable array in numpy order for contiguous tensors and for strided, permuted views."""
    fgtype = getattr(fg, np.dtype(dtype).name)
    data = (np.arange(2 * n) % 101 - 50).astype(dtype).reshape(2, n)
    t = host_ctx.new_tensor(fgtype, (2, n))
    t.set(data)
    got = t.numpy()
    np.testing.assert_array_equal(got, data)
    assert got.dtype == np.dtype(dtype) and got.flags.writeable and got.flags.c_contiguous
    got[...] = 0  # a copy: the tensor keeps its values
    np.testing.assert_array_equal(t.numpy(), data)
    np.testing.assert_array_equal(fg.ops.transpose(t, ctx=host_ctx).numpy(), data.T)
    size = np.dtype(dtype).itemsize
    column = fg.ops.view(t, (2, 1), (n * size, size), offset=(n - 1) * size, ctx=host_ctx)
    np.testing.assert_array_equal(column.numpy(), data[:, n - 1 :])
    # a zero-stride view names more elements than its bytes: the array's size decides
    repeated = fg.ops.view(t, (3, n), (0, size), ctx=host_ctx)
    np.testing.assert_array_equal(repeated.numpy(), np.tile(data[0], (3, 1)))
