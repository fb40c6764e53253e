"""Op builders: shapes, context resolution, and one bad-input test per family."""

from __future__ import annotations

import numpy as np
import pytest

import ferrograph as fg


def test_mul_mat_keeps_ggml_meaning(ctx: fg.Context) -> None:
    x = ctx.new_tensor(fg.float32, (8, 4096), name="x")
    w = ctx.new_tensor(fg.float16, (1024, 4096), name="w")
    y = fg.ops.mul_mat(w, x)
    assert y.shape == (8, 1024) and y.dtype is fg.float32 and y.op == "MUL_MAT"
    assert y.srcs == [w, x]
    with pytest.raises(fg.ShapeError):
        fg.ops.mul_mat(w, ctx.new_tensor(fg.float32, (8, 4095)))
    with pytest.raises(fg.DTypeError):
        fg.ops.mul_mat(x, w)


def test_context_resolution() -> None:
    a_ctx, b_ctx = fg.Context(), fg.Context()
    a = a_ctx.new_tensor(fg.float32, (2, 3))
    y = fg.ops.relu(a)
    # without ctx= or `with`: follows a's context, which does not own (list) it
    assert y.context == a_ctx and y not in a_ctx.tensors()
    with b_ctx:
        z = fg.ops.relu(a)
        with a_ctx:
            inner = fg.ops.neg(a)
        after = fg.ops.neg(a)
    assert z.context == b_ctx and inner.context == a_ctx and after.context == b_ctx
    explicit = fg.ops.relu(a, ctx=b_ctx)
    assert explicit.context == b_ctx
    assert fg.ops.relu(a).context == a_ctx  # the with-block ended


def test_no_context_raises() -> None:
    a = fg.Context().new_tensor(fg.float32, 4)  # the context dies at once
    with pytest.raises(fg.InvalidArgumentError):
        fg.ops.relu(a)
    assert fg.ops.relu(a, ctx=fg.Context()).shape == (4,)


def test_binary_broadcasting(ctx: fg.Context) -> None:
    a = ctx.new_tensor(fg.float32, (3, 4, 6))
    b = ctx.new_tensor(fg.float32, (1, 2, 6))
    for op in (fg.ops.add, fg.ops.sub, fg.ops.mul, fg.ops.div):
        assert op(a, b).shape == (3, 4, 6)
    with pytest.raises(fg.ShapeError):
        fg.ops.add(a, ctx.new_tensor(fg.float32, (3, 6)))
    with pytest.raises(fg.DTypeError):
        fg.ops.add(ctx.new_tensor(fg.int32, 6), ctx.new_tensor(fg.int32, 6))
    with pytest.raises(fg.ShapeError):
        fg.ops.add1(a, b)
    assert fg.ops.add1(a, ctx.new_tensor(fg.float32, 1)).shape == a.shape
    assert fg.ops.repeat(b, a).shape == a.shape
    with pytest.raises(fg.ShapeError):
        fg.ops.repeat(a, b)
    assert fg.ops.concat(a, a, -1).shape == (3, 4, 12)
    with pytest.raises(fg.ShapeError):
        fg.ops.concat(a, b, -1)


