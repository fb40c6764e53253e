"""Op builders: every op ferrograph computes, with numpy's axes and ggml's op set.

Each builder returns a new :class:`~ferrograph.Tensor` (metadata only: nothing is computed
until a graph runs) and validates its operands, raising :class:`~ferrograph.ShapeError`,
:class:`~ferrograph.DTypeError` or :class:`~ferrograph.InvalidArgumentError`.

Context resolution and memory
-----------------------------
Every builder takes an optional keyword ``ctx=``.

* With ``ctx=``, or inside ``with ctx:`` (the innermost), that context *owns* the result
  (ggml's meaning): it lists it (``ctx.tensors()``, ``len(ctx)``,
  :func:`~ferrograph.alloc_ctx_tensors`) and keeps it alive as long as the context.
* Without either, the result belongs to *no* context: your handle, later ops (through their
  sources) and :class:`~ferrograph.Graph` objects hold it, and it is freed with the last of them.
  Its ``context`` is its first tensor operand's, whose settings it follows (host memory at once
  in a ``Context(no_alloc=False)``, then its own, freed with it), but that context does not list
  it. With no operand context either, an ``InvalidArgumentError`` is raised.

This default is what keeps the natural serving loop flat: weights loaded once into a long-lived
context, a graph built per request, and every request's intermediates freed with its graph::

    weights = fg.Context()
    w = weights.new_tensor(fg.float32, (384, 384), name="w")
    fg.alloc_ctx_tensors(weights, cpu)
    for batch in requests:
        inputs = fg.Context()                 # per request
        x = inputs.new_tensor(fg.float32, (len(batch), 384))
        y = fg.ops.gelu(fg.ops.mul_mat(w, x)) # in no context: freed with y
        ...                                   # len(weights) stays 1

Axes: numpy's convention everywhere
-----------------------------------
Shapes are numpy-ordered (last axis fastest) and every argument that names an axis or a stride
has numpy's meaning; negative axes count from the end:

* ``reshape(a, (8, -1))``, ``cont(a, shape)``: numpy shapes;
* ``view(a, shape, strides, offset)``: ``np.lib.stride_tricks.as_strided`` with byte
  ``strides`` in numpy order (the last axis must be dense) starting ``offset`` bytes in;
* ``permute(a, axes)`` and ``transpose(a, axes)``: ``np.transpose(a, axes)``;
  ``transpose(a)`` swaps the last two axes (``np.matrix_transpose``);
* ``concat(a, b, axis)``: ``np.concatenate((a, b), axis)``;
* ``acc(a, b, strides, offset)``: adds ``b`` into the strided region of a copy of ``a``.

For code ported from ggml, where dimension 0 is the *fastest* (numpy's last) axis, ggml's forms
are kept under names that say so: ``permute_ggml(a, axes)`` (``axes[i]`` is where ggml dimension
``i`` goes), ``concat_ggml(a, b, dim)`` and ``acc_ggml(a, b, nb1, nb2, nb3, offset)``. One
builder keeps ggml's *meaning* under its ggml name: ``mul_mat(a, b)`` is ``b @ a.T`` in numpy
terms (``a`` holds the weights, one row per output).

Unary functions are available by name (``gelu``, ``relu``, ``silu``, ...) and through
``unary(a, "gelu")``; gated units through ``glu(a, "swiglu")`` or ``swiglu(a)`` /
``swiglu(a, b)``. ``custom(fn, srcs, dtype, shape)`` wraps a Python callable that receives
numpy views of the output and sources, valid only during the call.
"""

from __future__ import annotations

import functools
import operator as _operator_module
from collections.abc import Callable
from inspect import Parameter, Signature, signature
from typing import Any, TypeVar

import numpy as _np

from ._core import Context, Tensor
from ._core import ops as _native
from .errors import ArgumentTypeError, InvalidArgumentError, OutOfBoundsError, ShapeError
from .errors import Error as _Error

