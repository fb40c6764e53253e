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
from collections.abc import Callable
from inspect import Parameter, Signature, signature
from typing import Any, TypeVar

from ._core import Context, Tensor
from ._core import ops as _native
from .errors import ArgumentTypeError
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
add = _typed(_native.add)
sub = _typed(_native.sub)
mul = _typed(_native.mul)
div = _typed(_native.div)
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
mul_mat = _typed(_native.mul_mat)
out_prod = _typed(_native.out_prod)
mul_mat_id = _typed(_native.mul_mat_id)
diag_mask_inf = _typed(_native.diag_mask_inf)
soft_max = _typed(_native.soft_max)
rope = _typed(_native.rope)
flash_attn_ext = _typed(_native.flash_attn_ext)
custom = _typed(_native.custom)
run_custom = _typed(_native.run_custom)
