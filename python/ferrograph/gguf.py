"""GGUF files (versions 2 and 3): read metadata and tensors, bind them to a device, write them.

Reading::

    with fg.gguf.GGUFFile("model.gguf") as f:
        print(f.metadata["general.architecture"])
        for info in f.tensors:             # name, dtype, shape (numpy order), offset, nbytes
            ...
        w = f.tensor("token_embd.weight")  # numpy; block types dequantized to float32
        raw = f.raw("token_embd.weight")   # the stored bytes, read-only, no copy
        buffer, tensors = f.load(fg.init_backend("CPU"))  # fg.Tensors, no copy on the CPU

A file that is not valid GGUF raises :class:`ferrograph.GGUFError` (a ``ValueError``) naming
the file, the field and its byte offset; the reader checks every count, length and dimension
against the file's size before it allocates anything, so a hostile file cannot make it crash,
hang or allocate without bound.

Writing (version 3)::

    fg.gguf.write("out.gguf",
                  {"general.name": "tiny", "n": 3, "scale": 0.5, "ids": [1, 2, 3],
                   "big": fg.gguf.Value("u64", 7)},
                  {"w": np.ones((2, 32), np.float32),
                   "q": (fg.q8_0, (2, 32), raw_q8_0_bytes)})

Metadata types are inferred: ``bool`` is bool, an ``int`` the first of u32, i32, u64, i64 that
holds it, a ``float`` f32, a ``str`` str, numpy scalars their own type (``np.float64`` is f64,
``np.uint8`` u8, ...), a list, tuple or numpy array an array whose element type is inferred from
all its elements the same way (ints by the range of all of them, ints mixed with floats f32;
nested lists are arrays of arrays; an empty list is an array of u32). :class:`Value` forces a
type: ``Value("u8", 5)``, or for arrays the type of the leaves: ``Value("i16", [[1], [2, 3]])``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from . import _core
from ._core import Context, Tensor
from .dtypes import DType
from .errors import GGUFError

__all__ = ["GGUFFile", "GGUFTensorInfo", "GGUFTensors", "Value", "write"]

GGUFFile = _core.GGUFFile
GGUFTensorInfo = _core.GGUFTensorInfo

#: The GGUF value type names :class:`Value` accepts.
TYPES: Final = ("u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64", "f32", "f64", "bool", "str")

_NUMPY_TYPES: Final = {
    np.dtype(np.bool_): "bool",
    np.dtype(np.uint8): "u8",
    np.dtype(np.int8): "i8",
    np.dtype(np.uint16): "u16",
    np.dtype(np.int16): "i16",
    np.dtype(np.uint32): "u32",
    np.dtype(np.int32): "i32",
    np.dtype(np.uint64): "u64",
    np.dtype(np.int64): "i64",
    np.dtype(np.float16): "f32",
    np.dtype(np.float32): "f32",
    np.dtype(np.float64): "f64",
}

_INT_TYPES: Final = ("u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64")

#: numpy dtypes :func:`write` stores as tensors of the same type.
_TENSOR_DTYPES: Final = ("float32", "float16", "bfloat16", "int8", "int16", "int32", "int64")


class GGUFTensors(dict[str, Tensor]):
    """The tensors :meth:`GGUFFile.load` bound, by name in file order.

    ``context`` is the :class:`ferrograph.Context` they belong to: op builders called without
    ``ctx=`` record their results through it, so keep this mapping (or the context) while
    building graphs from the tensors.
    """

    context: Context


class Value:
    """A metadata value with an explicit GGUF type, for :func:`write`.

    ``type`` is one of ``"u8"``, ``"i8"``, ``"u16"``, ``"i16"``, ``"u32"``, ``"i32"``,
    ``"u64"``, ``"i64"``, ``"f32"``, ``"f64"``, ``"bool"``, ``"str"``. A scalar ``value`` is
    stored as that type; a list, tuple or numpy array becomes an array whose leaves have that
    type (nested lists make arrays of arrays).
    """

    __slots__ = ("type", "value")

    def __init__(self, type: str, value: Any) -> None:
        if type not in TYPES:
            raise GGUFError(
                f"gguf.Value: unknown type {type!r}; expected one of {', '.join(TYPES)}"
            )
        self.type = type
        self.value = value

    def __repr__(self) -> str:
        return f"Value({self.type!r}, {self.value!r})"


def _fail(path: str, field: str, problem: str) -> GGUFError:
    err = GGUFError(f"{path}: {field}: {problem}")
    err.path, err.field, err.offset = path, field, None
    return err


def _is_sequence(value: object) -> bool:
    return isinstance(value, (list, tuple, np.ndarray))


def _int_type(lo: int, hi: int) -> str | None:
    """The first of u32, i32, u64, i64 that holds every int from ``lo`` to ``hi``."""
    if lo >= 0 and hi < 2**32:
        return "u32"
    if lo >= -(2**31) and hi < 2**31:
        return "i32"
    if lo >= 0 and hi < 2**64:
        return "u64"
    if lo >= -(2**63) and hi < 2**63:
        return "i64"
    return None


def _scalar_type(value: object) -> str | None:
    """The inferred GGUF type of a scalar, or None if it is not one."""
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, np.generic):
        return _NUMPY_TYPES.get(value.dtype) or ("str" if isinstance(value, np.str_) else None)
    if isinstance(value, int):
        return _int_type(value, value)
    if isinstance(value, float):
        return "f32"
    if isinstance(value, str):
        return "str"
    return None


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python value the native writer reads."""
    return value.item() if isinstance(value, np.generic) else value