_F = TypeVar("_F", bound=Callable[..., Any])


def _is_int(v: object) -> bool:
    return hasattr(type(v), "__index__")


def _is_float(v: object) -> bool:
    return _is_int(v) or hasattr(type(v), "__float__")


def _is_ints(v: object) -> bool:
    if isinstance(v, str | bytes | bytearray) or not hasattr(type(v), "__iter__"):
        return False
    try:
        return all(_is_int(x) for x in v)  # type: ignore[attr-defined]
    except TypeError:
        return False


def _is_tensors(v: object) -> bool:
    try:
        return not isinstance(v, str) and all(isinstance(t, Tensor) for t in v)  # type: ignore[attr-defined]
    except TypeError:
        return False


# What each argument of the builders must be, in Python terms: (test, description).
_TENSOR = (lambda v: isinstance(v, Tensor), "a Tensor")
_TENSOR_OR_NONE = (lambda v: v is None or isinstance(v, Tensor), "a Tensor or None")
_INT = (_is_int, "an int")
_FLOAT = (_is_float, "a float")
_INTS_OR_NONE = (lambda v: v is None or _is_ints(v), "a sequence of ints or None")
_EXPECTED: dict[str, tuple[Callable[[object], bool], str]] = {
    **dict.fromkeys(["a", "b", "c", "experts", "ids", "pos", "q", "k", "v", "t"], _TENSOR),
    **dict.fromkeys(["mask", "freq_factors"], _TENSOR_OR_NONE),
    **dict.fromkeys(
        ["offset", "axis", "dim", "nb1", "nb2", "nb3", "n_groups", "n_past", "n_dims"], _INT
    ),
    "n_ctx_orig": _INT,
    **dict.fromkeys(
        [
            "s",
            "min",
            "max",
            "negative_slope",
            "eps",
            "scale",
            "max_bias",
            "freq_base",
            "freq_scale",
            "ext_factor",
            "attn_factor",
            "beta_fast",
            "beta_slow",
            "logit_softcap",
        ],
        _FLOAT,
    ),
    "axes": (_is_ints, "a sequence of ints"),
    "strides": _INTS_OR_NONE,
    "shape": (lambda v: _is_int(v) or _is_ints(v), "an int or a sequence of ints"),
    "op": (lambda v: isinstance(v, str), "a str"),
    "mode": (lambda v: isinstance(v, str), "a str"),
    "name": (lambda v: v is None or isinstance(v, str), "a str or None"),
    "swapped": (lambda v: isinstance(v, bool), "a bool"),
    "ctx": (lambda v: v is None or isinstance(v, Context), "a Context or None"),
    "fn_": (callable, "a callable"),
    "srcs": (_is_tensors, "a sequence of Tensors"),
}
# Where one builder's argument differs from the name's usual meaning.
_EXPECTED_IN = {
    ("scale", "b"): _FLOAT,
    ("glu", "b"): _TENSOR_OR_NONE,
    ("reglu", "b"): _TENSOR_OR_NONE,
    ("geglu", "b"): _TENSOR_OR_NONE,
    ("swiglu", "b"): _TENSOR_OR_NONE,
    ("transpose", "axes"): _INTS_OR_NONE,
    ("cont", "shape"): (
        lambda v: v is None or _is_int(v) or _is_ints(v),
        "an int, a sequence of ints or None",
    ),
}


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def _typed(native: _F) -> _F:
    """`native` with argument type errors in Python terms: a TypeError raised while the
    arguments are converted becomes an ArgumentTypeError (a TypeError and an
    InvalidArgumentError) naming the builder, the argument, what it must be and what it got;
    the converter's own error is its ``__cause__``."""
    name = native.__name__
    try:
        sig: Signature | None = signature(native)
    except (TypeError, ValueError):
        sig = None

    @functools.wraps(native)
    def builder(*args: Any, **kwargs: Any) -> Any:
        try:
            return native(*args, **kwargs)
        except TypeError as e:
            if isinstance(e, _Error):
                raise
            raise _argument_error(name, sig, args, kwargs, e) from e

    return builder  # type: ignore[return-value]


