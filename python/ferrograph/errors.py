"""Exceptions raised by ferrograph.

Every failure of the native library raises a subclass of :class:`Error`; each also derives from
the builtin exception a Python user would expect (``ShapeError`` is a ``ValueError``,
``DTypeError`` a ``TypeError``, ...), so ``except ValueError`` keeps working. A Rust panic never
reaches Python: it is raised as :class:`Error` (a :class:`BackendError`).

The main failures carry their facts as attributes (``None`` where the failure did not record
them): :class:`AllocationError` has ``requested``, ``limit`` and ``buffer_type``;
:class:`UnsupportedOpError` has ``op``, ``dtypes`` (result first) and ``backend``;
:class:`OutOfBoundsError` has ``offset``, ``size`` and ``limit`` (bytes); :class:`ShapeError`
has ``names`` and ``shapes`` (the operands', numpy order); :class:`GGUFError` has ``path``,
``field`` and ``offset`` (the byte in the file)::

    try:
        buffer.read(0, 2**40)
    except fg.OutOfBoundsError as e:
        print(e.offset, e.size, e.limit)
"""

from __future__ import annotations

__all__ = [
    "AbortedError",
    "AllocationError",
    "ArgumentTypeError",
    "BackendError",
    "BusyError",
    "DTypeError",
    "DeviceLostError",
    "Error",
    "GGUFError",
    "InvalidArgumentError",
    "NotAllocatedError",
    "OutOfBoundsError",
    "ShapeError",
    "StaleTensorError",
    "UnsupportedOpError",
]


class Error(Exception):
    """Base class of every ferrograph error."""


class ShapeError(Error, ValueError):
    """Shapes do not fit together (operands of an op, a view, a numpy array, ``out=``).

    ``names`` and ``shapes``: the operands' names and shapes (numpy order) where the op
    builder that refused them recorded them, else None.
    """

    names: tuple[str, ...] | None = None
    shapes: tuple[tuple[int, ...], ...] | None = None


class DTypeError(Error, TypeError):
    """An element type an operation does not accept."""


class AllocationError(Error, MemoryError):
    """Memory could not be provided (a buffer too small, a failed allocation).

    ``requested`` (bytes asked for), ``limit`` (the most the buffer type can give, where known)
    and ``buffer_type`` (its name), where the failure recorded them, else None.
    """

    requested: int | None = None
    limit: int | None = None
    buffer_type: str | None = None


class UnsupportedOpError(Error, NotImplementedError):
    """An op, or op/dtype combination, that a device or kernel does not implement.

    ``op`` (its name, e.g. ``"MUL_MAT"``), ``dtypes`` (the result's then the operands' dtype
    names) and ``backend`` (the backend or device that refused it), where recorded, else None.
    """

    op: str | None = None
    dtypes: tuple[str, ...] | None = None
    backend: str | None = None


class BackendError(Error, RuntimeError):
    """A backend, device or registry failure, a failing custom op, or an internal error."""


class OutOfBoundsError(Error, IndexError):
    """A read or write outside a tensor or buffer, or an index outside a graph.

    ``offset``, ``size`` and ``limit``: the byte range asked for and the size it must fit in,
    where recorded (buffer reads, writes and fills), else None.
    """

    offset: int | None = None
    size: int | None = None
    limit: int | None = None


class StaleTensorError(Error, RuntimeError):
    """A tensor whose memory does not hold its value, raised when it is read (``numpy()``,
    ``np.asarray``, ``tensor_get``). The message names the tensor and the fix:

    * its buffer was freed or reset (allocate again, then compute);
    * the graph allocator gave its memory to a later node that has run since: an intermediate
      is kept only when marked with ``set_output()`` before the graph is allocated;
    * it is a result not computed since its memory was allocated: compute the graph first;
    * it was computed before one of the tensors it depends on was last set: compute again.
    """


class NotAllocatedError(Error, RuntimeError):
    """A tensor that has no memory yet."""


class AbortedError(Error, RuntimeError):
    """A computation stopped by an abort or evaluation callback."""


class InvalidArgumentError(Error, ValueError):
    """An argument outside its allowed range that is none of the above."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong kind: not callable where a callback is needed, not a shape,
    not a tensor, ... (also a ``TypeError``)."""


class BusyError(Error, RuntimeError):
    """The object is in use by a running computation: a callback of that computation (an eval
    or abort callback, a custom op, a Python backend or buffer type, a logging handler) used it,
    or used another object that a different thread holds. Use it after the call returns."""


class DeviceLostError(Error, ConnectionError):
    """A remote device whose server died, hung past its deadline or closed the connection.

    Its buffers and queued work are gone; build a new scheduler from the remaining devices.
    """


class GGUFError(Error, ValueError):
    """A GGUF file that cannot be read (malformed, truncated, hostile, an unsupported version)
    or arguments of :func:`ferrograph.gguf.write` that would not make a valid file.

    The message names the file, the field and its byte offset. ``path`` (the file as given),
    ``field`` (the part of the format that is wrong, such as ``"header.version"`` or
    ``"tensor 'w'.dims[1]"``) and ``offset`` (the byte in the file, or None where the failure
    has no place in it), where recorded, else None.
    """

    path: str | None = None
    field: str | None = None
    offset: int | None = None