def test_views_and_copies(ctx: fg.Context) -> None:
    a = ctx.new_tensor(fg.float32, (3, 4, 6))
    assert fg.ops.reshape(a, (12, 6)).shape == (12, 6)
    assert fg.ops.reshape(a, (-1, 2)).shape == (36, 2)
    assert fg.ops.reshape(a, 72).shape == (72,)
    with pytest.raises(fg.ShapeError):
        fg.ops.reshape(a, (5, 5))
    with pytest.raises(fg.ShapeError):
        fg.ops.reshape(a, (-1, -1))
    t = fg.ops.transpose(a)
    assert t.shape == (3, 6, 4) and t.op == "TRANSPOSE" and t.view_src == a
    with pytest.raises(fg.ShapeError):
        fg.ops.reshape(t, (72,))  # not contiguous
    assert fg.ops.cont(t).is_contiguous()
    assert fg.ops.cont(t, (18, 4)).shape == (18, 4)
    p = fg.ops.permute(a, [2, 0, 1])
    assert p.ne == (4, 3, 6, 1) and p.is_permuted()
    with pytest.raises(fg.ShapeError):
        fg.ops.permute(a, [0, 0, 1])
    v = fg.ops.view(a, (2, 6), offset=24)
    assert v.shape == (2, 6) and v.view_offset == 24 and v.strides == (24, 4)
    v2 = fg.ops.view(a, (2, 3), (48, 4), 0)
    assert v2.strides == (48, 4)
    with pytest.raises(fg.ShapeError):
        fg.ops.view(a, (2, 3), (48, 8), 0)  # rows must be dense
    with pytest.raises(fg.ShapeError):
        fg.ops.view(a, (4, 6), None, 4 * 72)  # past the end
    dst = ctx.new_tensor(fg.float16, (3, 4, 6))
    c = fg.ops.cpy(a, dst)
    assert c.view_src == dst and c.dtype is fg.float16
    with pytest.raises(fg.ShapeError):
        fg.ops.cpy(a, ctx.new_tensor(fg.float16, 5))
    assert fg.ops.dup(a).op == "DUP"


def test_rows(ctx: fg.Context) -> None:
    table = ctx.new_tensor(fg.q8_0, (100, 64))
    idx = ctx.new_tensor(fg.int32, 5)
    rows = fg.ops.get_rows(table, idx)
    assert rows.shape == (5, 64) and rows.dtype is fg.float32
    with pytest.raises(fg.DTypeError):
        fg.ops.get_rows(table, ctx.new_tensor(fg.float32, 5))
    dst = ctx.new_tensor(fg.float16, (100, 64))
    src = ctx.new_tensor(fg.float32, (5, 64))
    assert fg.ops.set_rows(dst, src, idx).is_view
    with pytest.raises(fg.ShapeError):
        fg.ops.set_rows(dst, ctx.new_tensor(fg.float32, (5, 32)), idx)


def test_elementwise_and_reductions(ctx: fg.Context) -> None:
    a = ctx.new_tensor(fg.float32, (5, 64))
    for name in fg.ops.unary_op_names():
        y = getattr(fg.ops, name)(a)
        assert y.op == "UNARY" and y.op_desc == name.upper() and y.op_params == {"op": name.upper()}
        assert fg.ops.unary(a, name).op_desc == name.upper()
    with pytest.raises(fg.InvalidArgumentError):
        fg.ops.unary(a, "nope")
    with pytest.raises(fg.DTypeError):
        fg.ops.gelu(ctx.new_tensor(fg.int32, 4))
    for f in (fg.ops.sqr, fg.ops.sqrt, fg.ops.log, fg.ops.sin, fg.ops.cos):
        assert f(a).shape == a.shape
    assert fg.ops.scale(a, 2.0).op_params == {"s": 2.0, "b": 0.0}
    assert fg.ops.clamp(a, -1, 1).op_params == {"min": -1.0, "max": 1.0}
    with pytest.raises(fg.InvalidArgumentError):
        fg.ops.clamp(a, 1, -1)
    assert fg.ops.leaky_relu(a, 0.1).op == "LEAKY_RELU"
    assert fg.ops.sum(a).shape == (1,)
    assert fg.ops.sum_rows(a).shape == (5, 1)
    assert fg.ops.mean(a).shape == (5, 1)
    assert fg.ops.argmax(a).shape == (5,) and fg.ops.argmax(a).dtype is fg.int32
    with pytest.raises(fg.DTypeError):
        fg.ops.argmax(ctx.new_tensor(fg.float16, (2, 3)))


