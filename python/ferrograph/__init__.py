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

import logging
import os
import sys
from typing import Any

import numpy as np
import numpy.typing as npt

from . import cpu, distributed, gguf, ops, plugins, remote
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
    Profile,
    Registration,
    SchedPlan,
    Scheduler,
    SplitBufferType,
    SplitWeight,
    Tensor,
    TensorAllocator,
    Threadpool,
    ThreadpoolParams,
    alloc_ctx_tensors,
    backend_search_paths,
    bf16_to_fp32,
    blas_available,
    blas_unavailable_reason,
    commit,
    compare_graph_backend,
    cpu_buffer_from_array,
    cpu_buffer_type,
    cpu_feature_counts,
    cpu_fp32_to_fp32,
    cpu_init,
    ctx_tensors_size,
    cycles,
    cycles_per_ms,
    dequantize,
    dev_by_name,
    dev_by_type,
    dev_count,
    dev_get,
    device_register,
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
    is_numa,
    load_backend,
    load_backends_from_path,
    load_dynamic_backends,
    loaded_backends,
    numa_init,
    quantize,
    reg_by_name,
    reg_count,
    reg_get,
    register_backend,
    register_blas,
    registrations,
    set_global_abort_callback,
    set_log_callback,
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
    threadpool_params_default,
    threadpool_params_init,
    threadpool_params_match,
    time_init,
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
    f64,
    float16,
    float32,
    float64,
    i8,
    i16,
    i32,
    i64,
    int8,
    int16,
    int32,
    int64,
    iq1_m,
    iq1_s,
    iq2_s,
    iq2_xs,
    iq2_xxs,
    iq3_s,
    iq3_xxs,
    iq4_nl,
    iq4_xs,
    mxfp4,
    nvfp4,
    q1_0,
    q2_0,
    q2_K,
    q3_K,
    q4_0,
    q4_1,
    q4_K,
    q5_0,
    q5_1,
    q5_K,
    q6_K,
    q8_0,
    q8_1,
    q8_K,
    tq1_0,
    tq2_0,
)
from .errors import (
    AbortedError,
    AllocationError,
    ArgumentTypeError,
    BackendError,
    BusyError,
    DeviceLostError,
    DTypeError,
    Error,
    GGUFError,
    InvalidArgumentError,
    NotAllocatedError,
    OutOfBoundsError,
    ShapeError,
    StaleTensorError,
    UnsupportedOpError,
)

__version__: str = _native_version()


class _StderrUnlessConfigured(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes records to stderr unless the application configured logging (a root handler),
    which then shows them itself through propagation."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def _show_sched_debug() -> None:
    """``FERROGRAPH_SCHED_DEBUG=1``: every new scheduler plan on stderr, with or without a
    ``logging`` set-up (the plans are INFO records of the ``ferrograph.sched`` logger)."""
    if "FERROGRAPH_SCHED_DEBUG" not in os.environ:  # set at all, as the scheduler reads it
        return
    logger = logging.getLogger("ferrograph.sched")
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    if not any(isinstance(h, _StderrUnlessConfigured) for h in logger.handlers):
        handler = _StderrUnlessConfigured(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)


_show_sched_debug()


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
    "ArgumentTypeError",
    "Backend",
    "BackendError",
    "Buffer",
    "BufferType",
    "BufferUsage",
    "BusyError",
    "Context",
    "DType",
    "DTypeError",
    "Device",
    "DeviceLostError",
    "DeviceType",
    "Error",
    "Event",
    "GGUFError",
    "Graph",
    "GraphAllocator",
    "GraphCopy",
    "GraphPlan",
    "InvalidArgumentError",
    "NotAllocatedError",
    "OutOfBoundsError",
    "Profile",
    "Registration",
    "SchedPlan",
    "Scheduler",
    "ShapeError",
    "SplitBufferType",
    "SplitWeight",
    "StaleTensorError",
    "Tensor",
    "TensorAllocator",
    "Threadpool",
    "ThreadpoolParams",
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
    "cpu_feature_counts",
    "cpu_fp32_to_fp32",
    "cpu_init",
    "ctx_tensors_size",
    "cycles",
    "cycles_per_ms",
    "dequantize",
    "dev_by_name",
    "dev_by_type",
    "dev_count",
    "dev_get",
    "device_register",
    "devices",
    "distributed",
    "f16",
    "f32",
    "f64",
    "float16",
    "float32",
    "float64",
    "fp16_to_fp32",
    "fp32_to_bf16",
    "fp32_to_bf16_ref",
    "fp32_to_fp16",
    "fp32_to_i32",
    "gguf",
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
    "iq1_m",
    "iq1_s",
    "iq2_s",
    "iq2_xs",
    "iq2_xxs",
    "iq3_s",
    "iq3_xxs",
    "iq4_nl",
    "iq4_xs",
    "is_numa",
    "load_all_backends",
    "load_backend",
    "load_backends_from_path",
    "load_dynamic_backends",
    "loaded_backends",
    "mxfp4",
    "numa_init",
    "nvfp4",
    "ops",
    "plugins",
    "q1_0",
    "q2_0",
    "q2_K",
    "q3_K",
    "q4_0",
    "q4_1",
    "q4_K",
    "q5_0",
    "q5_1",
    "q5_K",
    "q6_K",
    "q8_0",
    "q8_1",
    "q8_K",
    "quantize",
    "reg_by_name",
    "reg_count",
    "reg_get",
    "register_backend",
    "register_blas",
    "registrations",
    "remote",
    "set_global_abort_callback",
    "set_log_callback",
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
    "threadpool_params_default",
    "threadpool_params_init",
    "threadpool_params_match",
    "time_init",
    "time_ms",
    "time_us",
    "tq1_0",
    "tq2_0",
    "unload_backend",
    "unregister_backend",
    "version",
    "view_init",
]

# ``fg.models`` (sentence encoders) without a separate import; last, because its modules build
# on the names above. Its heavy dependencies (safetensors, tokenizers) load only with a model.
from . import models as models  # noqa: E402  (a re-export)


def __dir__() -> list[str]:
    """The public API (``__all__`` and the ``models`` package), not the modules this package
    imports for its own use (``np``, ``os``, ``sys``...)."""
    return sorted({*__all__, "models", "__version__"})