def _leaves(path: str, field: str, items: Any, leaf: str) -> tuple[str, Any]:
    """An array whose leaves are ``leaf``: ``(element type, items)`` in the native form."""
    if isinstance(items, np.ndarray) and items.ndim <= 1:
        return (leaf, items.reshape(-1).tolist())
    nested = [_is_sequence(v) for v in items]
    if nested and all(nested):
        return ("array", [_leaves(path, f"{field}[{i}]", v, leaf) for i, v in enumerate(items)])
    if any(nested):
        raise _fail(path, field, "mixes arrays and scalars")
    return (leaf, [_plain(v) for v in items])


def _infer_array(path: str, field: str, items: Any) -> tuple[str, Any]:
    """An array with inferred element type: ``(element type, items)`` in the native form."""
    if isinstance(items, np.ndarray):
        leaf = _NUMPY_TYPES.get(items.dtype)
        if leaf is None:
            raise _fail(path, field, f"numpy arrays of {items.dtype} are not a GGUF type")
        return _leaves(path, field, items, leaf)
    items = list(items)
    if not items:
        return ("u32", [])
    if all(_is_sequence(v) or (isinstance(v, Value) and _is_sequence(v.value)) for v in items):
        return (
            "array",
            [_normalize(path, f"{field}[{i}]", v)[1] for i, v in enumerate(items)],
        )
    if any(_is_sequence(v) for v in items):
        raise _fail(path, field, "mixes arrays and scalars")
    types = []
    values = []
    for i, v in enumerate(items):
        if isinstance(v, Value):
            types.append(v.type)
            values.append(_plain(v.value))
            continue
        t = _scalar_type(v)
        if t is None:
            raise _fail(path, f"{field}[{i}]", f"{type(v).__name__} is not a GGUF value")
        types.append(t)
        values.append(_plain(v))
    if len(set(types)) == 1:
        if types[0] in ("u32", "i32", "u64", "i64") and not any(
            isinstance(v, (Value, np.generic)) for v in items
        ):
            # Python ints: one type for the range of all of them.
            found = _int_type(min(values), max(values))
            if found is None:
                raise _fail(path, field, "holds ints no 64-bit type holds together")
            return (found, values)
        return (types[0], values)
    if all(t in _INT_TYPES for t in types):
        found = _int_type(min(values), max(values))
        if found is None:
            raise _fail(path, field, "holds ints no 64-bit type holds together")
        return (found, values)
    if all(t in _INT_TYPES or t in ("f32", "f64") for t in types):
        return ("f64" if "f64" in types else "f32", [float(v) for v in values])
    raise _fail(path, field, f"mixes element types {sorted(set(types))}")