def test_glu(ctx: fg.Context) -> None:
    a = ctx.new_tensor(fg.float32, (5, 64))
    for name in ("reglu", "geglu", "swiglu"):
        y = getattr(fg.ops, name)(a)
        assert y.shape == (5, 32) and y.op == "GLU"
        assert fg.ops.glu(a, name, swapped=True).op_params["swapped"] is True
        assert getattr(fg.ops, name)(a, a).shape == (5, 64)
    with pytest.raises(fg.ShapeError):
        fg.ops.swiglu(ctx.new_tensor(fg.float32, 7))
    with pytest.raises(fg.ShapeError):
        fg.ops.swiglu(a, ctx.new_tensor(fg.float32, (5, 32)))
    with pytest.raises(fg.InvalidArgumentError):
        fg.ops.glu(a, "nope")


def test_norms(ctx: fg.Context) -> None:
    a = ctx.new_tensor(fg.float32, (4, 8, 64))
    assert fg.ops.norm(a).op_params == {"eps": pytest.approx(1e-5)}
    assert fg.ops.rms_norm(a, 1e-6).op == "RMS_NORM"
    assert fg.ops.l2_norm(a).op == "L2_NORM"
    assert fg.ops.group_norm(a, 4).op_params["n_groups"] == 4
    with pytest.raises(fg.InvalidArgumentError):
        fg.ops.rms_norm(a, -1.0)
    for n_groups in (0, 5):  # at least 1, at most the 4 channels (axis -3)
        with pytest.raises(fg.InvalidArgumentError):
            fg.ops.group_norm(a, n_groups)
    with pytest.raises(fg.DTypeError):
        fg.ops.norm(ctx.new_tensor(fg.float16, 8))


def test_matmul_family(ctx: fg.Context) -> None:
    a = ctx.new_tensor(fg.float32, (6, 4))
    b = ctx.new_tensor(fg.float32, (6, 5))
    assert fg.ops.out_prod(a, b).shape == (5, 4)
    with pytest.raises(fg.ShapeError):
        fg.ops.out_prod(a, ctx.new_tensor(fg.float32, (7, 5)))
    experts = ctx.new_tensor(fg.float32, (8, 16, 32))  # 8 experts of 16x32
    x = ctx.new_tensor(fg.float32, (3, 1, 32))
    ids = ctx.new_tensor(fg.int32, (3, 2))
    assert fg.ops.mul_mat_id(experts, x, ids).shape == (3, 2, 16)
    with pytest.raises(fg.DTypeError):
        fg.ops.mul_mat_id(experts, x, ctx.new_tensor(fg.float32, (3, 2)))


def test_attention_family(ctx: fg.Context) -> None:
    s = ctx.new_tensor(fg.float32, (12, 7, 32))
    mask = ctx.new_tensor(fg.float16, (8, 32))
    sm = fg.ops.soft_max(s, mask, scale=0.125)
    assert sm.srcs == [s, mask] and sm.op_params == {"scale": 0.125, "max_bias": 0.0}
    assert fg.ops.soft_max(s).srcs == [s]
    with pytest.raises(fg.InvalidArgumentError):
        fg.ops.soft_max(s, max_bias=8.0)
    with pytest.raises(fg.ShapeError):
        fg.ops.soft_max(s, ctx.new_tensor(fg.float32, (8, 31)))
    assert fg.ops.diag_mask_inf(s, 0).op_params == {"n_past": 0}
    x = ctx.new_tensor(fg.float32, (7, 12, 64))
    pos = ctx.new_tensor(fg.int32, 7)
    r = fg.ops.rope(x, pos, 64, mode="neox", freq_base=500000.0)
    assert r.op_params["mode"] == "neox" and r.op_params["freq_base"] == 500000.0
    ff = ctx.new_tensor(fg.float32, 32)
    assert fg.ops.rope(x, pos, 64, freq_factors=ff).srcs[-1] == ff
    with pytest.raises(fg.InvalidArgumentError):
        fg.ops.rope(x, pos, 65)
    with pytest.raises(fg.InvalidArgumentError):
        fg.ops.rope(x, pos, 64, mode="sideways")
    with pytest.raises(fg.ShapeError):
        fg.ops.rope(x, ctx.new_tensor(fg.int32, 6), 64)
    q = ctx.new_tensor(fg.float32, (1, 12, 7, 64))
    k = ctx.new_tensor(fg.float16, (1, 4, 32, 64))
    v = ctx.new_tensor(fg.float16, (1, 4, 32, 64))
    out = fg.ops.flash_attn_ext(q, k, v, mask, scale=0.125)
    assert out.ne == (64, 12, 7, 1)
    with pytest.raises(fg.ShapeError):
        fg.ops.flash_attn_ext(q, k, ctx.new_tensor(fg.float16, (1, 4, 31, 64)))


