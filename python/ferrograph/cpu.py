"""The CPU the library runs on: detected features and the chosen SIMD paths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _core
from .dtypes import DType

__all__ = [
    "TypeTraits",
    "features",
    "fma_peak_gflops",
    "int8_peak_gops",
    "simd_path",
    "system_info",
    "type_traits",
]


@dataclass(frozen=True)
class TypeTraits:
    """What the CPU backend knows about one element type (ggml's ``get_type_traits_cpu``).

    ``from_float(x)`` converts a 1-d float32 array into a row of the type (its bytes, uint8);
    ``vec_dot(x, y, n)`` is the dot product of ``n`` elements of a row of this type with a row
    of ``vec_dot_type`` (the type activations are converted to, e.g. q8_0 for q4_0 weights).
    """

    dtype: DType
    has_from_float: bool
    has_vec_dot: bool
    vec_dot_type: DType
    nrows: int

    def from_float(self, x: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        """The row of this type for the float32 values ``x`` (as bytes)."""
        return _core.cpu_from_float(self.dtype, np.ascontiguousarray(x, dtype=np.float32))

    def vec_dot(self, x: Any, y: Any, n: int) -> float:
        """Dot product of ``n`` elements: ``x`` a row of this type, ``y`` of ``vec_dot_type``."""
        return float(_core.cpu_vec_dot(self.dtype, n, bytes(x), bytes(y)))


def type_traits(dtype: Any) -> TypeTraits:
    """The CPU type traits of ``dtype`` (a ``fg.DType``, name or numpy dtype)."""
    dt = DType(dtype)
    has_from_float, has_vec_dot, partner, nrows = _core.cpu_type_traits(dt)
    return TypeTraits(dt, has_from_float, has_vec_dot, DType(partner), nrows)


def features() -> dict[str, bool]:
    """The CPU features ferrograph detected, e.g. ``{'avx2': True, 'f16c': True, ...}``."""
    return _core.cpu_features()


def system_info() -> str:
    """A one-line summary of the detected features (ggml's ``system_info``)."""
    return _core.system_info()


def simd_path() -> str:
    """The conversion path chosen at run time on this machine."""
    return _core.simd_path()


def fma_peak_gflops(n_threads: int | None = None, seconds: float = 0.2) -> float:
    """This machine's f32 multiply-add peak in GFLOPS, measured: ``n_threads`` threads
    (default: the cores available to the process) each run independent fused multiply-add chains
    on the widest vector ISA the kernels use (AVX-512, else AVX2) for about ``seconds``, best of
    three runs. The figure GEMM efficiency is quoted against (``benches/compare_kernels.py``).

    Raises ``fg.InvalidArgumentError`` for a thread count outside ``1..512`` or a negative
    ``seconds``, and ``fg.UnsupportedOpError`` on a CPU without AVX2 and FMA.
    """
    return float(_core.cpu_fma_peak_gflops(n_threads, seconds))


def int8_peak_gops(n_threads: int | None = None, seconds: float = 0.2) -> float:
    """This machine's peak for the integer GEMM's byte products (q8_0/q4_0 weights) in
    giga-operations per second (a product and its sum count two), measured like
    :func:`fma_peak_gflops`: chains of ``vpdpbusd`` on CPUs with AVX-512 VNNI, else of the AVX2
    kernel's ``vpmaddwd`` + ``vpaddd``. The figure ``benches/compare_kernels.py`` quotes the
    q8_0/q4_0 GEMM against.

    Raises ``fg.InvalidArgumentError`` for a thread count outside ``1..512`` or a negative
    ``seconds``, and ``fg.UnsupportedOpError`` on a CPU without AVX2.
    """
    return float(_core.cpu_int8_peak_gops(n_threads, seconds))