def _normalize(path: str, field: str, value: Any) -> tuple[str, Any]:
    """A metadata value in the native form: ``(type, value)``, arrays as
    ``("array", (element type, items))``."""
    if isinstance(value, Value):
        if _is_sequence(value.value):
            return ("array", _leaves(path, field, value.value, value.type))
        return (value.type, _plain(value.value))
    if _is_sequence(value):
        return ("array", _infer_array(path, field, value))
    t = _scalar_type(value)
    if t is None:
        raise _fail(
            path,
            field,
            f"{type(value).__name__} is not a GGUF value (int, float, bool, str, a list of "
            "them, a numpy scalar or array, or gguf.Value)",
        )
    return (t, _plain(value))


def _tensor(
    path: str, name: str, value: Any
) -> tuple[str, DType, list[int], npt.NDArray[np.uint8]]:
    """A tensor in the native form: ``(name, dtype, ne, bytes as a 1-d uint8 array)``."""
    field = f"tensor {name!r}"
    if isinstance(value, np.ndarray):
        if value.dtype.name not in _TENSOR_DTYPES:
            raise _fail(
                path,
                field,
                f"numpy arrays of {value.dtype} are not stored (use float32, float16, "
                "bfloat16, int8, int16, int32 or int64, or (dtype, shape, bytes) for block "
                "types)",
            )
        # (np.ascontiguousarray makes a 0-d array 1-d: keep the shape given.)
        array = np.ascontiguousarray(value).reshape(-1)
        if not array.dtype.isnative:
            array = array.astype(array.dtype.newbyteorder("="))
        return (name, DType(array.dtype), list(reversed(value.shape)), array.view(np.uint8))
    if isinstance(value, tuple) and len(value) == 3:
        dtype, shape, raw = value
        dims = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
        if isinstance(raw, np.ndarray):
            data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        else:
            data = np.frombuffer(memoryview(raw), dtype=np.uint8)
        return (name, DType(dtype), list(reversed(dims)), data)
    raise _fail(path, field, "expected a numpy array or a (dtype, shape, bytes) tuple for its data")


def write(
    path: str | os.PathLike[str],
    metadata: Mapping[str, Any],
    tensors: Mapping[str, npt.NDArray[Any] | tuple[Any, Any, Any]],
    alignment: int = 32,
) -> None:
    """Writes a version 3 GGUF file at ``path``, atomically (a temporary file renamed over it).

    ``metadata`` maps keys to values, typed as the module's documentation says (or with
    :class:`Value`); ``tensors`` maps names to numpy arrays (float32, float16, bfloat16, int8,
    int16, int32 or int64, stored as that type, numpy-order shape) or to ``(dtype, shape,
    bytes)`` with a ferrograph dtype, a numpy-order shape and the stored bytes (block types
    such as ``fg.q8_0`` or ``fg.q4_K``). Both keep their order in the file; each tensor's data
    starts at a multiple of ``alignment`` (a power of two up to 1 MiB, recorded as
    ``general.alignment`` unless it is the default 32). Invalid input raises
    :class:`ferrograph.GGUFError` naming the key or tensor, and leaves ``path`` as it was.
    """
    shown = os.fspath(path)
    meta = [
        (str(key), _normalize(shown, f"metadata {key!r}", value)) for key, value in metadata.items()
    ]
    native = [_tensor(shown, str(name), value) for name, value in tensors.items()]
    _core.gguf_write(path, meta, native, alignment)
