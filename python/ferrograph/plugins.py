"""Backends written in Python: the protocol, registration, entry-point discovery and an example.

A Python backend is four small objects. ferrograph calls them from its core (with the
interpreter re-acquired), so a plugin needs no Rust and no compiler:

* a **registration** with ``name`` and ``devices()``;
* a **device** with ``name``, ``buffer_type``, ``supports_op(tensor)`` and
  ``init_backend(params)``; optional ``description``, ``type`` (a :class:`ferrograph.DeviceType`
  or its name; default ``ACCEL``), ``memory()`` → ``(free, total)`` and
  ``accepts_host_buffers`` (True if its backends can read CPU memory directly);
* a **buffer type** with ``name``, ``alignment`` and ``alloc_buffer(size)``; optional
  ``max_size``. Its buffers are *not* host memory: ferrograph moves bytes in and out through
  the buffer's ``read(offset, size) -> bytes``, ``write(offset, data)`` and
  ``fill(offset, size, value)``, and the scheduler inserts copies across the boundary;
* a **backend** with ``name`` and ``graph_compute(graph)`` (return ``False`` to report an abort);
  optional ``synchronize()``. Inside ``graph_compute``, ``tensor.numpy()`` reads an operand and
  ``tensor.set(array)`` writes a result, through the buffers above.

Register one with :func:`register_backend`, or ship it in a distribution under the entry-point
group ``ferrograph.backends`` (the entry point names a registration object or a callable
returning one) and call :func:`load_all_backends`. A method that raises becomes a
:class:`ferrograph.BackendError` naming the plugin and the method (``AllocationError`` for a
``MemoryError``), with the original exception as its ``__cause__``; the registry is left as it
was. What methods return is checked: ``supports_op`` and ``accepts_host_buffers`` must be
``bool``, sizes and alignments non-negative ``int`` in range, ``memory()`` a ``(free, total)``
pair with ``free <= total``, names ``str`` without NUL, ``read`` bytes of the size asked for;
anything else is a ``BackendError`` naming the method and the value. Where the core cannot
report an error (the scheduler asking ``supports_op``), the failure is logged and the op
treated as unsupported; asked directly (``Device.supports_op``, ``Device.memory``,
``BufferType.alloc_size``), it is raised.

:class:`NumpyRegistration` below is a complete, working example: a device whose memory lives in
Python ``bytearray`` objects and whose kernels are numpy expressions.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ._core import Graph, Tensor, register_backend, unregister_backend

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendProtocol",
    "BufferProtocol",
    "BufferTypeProtocol",
    "DeviceProtocol",
    "NumpyRegistration",
    "RegistrationProtocol",
    "load_entry_point_backends",
    "register_backend",
    "unregister_backend",
]

ENTRY_POINT_GROUP = "ferrograph.backends"

_log = logging.getLogger("ferrograph.plugins")


@runtime_checkable
class BufferProtocol(Protocol):
    """Memory of a Python buffer type."""

    def read(self, offset: int, size: int) -> bytes: ...
    def write(self, offset: int, data: bytes) -> None: ...
    def fill(self, offset: int, size: int, value: int) -> None: ...


@runtime_checkable
class BufferTypeProtocol(Protocol):
    """A kind of memory that makes buffers."""

    name: str
    alignment: int

    def alloc_buffer(self, size: int) -> BufferProtocol: ...


@runtime_checkable
class BackendProtocol(Protocol):
    """A stream that computes graphs."""

    name: str

    def graph_compute(self, graph: Graph) -> bool | None: ...


@runtime_checkable
class DeviceProtocol(Protocol):
    """A device: its buffer type, the ops it computes, and its backends."""

    name: str
    buffer_type: BufferTypeProtocol

    def supports_op(self, tensor: Tensor) -> bool: ...
    def init_backend(self, params: dict[str, str]) -> BackendProtocol: ...


@runtime_checkable
class RegistrationProtocol(Protocol):
    """A backend implementation and its devices."""

    name: str

    def devices(self) -> Sequence[DeviceProtocol]: ...


def load_entry_point_backends() -> list[str]:
    """Registers every backend advertised under the ``ferrograph.backends`` entry-point group.

    Returns the names registered. A plugin that fails to import or register is logged (with
    the reason) and skipped; it never stops the others.
    """
    loaded: list[str] = []
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            target: Any = entry_point.load()
            registration = target() if callable(target) else target
            register_backend(registration)
        except Exception as exc:
            _log.warning(
                "skipped backend plugin %s (%s): %s", entry_point.name, entry_point.value, exc
            )
            continue
        _log.info("registered backend plugin %s from %s", registration.name, entry_point.value)
        loaded.append(str(registration.name))
    return loaded


# ----- the example: a numpy device with non-host memory -----


class _BytesBuffer:
    """Device memory of the numpy example: a bytearray that only the methods below touch."""

    def __init__(self, size: int) -> None:
        self.data = bytearray(size)

    def read(self, offset: int, size: int) -> bytes:
        return bytes(self.data[offset : offset + size])

    def write(self, offset: int, data: bytes) -> None:
        self.data[offset : offset + len(data)] = data

    def fill(self, offset: int, size: int, value: int) -> None:
        self.data[offset : offset + size] = bytes([value]) * size


class _BytesBufferType:
    name = "NUMPY"
    alignment = 32

    def alloc_buffer(self, size: int) -> _BytesBuffer:
        return _BytesBuffer(size)


def _gelu(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))
    return out


_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "ABS": np.abs,
    "NEG": np.negative,
    "RELU": lambda x: np.maximum(x, 0),
    "TANH": np.tanh,
    "EXP": np.exp,
    "GELU": _gelu,
    "SILU": lambda x: x / (1.0 + np.exp(-x)),
}
_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "ADD": np.add,
    "SUB": np.subtract,
    "MUL": np.multiply,
    "DIV": np.divide,
}
_NO_WORK = {"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"}


def _f32(t: Tensor) -> bool:
    return t.dtype.name == "f32"


class _NumpyBackend:
    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes_computed = 0

    def graph_compute(self, graph: Graph) -> bool:
        for node in graph.nodes:
            _compute_node(node)
            self.nodes_computed += 1
        return True


def _compute_node(node: Tensor) -> None:
    op = node.op
    if op in _NO_WORK:
        return
    srcs = node.srcs
    if op in _BINARY:
        result = _BINARY[op](srcs[0].numpy(), srcs[1].numpy())
    elif op == "UNARY":
        result = _UNARY[node.op_params["op"]](srcs[0].numpy())
    elif op == "SCALE":
        params = node.op_params
        result = srcs[0].numpy() * params["s"] + params["b"]
    elif op == "SQR":
        x = srcs[0].numpy()
        result = x * x
    elif op == "SQRT":
        result = np.sqrt(srcs[0].numpy())
    elif op == "MUL_MAT":
        # ggml's meaning: result = b @ a.T over the last two axes.
        result = np.matmul(srcs[1].numpy(), np.swapaxes(srcs[0].numpy(), -1, -2))
    elif op in ("CONT", "DUP", "CPY"):
        result = srcs[0].numpy().reshape(node.shape)
    else:  # pragma: no cover - supports_op filters these out
        raise NotImplementedError(op)
    node.set(np.ascontiguousarray(result, dtype=np.float32))


class _NumpyDevice:
    type = "ACCEL"

    def __init__(self, name: str) -> None:
        self.name = name
        self.description = f"{name}: numpy kernels over bytearray memory (example plugin)"
        self.buffer_type = _BytesBufferType()

    def memory(self) -> tuple[int, int]:
        return (1 << 30, 1 << 30)

    def supports_op(self, tensor: Tensor) -> bool:
        op = tensor.op
        srcs = tensor.srcs
        if op in _NO_WORK:
            return True
        if not _f32(tensor) or not all(_f32(s) for s in srcs):
            return False
        if op in _BINARY:
            try:
                shape = np.broadcast_shapes(srcs[0].shape, srcs[1].shape)
            except ValueError:
                return False
            return tuple(shape) == tuple(tensor.shape)
        if op == "UNARY":
            return tensor.op_params.get("op") in _UNARY
        if op == "MUL_MAT":
            return srcs[0].shape[:-2] == srcs[1].shape[:-2]
        return op in ("SCALE", "SQR", "SQRT", "CONT", "DUP", "CPY")

    def init_backend(self, params: dict[str, str]) -> _NumpyBackend:
        return _NumpyBackend(self.name)


class NumpyRegistration:
    """An example Python backend: one device (``NUMPY`` by default) whose memory is Python
    ``bytearray`` objects (not host-addressable, so every edge to the CPU is a real copy) and
    whose kernels are numpy expressions for f32 elementwise ops, a few unary functions and
    ``mul_mat``.

    >>> import ferrograph as fg
    >>> fg.register_backend(fg.plugins.NumpyRegistration())
    >>> fg.init_backend("NUMPY").name
    'NUMPY'
    """

    def __init__(self, name: str = "NUMPY") -> None:
        self.name = name
        self._devices = [_NumpyDevice(name)]

    def devices(self) -> list[_NumpyDevice]:
        return self._devices
