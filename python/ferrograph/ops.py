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

from ._core import ops as _native

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

dup = _native.dup
cpy = _native.cpy
cont = _native.cont
reshape = _native.reshape
view = _native.view
permute = _native.permute
permute_ggml = _native.permute_ggml
transpose = _native.transpose
get_rows = _native.get_rows
set_rows = _native.set_rows
add = _native.add
sub = _native.sub
mul = _native.mul
div = _native.div
add1 = _native.add1
acc = _native.acc
acc_ggml = _native.acc_ggml
scale = _native.scale
sqr = _native.sqr
sqrt = _native.sqrt
log = _native.log
sin = _native.sin
cos = _native.cos
clamp = _native.clamp
sum = _native.sum
sum_rows = _native.sum_rows
mean = _native.mean
argmax = _native.argmax
repeat = _native.repeat
concat = _native.concat
concat_ggml = _native.concat_ggml
unary = _native.unary
unary_op_names = _native.unary_op_names
abs = _native.abs
sgn = _native.sgn
neg = _native.neg
step = _native.step
tanh = _native.tanh
elu = _native.elu
relu = _native.relu
sigmoid = _native.sigmoid
gelu = _native.gelu
gelu_erf = _native.gelu_erf
gelu_quick = _native.gelu_quick
silu = _native.silu
hardswish = _native.hardswish
hardsigmoid = _native.hardsigmoid
exp = _native.exp
leaky_relu = _native.leaky_relu
glu = _native.glu
reglu = _native.reglu
geglu = _native.geglu
swiglu = _native.swiglu
norm = _native.norm
rms_norm = _native.rms_norm
group_norm = _native.group_norm
l2_norm = _native.l2_norm
mul_mat = _native.mul_mat
out_prod = _native.out_prod
mul_mat_id = _native.mul_mat_id
diag_mask_inf = _native.diag_mask_inf
soft_max = _native.soft_max
rope = _native.rope
flash_attn_ext = _native.flash_attn_ext
custom = _native.custom
run_custom = _native.run_custom