def _argument_error(
    name: str,
    sig: Signature | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    err: TypeError,
) -> ArgumentTypeError:
    if sig is not None:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as missing:
            return ArgumentTypeError(f"{name}{sig}: {missing}")
        for param, value in bound.arguments.items():
            kind = sig.parameters[param].kind
            if kind in (Parameter.VAR_POSITIONAL, Parameter.VAR_KEYWORD):
                continue
            expected = _EXPECTED_IN.get((name, param)) or _EXPECTED.get(param)
            if expected is not None and not expected[0](value):
                return ArgumentTypeError(
                    f"{name}(): {param} must be {expected[1]}, got {_describe(value)}"
                )
    text = str(err)
    if "Can't extract" in text:
        text = "an argument has the wrong type: " + text.split("Can't extract")[0].strip()
    return ArgumentTypeError(f"{name}{sig if sig is not None else '()'}: {text}")


__all__ = [
    "abs",
    "acc",
    "acc_ggml",
    "add",
    "add1",
    "argmax",
    "clamp",
    "concat",
    "concat_ggml",
    "cont",
    "cos",
    "cpy",
    "custom",
    "diag_mask_inf",
    "div",
    "dup",
    "elu",
    "exp",
    "flash_attn_ext",
    "geglu",
    "gelu",
    "gelu_erf",
    "gelu_quick",
    "get_rows",
    "glu",
    "group_norm",
    "hardsigmoid",
    "hardswish",
    "l2_norm",
    "leaky_relu",
    "log",
    "matmul",
    "mean",
    "mul",
    "mul_mat",
    "mul_mat_id",
    "neg",
    "norm",
    "out_prod",
    "permute",
    "permute_ggml",
    "reglu",
    "relu",
    "repeat",
    "reshape",
    "rms_norm",
    "rope",
    "run_custom",
    "scale",
    "set_rows",
    "sgn",
    "sigmoid",
    "silu",
    "sin",
    "soft_max",
    "sqr",
    "sqrt",
    "step",
    "sub",
    "sum",
    "sum_rows",
    "swiglu",
    "tanh",
    "transpose",
    "unary",
    "unary_op_names",
    "view",
]

dup = _typed(_native.dup)
cpy = _typed(_native.cpy)
cont = _typed(_native.cont)
reshape = _typed(_native.reshape)
view = _typed(_native.view)
permute = _typed(_native.permute)
permute_ggml = _typed(_native.permute_ggml)
transpose = _typed(_native.transpose)
get_rows = _typed(_native.get_rows)
set_rows = _typed(_native.set_rows)
_native_binary = {
    "add": _typed(_native.add),
    "sub": _typed(_native.sub),
    "mul": _typed(_native.mul),
    "div": _typed(_native.div),
}
add1 = _typed(_native.add1)
acc = _typed(_native.acc)
acc_ggml = _typed(_native.acc_ggml)
scale = _typed(_native.scale)
sqr = _typed(_native.sqr)
sqrt = _typed(_native.sqrt)
log = _typed(_native.log)
sin = _typed(_native.sin)
cos = _typed(_native.cos)
clamp = _typed(_native.clamp)
sum = _typed(_native.sum)
sum_rows = _typed(_native.sum_rows)
mean = _typed(_native.mean)
argmax = _typed(_native.argmax)
repeat = _typed(_native.repeat)
concat = _typed(_native.concat)
concat_ggml = _typed(_native.concat_ggml)
unary = _typed(_native.unary)
unary_op_names = _native.unary_op_names
abs = _typed(_native.abs)
sgn = _typed(_native.sgn)
neg = _typed(_native.neg)
step = _typed(_native.step)
tanh = _typed(_native.tanh)
elu = _typed(_native.elu)
relu = _typed(_native.relu)
sigmoid = _typed(_native.sigmoid)
gelu = _typed(_native.gelu)
gelu_erf = _typed(_native.gelu_erf)
gelu_quick = _typed(_native.gelu_quick)
silu = _typed(_native.silu)
hardswish = _typed(_native.hardswish)
hardsigmoid = _typed(_native.hardsigmoid)
exp = _typed(_native.exp)
leaky_relu = _typed(_native.leaky_relu)
glu = _typed(_native.glu)
reglu = _typed(_native.reglu)
geglu = _typed(_native.geglu)
swiglu = _typed(_native.swiglu)
norm = _typed(_native.norm)
rms_norm = _typed(_native.rms_norm)
group_norm = _typed(_native.group_norm)
l2_norm = _typed(_native.l2_norm)
_native_mul_mat = _typed(_native.mul_mat)


