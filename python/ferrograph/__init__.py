"""ferrograph: ggml's backend layer in Rust, driven from Python.

Shapes are numpy-ordered everywhere (``t.shape``, ``t.strides`` in bytes); ggml's order is
``t.ne`` / ``t.nb``. Errors are :class:`ferrograph.Error` and its subclasses, never a crash.

>>> import numpy as np, ferrograph as fg
>>> ctx = fg.Context()
>>> x = ctx.new_tensor(fg.float32, (8, 4096), name="x")
>>> x.ne
(4096, 8, 1, 1)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from . import cpu, distributed, ops, plugins, remote
from ._core import (
    Backend,
    Buffer,
    BufferType,
    BufferUsage,
    Context,
    Device,
    DeviceType,
    Event,
    Graph,
    GraphAllocator,
    GraphCopy,
    GraphPlan,
    Registration,
    SchedPlan,
    Scheduler,
    Tensor,
    TensorAllocator,
    Threadpool,
    alloc_ctx_tensors,
    backend_search_paths,
    bf16_to_fp32,
    blas_available,
    blas_unavailable_reason,
    commit,
    compare_graph_backend,
    cpu_buffer_from_array,
    cpu_buffer_type,
    ctx_tensors_size,
    cycles,
    cycles_per_ms,
    dequantize,
    dev_by_name,
    dev_by_type,
    dev_count,
    dev_get,
    devices,
    fp16_to_fp32,
    fp32_to_bf16,
    fp32_to_bf16_ref,
    fp32_to_fp16,
    fp32_to_i32,
    graph_compute_with_ctx,
    graph_copy,
    guid_matches,
    init_backend,
    init_best,
    init_by_type,
    load_backend,
    load_backends_from_path,
    load_dynamic_backends,
    loaded_backends,
    quantize,
    reg_by_name,
    register_backend,
    register_blas,
    registrations,
    set_global_abort_callback,
    set_log_level,
    simd_path,
    status_to_string,
    system_info,
    tensor_alloc,
    tensor_copy,
    tensor_copy_async,
    tensor_get,
    tensor_memset,
    tensor_set,
    time_ms,
    time_us,
    unload_backend,
    unregister_backend,
    view_init,
)
from ._core import version as _native_version
from .dtypes import (
    DType,
    bf16,
    bfloat16,
    f16,
    f32,
    float16,
    float32,
    i8,
    i16,
    i32,
    i64,
    int8,
    int16,
    int32,
    int64,
    q4_0,
    q8_0,
)
from .errors import (
    AbortedError,
    AllocationError,
    BackendError,
    DeviceLostError,
    DTypeError,
    Error,
    InvalidArgumentError,
    NotAllocatedError,
    OutOfBoundsError,
    ShapeError,
    StaleTensorError,
    UnsupportedOpError,
)

__version__: str = _native_version()


def aligned_empty(
    shape: int | tuple[int, ...], dtype: npt.DTypeLike = np.float32, alignment: int = 64
) -> npt.NDArray[Any]:
    """An uninitialised numpy array whose data is aligned to ``alignment`` bytes, so that
    :func:`cpu_buffer_from_array` can wrap it without copying."""
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start : start + nbytes].view(dt).reshape(dims)


def load_all_backends() -> list[str]:
    """Registers every backend that can be found: backend libraries in the directories of
    ``FERROGRAPH_BACKEND_PATH`` (and the executable's and current directories), then Python
    plugins advertised under the ``ferrograph.backends`` entry-point group. Returns the names
    registered; whatever is skipped is logged with the reason under ``ferrograph.*``."""
    return load_dynamic_backends() + plugins.load_entry_point_backends()


def version() -> str:
    """The library version (same as ``__version__``)."""
    return __version__


__all__ = [
    "AbortedError",
    "AllocationError",
    "Backend",
    "BackendError",
    "Buffer",
    "BufferType",
    "BufferUsage",
    "Context",
    "DType",
    "DTypeError",
    "Device",
    "DeviceLostError",
    "DeviceType",
    "Error",
    "Event",
    "Graph",
    "GraphAllocator",
    "GraphCopy",
    "GraphPlan",
    "InvalidArgumentError",
    "NotAllocatedError",
    "OutOfBoundsError",
    "Registration",
    "SchedPlan",
    "Scheduler",
    "ShapeError",
    "StaleTensorError",
    "Tensor",
    "TensorAllocator",
    "Threadpool",
    "UnsupportedOpError",
    "__version__",
    "aligned_empty",
    "alloc_ctx_tensors",
    "backend_search_paths",
    "bf16",
    "bf16_to_fp32",
    "bfloat16",
    "blas_available",
    "blas_unavailable_reason",
    "commit",
    "compare_graph_backend",
    "cpu",
    "cpu_buffer_from_array",
    "cpu_buffer_type",
    "ctx_tensors_size",
    "cycles",
    "cycles_per_ms",
    "dequantize",
    "dev_by_name",
    "dev_by_type",
    "dev_count",
    "dev_get",
    "devices",
    "distributed",
    "f16",
    "f32",
    "float16",
    "float32",
    "fp16_to_fp32",
    "fp32_to_bf16",
    "fp32_to_bf16_ref",
    "fp32_to_fp16",
    "fp32_to_i32",
    "graph_compute_with_ctx",
    "graph_copy",
    "guid_matches",
    "i8",
    "i16",
    "i32",
    "i64",
    "init_backend",
    "init_best",
    "init_by_type",
    "int8",
    "int16",
    "int32",
    "int64",
    "load_all_backends",
    "load_backend",
    "load_backends_from_path",
    "load_dynamic_backends",
    "loaded_backends",
    "ops",
    "plugins",
    "q4_0",
    "q8_0",
    "quantize",
    "reg_by_name",
    "register_backend",
    "register_blas",
    "registrations",
    "remote",
    "set_global_abort_callback",
    "set_log_level",
    "simd_path",
    "status_to_string",
    "system_info",
    "tensor_alloc",
    "tensor_copy",
    "tensor_copy_async",
    "tensor_get",
    "tensor_memset",
    "tensor_set",
    "time_ms",
    "time_us",
    "unload_backend",
    "unregister_backend",
    "version",
    "view_init",
]
