"""The CPU the library runs on: detected features and the chosen SIMD paths."""

from __future__ import annotations

from . import _core

__all__ = ["features", "simd_path", "system_info"]


def features() -> dict[str, bool]:
    """The CPU features ferrograph detected, e.g. ``{'avx2': True, 'f16c': True, ...}``."""
    return _core.cpu_features()


def system_info() -> str:
    """A one-line summary of the detected features (ggml's ``system_info``)."""
    return _core.system_info()


def simd_path() -> str:
    """The conversion path chosen at run time on this machine."""
    return _core.simd_path()