def mul_mat(a: Tensor, b: Tensor, *, ctx: Context | None = None) -> Tensor:
    """Matrix product with ggml's meaning: ``mul_mat(a, b)`` is ``b @ a.T`` in numpy terms.

    ``a`` holds the weights, one row per output (any weight dtype, rows contiguous); ``b`` the
    float32 activations, one row per input. The batch axes of ``b`` must be multiples of
    ``a``'s. For numpy's ``a @ b`` use :func:`matmul` (or the ``@`` operator).
    """
    try:
        return _native_mul_mat(a, b, ctx=ctx)
    except ShapeError as e:
        # The same error (its names and shapes kept), with the hint at matmul.
        e.args = (f"{e}; mul_mat(a, b) computes b @ a.T, for a @ b use matmul", *e.args[1:])
        raise


out_prod = _typed(_native.out_prod)
mul_mat_id = _typed(_native.mul_mat_id)
diag_mask_inf = _typed(_native.diag_mask_inf)
soft_max = _typed(_native.soft_max)
rope = _typed(_native.rope)
flash_attn_ext = _typed(_native.flash_attn_ext)
custom = _typed(_native.custom)
run_custom = _typed(_native.run_custom)


# ----- numpy meanings: arithmetic with broadcasting, matmul, indexing -------------------------

_MAX_DIMS = 4


def _check_tensor(name: str, param: str, value: object) -> None:
    if not isinstance(value, Tensor):
        raise ArgumentTypeError(f"{name}(): {param} must be a Tensor, got {_describe(value)}")


def _is_number(value: object) -> bool:
    return not isinstance(value, bool | _np.bool_) and (
        isinstance(value, int | float | _np.integer | _np.floating)
    )


def _result_shape(name: str, a: Tensor, b: Tensor) -> tuple[int, ...] | None:
    """numpy's broadcast shape of two operands, or None where numpy refuses (ggml's tiling
    may still accept the pair)."""
    try:
        shape = tuple(_np.broadcast_shapes(a.shape, b.shape))
    except ValueError:
        return None
    if len(shape) > _MAX_DIMS:
        raise ShapeError(
            f"{name}: shapes {a.shape} and {b.shape} broadcast to {shape}, more than "
            f"{_MAX_DIMS} axes"
        )
    return shape


def _broadcast_view(t: Tensor, shape: tuple[int, ...], ctx: Context | None) -> Tensor:
    """A zero-stride view of ``t`` with the broadcast ``shape`` (``t``'s last axis must be
    the result's). Used only as the shape template of :func:`repeat`, which never reads it."""
    if t.strides and t.shape[-1] > 1 and t.strides[-1] != t.dtype.type_size:
        t = cont(t, ctx=ctx)
    pad = len(shape) - t.ndim
    strides = []
    for axis, n in enumerate(shape):
        own = axis - pad
        if own < 0 or t.shape[own] != n:
            strides.append(0)
        else:
            strides.append(t.strides[own])
    if shape and shape[-1] > 1:
        strides[-1] = t.dtype.type_size
    return view(t, shape, strides, 0, ctx=ctx)


