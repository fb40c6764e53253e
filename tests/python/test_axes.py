"""Every argument naming an axis or a stride has numpy's meaning: each builder against the numpy
function of the same meaning, for every permutation / axis (negative ones too) of 1-4-d
tensors; the ggml forms (``*_ggml``) against the same numpy results through ggml's numbering."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import ferrograph as fg

SHAPES = [(5,), (3, 5), (2, 3, 5), (2, 3, 4, 5)]


# The contexts of the tensors below (a result without ctx= is recorded in its first operand's
# context, which must be alive).
HOST = fg.Context(no_alloc=False)


def host(array: np.ndarray) -> fg.Tensor:
    """A tensor with host memory holding ``array`` (float32)."""
    t = HOST.new_tensor(fg.float32, array.shape)
    t.set(array)
    return t


def computed(t: fg.Tensor) -> np.ndarray:
    """``t`` computed on the host (every tensor here has host memory)."""
    fg.graph_compute_with_ctx(fg.Graph.build(t), 1)
    return t.numpy()


def data(shape: tuple[int, ...]) -> np.ndarray:
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape) - 7.5


def ggml_axes(axes: tuple[int, ...]) -> tuple[int, ...]:
    """numpy's transpose axes as ggml's permute: where each ggml dimension goes."""
    n = len(axes)
    out = [0] * n
    for i, axis in enumerate(axes):
        out[n - 1 - axis] = n - 1 - i
    return tuple(out)


@pytest.mark.parametrize("shape", SHAPES)
def test_permute_and_transpose_are_np_transpose(shape: tuple[int, ...]) -> None:
    x = data(shape)
    t = host(x)
    for axes in itertools.permutations(range(len(shape))):
        want = np.transpose(x, axes)
        got = fg.ops.permute(t, axes)
        assert got.shape == want.shape, axes
        np.testing.assert_array_equal(got.numpy(), want)
        np.testing.assert_array_equal(computed(fg.ops.cont(got)), want)
        np.testing.assert_array_equal(fg.ops.transpose(t, axes).numpy(), want)
        # negative axes count from the end, as in numpy
        negative = tuple(a - len(shape) for a in axes)
        np.testing.assert_array_equal(fg.ops.permute(t, negative).numpy(), want)
        # ggml's numbering under its own name
        np.testing.assert_array_equal(fg.ops.permute_ggml(t, ggml_axes(axes)).numpy(), want)


def test_permute_of_a_4d_batch_of_heads() -> None:
    # the case the issue names: (batch, seq, heads, dim) -> (batch, heads, seq, dim)
    x = data((2, 3, 4, 5))
    got = fg.ops.permute(host(x), (0, 2, 1, 3))
    assert got.shape == (2, 4, 3, 5)
    np.testing.assert_array_equal(got.numpy(), np.transpose(x, (0, 2, 1, 3)))
    # a permutation that is not its own inverse tells the two conventions apart
    axes = (1, 2, 0, 3)
    np.testing.assert_array_equal(fg.ops.permute(host(x), axes).numpy(), np.transpose(x, axes))
    assert fg.ops.permute(host(x), axes).shape == (3, 4, 2, 5)
    assert fg.ops.permute_ggml(host(x), axes).shape != (3, 4, 2, 5)


@pytest.mark.parametrize("shape", SHAPES[1:])
def test_transpose_without_axes_swaps_the_last_two(shape: tuple[int, ...]) -> None:
    x = data(shape)
    want = np.swapaxes(x, -1, -2)
    got = fg.ops.transpose(host(x))
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("axes", [(0,), (0, 1, 1), (0, 1, 3), (0, 1, -4), (0, 1, 2, 3)])
def test_bad_axes_are_shape_errors(axes: tuple[int, ...]) -> None:
    t = host(data((2, 3, 5)))
    with pytest.raises(fg.ShapeError):
        fg.ops.permute(t, axes)
    with pytest.raises(fg.ShapeError):
        fg.ops.transpose(t, axes)


@pytest.mark.parametrize("shape", SHAPES)
def test_concat_is_np_concatenate(shape: tuple[int, ...]) -> None:
    n = len(shape)
    for axis in range(-n, n):
        other = list(shape)
        other[axis] = 2
        a, b = data(shape), data(tuple(other)) * 10
        want = np.concatenate((a, b), axis)
        got = fg.ops.concat(host(a), host(b), axis)
        assert got.shape == want.shape, axis
        np.testing.assert_array_equal(computed(got), want)
        ggml_dim = n - 1 - (axis % n)
        got = fg.ops.concat_ggml(host(a), host(b), ggml_dim)
        np.testing.assert_array_equal(computed(got), want)
    assert fg.ops.concat(host(data(shape)), host(data(shape))).shape[0] == 2 * shape[0]


def test_concat_errors() -> None:
    a = host(data((2, 3)))
    with pytest.raises(fg.ShapeError):
        fg.ops.concat(a, host(data((2, 4))), 0)  # other axes differ
    with pytest.raises(fg.ShapeError):
        fg.ops.concat(a, a, 2)
    with pytest.raises(fg.ShapeError):
        fg.ops.concat(a, a, -3)
    with pytest.raises(fg.ShapeError):
        fg.ops.concat(a, host(data((1, 2, 3))), 0)  # numpy needs the same ndim too


def as_strided(x: np.ndarray, shape: tuple[int, ...], strides: tuple[int, ...], offset: int):
    flat = x.reshape(-1)
    return np.lib.stride_tricks.as_strided(
        flat[offset // flat.itemsize :], shape=shape, strides=strides
    )


@pytest.mark.parametrize(
    ("shape", "strides", "offset"),
    [
        ((2, 3), (24, 4), 8),  # a window of the (4, 6) base
        ((2, 2), (48, 4), 4),  # every other row
        ((2, 2, 3), (48, 24, 4), 0),
        ((2, 3, 2), (24, 8, 4), 0),  # overlapping rows
        ((4,), (4,), 12),
    ],
)
def test_view_strides_are_numpy_strides(
    shape: tuple[int, ...], strides: tuple[int, ...], offset: int
) -> None:
    x = data((4, 6))
    want = as_strided(x, shape, strides, offset)
    got = fg.ops.view(host(x), shape, strides, offset)
    assert got.shape == want.shape and got.strides == want.strides
    np.testing.assert_array_equal(got.numpy(), want)
    # the last (dense) stride may be left out
    np.testing.assert_array_equal(fg.ops.view(host(x), shape, strides[:-1], offset).numpy(), want)


def test_view_reshape_and_cont_shapes_are_numpy_shapes() -> None:
    x = data((2, 3, 4))
    t = host(x)
    np.testing.assert_array_equal(fg.ops.reshape(t, (4, -1)).numpy(), x.reshape(4, -1))
    np.testing.assert_array_equal(fg.ops.view(t, (6, 4)).numpy(), x.reshape(6, 4))
    p = fg.ops.permute(t, (2, 0, 1))
    np.testing.assert_array_equal(
        computed(fg.ops.cont(p, (4, 6))), np.transpose(x, (2, 0, 1)).reshape(4, 6)
    )


@pytest.mark.parametrize(
    ("a_shape", "b_shape", "strides", "offset"),
    [
        ((4, 8), (2, 4), None, 0),  # the region laid out like a
        ((4, 8), (2, 4), (32, 4), 16),
        ((4, 8), (2, 3), (64, 4), 4),  # rows 0 and 2
        ((3, 4, 8), (2, 2, 4), (128, 32, 4), 8),
        ((3, 4, 8), (2, 4), (32,), 36),  # the dense last stride left out
    ],
)
def test_acc_strides_are_numpy_strides(
    a_shape: tuple[int, ...],
    b_shape: tuple[int, ...],
    strides: tuple[int, ...] | None,
    offset: int,
) -> None:
    a, b = data(a_shape), data(b_shape) * 100
    want = a.copy()
    if strides is None:
        region_strides = a.strides[len(a_shape) - len(b_shape) :]
    else:
        region_strides = (*strides, 4) if len(strides) < len(b_shape) else strides
    region = as_strided(want, b_shape, region_strides, offset)
    region += b  # a writable view into ``want``
    got = computed(fg.ops.acc(host(a), host(b), strides, offset))
    np.testing.assert_array_equal(got, want)
    # ggml's form: byte strides of ggml dimensions 1-3 (numpy's axes -2, -3, -4)
    nb = [*reversed(region_strides)][1:]
    nb += [a.nbytes] * (3 - len(nb))
    got = computed(fg.ops.acc_ggml(host(a), host(b), *nb, offset))
    np.testing.assert_array_equal(got, want)


def test_acc_region_outside_is_a_shape_error() -> None:
    with pytest.raises(fg.ShapeError):
        fg.ops.acc(host(data((4, 8))), host(data((2, 4))), (32, 4), 100)
    with pytest.raises(fg.ShapeError):
        fg.ops.acc(host(data((4, 8))), host(data((2, 4))), (32, 8), 0)  # last axis not dense


def test_row_reductions_are_along_the_last_axis() -> None:
    x = data((2, 3, 5)) * np.float32(0.5)
    x[1, 2, 1] = 100
    t = host(x)
    np.testing.assert_allclose(
        computed(fg.ops.sum_rows(t)), x.sum(axis=-1, keepdims=True), rtol=1e-6
    )
    np.testing.assert_allclose(computed(fg.ops.mean(t)), x.mean(axis=-1, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(
        computed(fg.ops.argmax(host(x.reshape(6, 5)))), x.reshape(6, 5).argmax(axis=-1)
    )
