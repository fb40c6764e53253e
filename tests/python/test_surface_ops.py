"""Operators with numpy's meanings, checked against numpy on random shapes and dtypes:
``+ - * /`` with broadcasting and scalars, unary ``-``, ``@`` (``np.matmul``), ``.T``,
``.reshape``, ``len``/``size``, basic slicing as views, and the clear errors where a layout or
an operand has no graph meaning."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import numpy as np
import pytest

import ferrograph as fg

CPU = fg.init_backend("CPU", n_threads=1)


def _evaluate(
    build: Callable[..., fg.Tensor], arrays: Sequence[np.ndarray]
) -> tuple[np.ndarray, fg.Tensor]:
    """Builds ``build(*tensors)`` over input tensors holding ``arrays``, computes it on the
    CPU and returns its value (and the result tensor)."""
    ctx = fg.Context()
    inputs = [
        ctx.new_tensor(fg.DType(a.dtype), a.shape, name=f"in{i}").set_input()
        for i, a in enumerate(arrays)
    ]
    with ctx:
        out = build(*inputs)
        if out.is_view:
            out = fg.ops.cont(out)
        out.set_output()
    graph = fg.Graph.build(out)
    fg.GraphAllocator(CPU.default_buffer_type).alloc_graph(graph)
    for t, a in zip(inputs, arrays, strict=True):
        t.set(a)
    CPU.graph_compute(graph)
    return out.numpy(), out


def _broadcast_pair(rng: np.random.Generator) -> tuple[tuple[int, ...], tuple[int, ...]]:
    ndim = int(rng.integers(1, 5))
    full = [int(n) for n in rng.integers(1, 5, ndim)]

    def operand() -> tuple[int, ...]:
        dims = [1 if rng.random() < 0.35 else n for n in full]
        drop = int(rng.integers(0, ndim))  # leading axes numpy adds back
        return tuple(dims[drop:]) or (full[-1],)

    return operand(), operand()


BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}


@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_binary_operators_broadcast_like_numpy(name: str, dtype: type) -> None:
    rng = np.random.default_rng(hash((name, np.dtype(dtype).name)) % 2**32)
    op = BINARY[name]
    for _ in range(12):
        sa, sb = _broadcast_pair(rng)
        a = rng.uniform(0.5, 2, sa).astype(dtype)
        b = rng.uniform(0.5, 2, sb).astype(dtype)
        expected = op(a.astype(np.float32), b.astype(np.float32))
        got, out = _evaluate(op, [a, b])
        assert out.shape == expected.shape, (sa, sb)
        tol = 1e-6 if dtype == np.float32 else 4e-3
        np.testing.assert_allclose(got.astype(np.float32), expected, rtol=tol, atol=tol)
        # The named builders mean the same.
        got_named, _ = _evaluate(getattr(fg.ops, name), [a, b])
        np.testing.assert_array_equal(got_named, got)


def test_scalars_on_either_side_and_negation() -> None:
    a = np.array([[1.0, -2.0, 4.0], [0.5, 8.0, -1.0]], np.float32)
    cases: list[tuple[Callable[[fg.Tensor], fg.Tensor], np.ndarray]] = [
        (lambda t: t + 2, a + 2),
        (lambda t: 2 + t, 2 + a),
        (lambda t: t - 1.5, a - 1.5),
        (lambda t: 3 - t, 3 - a),
        (lambda t: t * 2, a * 2),
        (lambda t: np.float32(0.5) * t, 0.5 * a),
        (lambda t: t / 4, a / 4),
        (lambda t: -t, -a),
        (lambda t: fg.ops.add(t, 1.0), a + 1),
        (lambda t: (t - 1) * (t + 1) / 2, (a - 1) * (a + 1) / 2),
    ]
    for build, expected in cases:
        got, _ = _evaluate(build, [a])
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_operands_without_a_graph_meaning_raise_clearly() -> None:
    ctx = fg.Context()
    a = ctx.new_tensor(fg.float32, (2, 3))
    with pytest.raises(fg.InvalidArgumentError, match="reciprocal"):
        _ = 1 / a
    with pytest.raises(fg.ArgumentTypeError, match="numpy array"):
        _ = a + np.ones((2, 3), np.float32)
    with pytest.raises(fg.ArgumentTypeError, match="numpy array"):
        _ = np.ones((2, 3), np.float32) + a
    with pytest.raises(TypeError):
        _ = a + "x"  # type: ignore[operator]
    with pytest.raises(TypeError):
        _ = a @ 2  # type: ignore[operator]
    with pytest.raises(fg.ShapeError):
        _ = a + ctx.new_tensor(fg.float32, (4,))
    with pytest.raises(fg.ArgumentTypeError, match="b must be a Tensor or a number"):
        fg.ops.mul(a, "2")  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(4))
def test_matmul_is_numpys(seed: int) -> None:
    rng = np.random.default_rng(seed)
    shapes = [
        ((3, 4), (4, 5)),
        ((4,), (4, 2)),
        ((2, 4), (4,)),
        ((4,), (4,)),
        ((2, 3, 4), (4, 5)),
        ((3, 4), (2, 4, 5)),
        ((2, 1, 3, 4), (1, 3, 4, 2)),
        ((1, 3, 4), (2, 1, 4, 6)),
    ]
    for sa, sb in shapes:
        a = rng.standard_normal(sa).astype(np.float32)
        b = rng.standard_normal(sb).astype(np.float32)
        expected = np.matmul(a, b)
        got, out = _evaluate(operator.matmul, [a, b])
        expected_shape = expected.shape or (1,)
        assert out.shape == expected_shape, (sa, sb)
        np.testing.assert_allclose(
            got.reshape(expected_shape), np.reshape(expected, expected_shape), rtol=1e-4, atol=1e-5
        )
        got_fn, _ = _evaluate(fg.ops.matmul, [a, b])
        np.testing.assert_array_equal(got_fn, got)


def test_matmul_and_mul_mat_shape_errors_say_which_is_which() -> None:
    ctx = fg.Context()
    a = ctx.new_tensor(fg.float32, (3, 4))
    b = ctx.new_tensor(fg.float32, (5, 6))
    with pytest.raises(fg.ShapeError, match=r"matmul: shapes \(3, 4\) and \(5, 6\)"):
        _ = a @ b
    with pytest.raises(
        fg.ShapeError, match=r"mul_mat\(a, b\) computes b @ a.T, for a @ b use matmul"
    ):
        fg.ops.mul_mat(a, b)


def test_transpose_reshape_and_sizes() -> None:
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    got, out = _evaluate(lambda t: t.T, [a])
    np.testing.assert_array_equal(got, a.T)
    assert out.shape == (4, 3, 2)
    got, _ = _evaluate(lambda t: t.reshape(4, -1), [a])
    np.testing.assert_array_equal(got, a.reshape(4, -1))
    got, _ = _evaluate(lambda t: t.reshape((6, 4)), [a])
    np.testing.assert_array_equal(got, a.reshape(6, 4))
    # A non-contiguous tensor reshapes through a copy, as numpy's reshape does.
    got, _ = _evaluate(lambda t: t.T.reshape(-1), [a])
    np.testing.assert_array_equal(got, a.T.reshape(-1))
    ctx = fg.Context()
    t = ctx.new_tensor(fg.float32, (2, 3, 4))
    assert (len(t), t.size, t.ndim, t.shape) == (2, 24, 3, (2, 3, 4))
    assert bool(ctx.new_tensor(fg.float32, (0, 3)))


@pytest.mark.parametrize(
    "key",
    [
        0,
        -1,
        (1, slice(None)),
        (slice(1, None), slice(0, 2)),
        (slice(None, None, 2), slice(1, 3)),
        (Ellipsis, slice(1, 4)),
        (0, 1),
        (1, 2, slice(None)),
        (slice(0, 0),),
        (Ellipsis, slice(2, 3)),
    ],
)
def test_basic_slicing_is_a_view(key: object) -> None:
    a = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    expected = a[key]  # type: ignore[index]
    ctx = fg.Context()
    t = ctx.new_tensor(fg.float32, a.shape).set_input()
    view = t[key]
    assert view.is_view and view.view_src == t
    assert view.shape == (expected.shape or (1,))
    if expected.size == 0:
        return
    got, _ = _evaluate(lambda x: x[key], [a])
    np.testing.assert_array_equal(got, expected.reshape(view.shape))


def test_slices_a_view_cannot_hold_raise() -> None:
    ctx = fg.Context()
    t = ctx.new_tensor(fg.float32, (3, 4))
    with pytest.raises(fg.InvalidArgumentError, match="last axis that is not contiguous"):
        _ = t[:, 0]
    with pytest.raises(fg.InvalidArgumentError, match="last axis that is not contiguous"):
        _ = t[:, ::2]
    with pytest.raises(fg.InvalidArgumentError, match="negative or zero step"):
        _ = t[::-1]
    with pytest.raises(IndexError):
        _ = t[3]
    with pytest.raises(fg.OutOfBoundsError):
        _ = t[0, 0, 0]
    with pytest.raises(fg.InvalidArgumentError, match="reshape"):
        _ = t[None]
    with pytest.raises(fg.ArgumentTypeError, match="get_rows"):
        _ = t[[0, 1]]
    assert t[:, 0:1].shape == (3, 1)
    q = ctx.new_tensor(fg.q8_0, (4, 64))
    assert q[1:3].shape == (2, 64) and q[0].shape == (64,)
    with pytest.raises(fg.InvalidArgumentError, match="blocks"):
        _ = q[:, :32]
    rows = list(t)
    assert len(rows) == 3 and all(r.shape == (4,) for r in rows)


def test_operators_follow_the_ownership_rules() -> None:
    ctx = fg.Context()
    a = ctx.new_tensor(fg.float32, (2, 3))
    before = len(ctx)
    free = a * 2 + a
    assert len(ctx) == before and free.context is not None
    with ctx:
        owned = a * 2 + a
    assert owned in ctx.tensors()
    other = fg.Context()
    owned_elsewhere = fg.ops.add(a, 1.0, ctx=other)
    assert owned_elsewhere in other.tensors()