def _expand(t: Tensor, shape: tuple[int, ...], other: Tensor, ctx: Context | None) -> Tensor:
    """``t`` tiled to the broadcast ``shape`` (numpy's broadcasting made explicit)."""
    if t.shape == shape:
        return t
    full_last = other if other.shape and other.shape[-1] == shape[-1] else t
    return repeat(t, _broadcast_view(full_last, shape, ctx), ctx=ctx)


def _fit_shape(t: Tensor, shape: tuple[int, ...], ctx: Context | None) -> Tensor:
    """``t`` (same elements) with numpy's result ``shape``: leading axes of length one."""
    if t.shape == shape:
        return t
    return reshape(t, shape, ctx=ctx)


def _binary_tensors(name: str, a: Tensor, b: Tensor, ctx: Context | None) -> Tensor:
    native = _native_binary[name]
    shape = _result_shape(name, a, b)
    if shape is None or shape == a.shape:
        # numpy's rule with ``a`` already full size, or ggml's tiling (a multiple of ``b``).
        return native(a, b, ctx=ctx)
    if name in ("add", "mul") and b.shape == shape:
        return native(b, a, ctx=ctx)
    full = _expand(a, shape, b, ctx)
    return _fit_shape(native(full, b, ctx=ctx), shape, ctx)


def _binary_scalar(
    name: str, a: Tensor, value: float, reflected: bool, ctx: Context | None
) -> Tensor:
    if name == "add":
        return scale(a, 1.0, value, ctx=ctx)
    if name == "mul":
        return scale(a, value, 0.0, ctx=ctx)
    if name == "sub":
        return scale(a, -1.0, value, ctx=ctx) if reflected else scale(a, 1.0, -value, ctx=ctx)
    if reflected:
        raise InvalidArgumentError(
            f"{value!r} / tensor needs an elementwise reciprocal, which has no op; divide two "
            "tensors (fg.ops.div(c, a) with c set to the constant) instead"
        )
    with _np.errstate(divide="ignore"):
        inverse = float(_np.divide(_np.float64(1.0), _np.float64(value)))
    return scale(a, inverse, 0.0, ctx=ctx)


def _arith(name: str, a: object, b: object, ctx: Context | None) -> Tensor:
    if _is_number(a) and isinstance(b, Tensor):
        return _binary_scalar(name, b, float(a), True, ctx)  # type: ignore[arg-type]
    _check_tensor(name, "a", a)
    assert isinstance(a, Tensor)
    if isinstance(b, Tensor):
        return _binary_tensors(name, a, b, ctx)
    if _is_number(b):
        return _binary_scalar(name, a, float(b), False, ctx)  # type: ignore[arg-type]
    raise ArgumentTypeError(f"{name}(): b must be a Tensor or a number, got {_describe(b)}")


def add(a: Tensor | float, b: Tensor | float, *, ctx: Context | None = None) -> Tensor:
    """``a + b`` with numpy broadcasting; either operand may be a Python number. ggml's
    tiling (``b``'s sizes dividing ``a``'s) is accepted too. Also ``a + b``."""
    return _arith("add", a, b, ctx)


def sub(a: Tensor | float, b: Tensor | float, *, ctx: Context | None = None) -> Tensor:
    """``a - b`` with numpy broadcasting; either operand may be a Python number."""
    return _arith("sub", a, b, ctx)


def mul(a: Tensor | float, b: Tensor | float, *, ctx: Context | None = None) -> Tensor:
    """``a * b`` (elementwise) with numpy broadcasting; either operand may be a number."""
    return _arith("mul", a, b, ctx)


def div(a: Tensor | float, b: Tensor | float, *, ctx: Context | None = None) -> Tensor:
    """``a / b`` with numpy broadcasting; ``b`` may be a Python number (``number / tensor``
    raises InvalidArgumentError: there is no reciprocal op)."""
    return _arith("div", a, b, ctx)