def test_acc(ctx: fg.Context) -> None:
    a = ctx.new_tensor(fg.float32, (4, 8))
    b = ctx.new_tensor(fg.float32, (2, 4))
    assert fg.ops.acc_ggml(a, b, 32, 128, 128, 0).op_params["nb1"] == 32
    assert fg.ops.acc(a, b, (32, 4), 0).op_params["nb1"] == 32
    with pytest.raises(fg.ShapeError):
        fg.ops.acc_ggml(a, b, 32, 128, 128, 120)


def test_every_native_builder_is_exported() -> None:
    from ferrograph._core import ops as native

    # Written in Python over the native builders: numpy's arithmetic (broadcasting, numbers),
    # matmul, and mul_mat's shape error pointing at matmul.
    in_python = {"add", "sub", "mul", "div", "mul_mat", "matmul"}
    assert set(fg.ops.__all__) == set(native.__all__) | {"matmul"}
    for name in fg.ops.__all__:
        exported = getattr(fg.ops, name)
        if name in in_python:
            assert exported.__module__ == "ferrograph.ops" and exported.__doc__
            continue
        # The native builder itself, or wrapped to report argument types in Python terms.
        assert getattr(exported, "__wrapped__", exported) is getattr(native, name)
        assert getattr(fg.ops, name).__doc__


def test_custom_op_runs_with_numpy_views(host_ctx: fg.Context) -> None:
    a = host_ctx.new_tensor(fg.float32, (2, 3))
    a.set(np.arange(6, dtype=np.float32).reshape(2, 3))
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def double_t(out: np.ndarray, src: np.ndarray) -> None:
        seen.append((out.shape, src.shape))
        out[...] = src.T * 2

    y = fg.ops.custom(double_t, [a], fg.float32, (3, 2))
    assert y.op == "CUSTOM" and y.op_params == {"name": "double_t"} and y.srcs == [a]
    fg.ops.run_custom(y)
    assert seen == [((3, 2), (2, 3))]
    np.testing.assert_array_equal(y.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3).T * 2)


def test_raising_custom_op_gives_fg_error(host_ctx: fg.Context) -> None:
    a = host_ctx.new_tensor(fg.float32, 4)

    def boom(out: np.ndarray, src: np.ndarray) -> None:
        raise ValueError("boom")

    y = fg.ops.custom(boom, [a], fg.float32, 4, name="boom")
    with pytest.raises(fg.Error, match="boom"):
        fg.ops.run_custom(y)
    with pytest.raises(fg.InvalidArgumentError):
        fg.ops.run_custom(a)
    with pytest.raises(fg.InvalidArgumentError):
        fg.ops.custom(42, [a], fg.float32, 4)  # type: ignore[arg-type]


def test_custom_op_on_unallocated_tensors_raises(ctx: fg.Context) -> None:
    a = ctx.new_tensor(fg.float32, 4)
    y = fg.ops.custom(lambda out, src: None, [a], fg.float32, 4)
    with pytest.raises(fg.Error):
        fg.ops.run_custom(y)