def matmul(a: Tensor, b: Tensor, *, ctx: Context | None = None) -> Tensor:
    """``np.matmul(a, b)``, also ``a @ b``: the last two axes multiply, the others broadcast;
    a 1-d operand is a row (``a``) or a column (``b``) vector whose axis is dropped from the
    result. ``a`` must be float32 (it is mul_mat's activation operand); ``b`` becomes
    mul_mat's weights, copied to a transposed contiguous layout (``cont``) unless it already is
    one: ``x @ w.T`` for weights ``w`` is exactly ``mul_mat(w, x)``."""
    _check_tensor("matmul", "a", a)
    _check_tensor("matmul", "b", b)
    a2 = reshape(a, (1, a.shape[0]), ctx=ctx) if a.ndim == 1 else a
    b2 = reshape(b, (b.shape[0], 1), ctx=ctx) if b.ndim == 1 else b
    if a2.shape[-1] != b2.shape[-2]:
        raise ShapeError(
            f"matmul: shapes {a.shape} and {b.shape} do not fit: a's last axis has "
            f"{a2.shape[-1]} elements, b's second-to-last {b2.shape[-2]}"
        )
    try:
        batch = tuple(_np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]))
    except ValueError:
        raise ShapeError(
            f"matmul: the batch axes of {a.shape} and {b.shape} do not broadcast"
        ) from None
    if len(batch) + 2 > _MAX_DIMS:
        raise ShapeError(f"matmul: {a.shape} @ {b.shape} needs more than {_MAX_DIMS} axes")
    m, n = a2.shape[-2], b2.shape[-1]
    # mul_mat's weights: (..., n, k), one row per output. ``x @ w.T`` needs no copy (the
    # transpose of a transposed view is w's own layout).
    weights = transpose(b2, ctx=ctx)
    if not weights.is_contiguous():
        weights = cont(weights, ctx=ctx)
    x = a2
    if x.shape[-1] > 1 and x.strides[-1] != x.dtype.type_size:
        x = cont(x, ctx=ctx)
    x_shape = (*batch, *a2.shape[-2:])
    if x.shape != x_shape:
        x = repeat(x, _broadcast_view(x, x_shape, ctx), ctx=ctx)
    out = mul_mat(weights, x, ctx=ctx)  # (*batch, m, n)
    shape: tuple[int, ...] = (*batch, m, n)
    if a.ndim == 1:
        shape = (*batch, n)
    if b.ndim == 1:
        shape = shape[:-1]
    return _fit_shape(out, shape if shape else (1,), ctx)


def _operator(name: str, a: Tensor, other: object, reflected: bool) -> Any:
    """The Tensor operators (``+ - * / @``): ``reflected`` when ``a`` was the right operand."""
    if isinstance(other, Tensor):
        x, y = (other, a) if reflected else (a, other)
        return matmul(x, y) if name == "matmul" else _arith(name, x, y, None)
    if name != "matmul" and _is_number(other):
        return _binary_scalar(name, a, float(other), reflected, None)  # type: ignore[arg-type]
    if isinstance(other, _np.ndarray) or hasattr(other, "__array__"):
        raise ArgumentTypeError(
            f"a Tensor cannot be combined with a numpy array ({name}): the graph only holds "
            "tensors; put the values in a tensor (ctx.new_tensor(...), then .set(array) "
            "after allocation) and use that"
        )
    return NotImplemented


def _reversed_axes(a: Tensor) -> Tensor:
    """numpy's ``a.T``: every axis reversed, as a permuted view."""
    if a.ndim < 2:
        return a
    return permute(a, tuple(reversed(range(a.ndim))))


def _reshape_method(a: Tensor, shape: tuple[Any, ...]) -> Tensor:
    """numpy's ``a.reshape(*shape)`` / ``a.reshape(shape)``: a view of a contiguous tensor,
    else of a contiguous copy."""
    target: Any = shape[0] if len(shape) == 1 and not _is_int(shape[0]) else shape
    if not a.is_contiguous():
        a = cont(a)
    return reshape(a, target)


def _index_part(a: Tensor, key: object) -> tuple[Any, ...]:
    parts = key if isinstance(key, tuple) else (key,)
    n_ellipsis = len([p for p in parts if p is Ellipsis])  # (`sum` is the op here)
    if n_ellipsis > 1:
        raise InvalidArgumentError(f"{a!r}[...]: an index can only have a single ellipsis")
    for p in parts:
        if p is None:
            raise InvalidArgumentError(
                "indexing with None (np.newaxis) is not supported; use a.reshape(...) to add "
                "an axis"
            )
        if not (p is Ellipsis or isinstance(p, slice) or _is_int(p)) or isinstance(p, bool):
            raise ArgumentTypeError(
                f"a Tensor takes basic indices only (ints, slices, ...), got {_describe(p)}; "
                "use fg.ops.get_rows for rows chosen by an index tensor"
            )
    fixed = len(parts) - n_ellipsis
    if fixed > a.ndim:
        raise OutOfBoundsError(f"too many indices for a tensor of shape {a.shape}: {len(parts)}")
    if n_ellipsis:
        at = next(i for i, p in enumerate(parts) if p is Ellipsis)
        fill = (slice(None),) * (a.ndim - fixed)
        parts = parts[:at] + fill + parts[at + 1 :]
    return tuple(parts) + (slice(None),) * (a.ndim - len(parts))


def _getitem(a: Tensor, key: object) -> Tensor:
    """numpy's basic indexing as a view: ints drop an axis, slices (positive steps) keep it.

    ggml views need dense rows, so the result's last axis must be contiguous: ``a[:, ::2]``
    and ``a[..., 0]`` on a 2-d tensor raise InvalidArgumentError (``a[..., 0:1]`` keeps a
    length-one last axis and works). Selecting a single element gives shape ``(1,)``.
    """
    parts = _index_part(a, key)
    last = parts[-1]
    if a.dtype.is_quantized and not (
        isinstance(last, slice) and last.indices(a.shape[-1]) == (0, a.shape[-1], 1)
    ):
        raise InvalidArgumentError(
            f"{a.dtype.name} stores its rows in blocks: index the leading axes only and keep the "
            "last axis whole (e.g. a[1:3] or a[0])"
        )
    offset = 0
    shape: list[int] = []
    strides: list[int] = []
    for axis, (p, n, stride) in enumerate(zip(parts, a.shape, a.strides, strict=True)):
        if isinstance(p, slice):
            start, stop, step = p.indices(n)
            if step <= 0:
                raise InvalidArgumentError(
                    f"axis {axis}: slices with a negative or zero step have no view; got {p}"
                )
            length = len(range(start, stop, step))
            if length:
                offset += start * stride
            shape.append(length)
            strides.append(stride * step)
        else:
            i = _operator_module.index(p)
            if not -n <= i < n:
                raise OutOfBoundsError(f"index {i} is out of bounds for axis {axis} with size {n}")
            offset += (i % n) * stride
    if not shape:
        shape, strides = [1], [a.dtype.type_size]
    if shape[-1] == 1:
        strides[-1] = a.dtype.type_size
    if shape[-1] > 1 and strides[-1] != a.dtype.type_size:
        raise InvalidArgumentError(
            f"indexing {a!r} with {key!r} gives a last axis that is not contiguous (stride "
            f"{strides[-1]} bytes), which a view cannot hold; keep the last axis whole or "
            "length one (e.g. a[..., 0:1]), or copy with fg.ops.cont first"
        )
    return view(a, tuple(shape), tuple(strides), offset)


def __dir__() -> list[str]:
    """The op builders (``__all__``), not the helpers this module imports."""
    return sorted(__all__)
