"""Errors, logging, version and CPU information."""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest

import ferrograph as fg
from ferrograph import _core

VARIANTS = {
    "Shape": (fg.ShapeError, ValueError),
    "DType": (fg.DTypeError, TypeError),
    "Alloc": (fg.AllocationError, MemoryError),
    "UnsupportedOp": (fg.UnsupportedOpError, NotImplementedError),
    "Backend": (fg.BackendError, RuntimeError),
    "OutOfBounds": (fg.OutOfBoundsError, IndexError),
    "Stale": (fg.StaleTensorError, RuntimeError),
    "NotAllocated": (fg.NotAllocatedError, RuntimeError),
    "Aborted": (fg.AbortedError, RuntimeError),
    "InvalidArgument": (fg.InvalidArgumentError, ValueError),
    "DeviceLost": (fg.DeviceLostError, ConnectionError),
    "Gguf": (fg.GGUFError, ValueError),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_rust_error_maps_to_its_class(variant: str) -> None:
    cls, builtin = VARIANTS[variant]
    with pytest.raises(cls) as info:
        _core._testing.raise_error(variant, "message")
    assert isinstance(info.value, fg.Error) and isinstance(info.value, builtin)
    assert type(info.value) is cls


def test_error_class_names_are_exported() -> None:
    for name in _core.error_class_names():
        assert issubclass(getattr(fg, name), fg.Error) or getattr(fg, name) is fg.Error


def test_panics_become_fg_errors() -> None:
    with pytest.raises(fg.Error, match="deliberate test panic"):
        _core._testing.panic()


def test_the_test_hooks_are_a_submodule_of_core() -> None:
    import importlib

    import ferrograph._core._testing as by_path
    from ferrograph._core import _testing

    assert _testing is by_path is importlib.import_module("ferrograph._core._testing")
    assert _testing.__name__ == "ferrograph._core._testing"
    assert {"panic", "log", "raise_error", "abort_slot_count"} <= set(dir(_testing))
    for old in ("_panic_for_test", "_log_for_test", "_raise_error", "_abort_slot_count"):
        assert not hasattr(_core, old), old


def test_rust_logs_reach_python_logging(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="ferrograph"):
        _core._testing.log("ferrograph::cpu::compute", "info", "hello from rust")
        _core._testing.log("ferrograph::sched", "debug", "planned 3 splits")
    records = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert ("ferrograph.cpu.compute", logging.INFO, "hello from rust") in records
    assert ("ferrograph.sched", logging.DEBUG, "planned 3 splits") in records


def test_the_crates_log_targets_reach_the_public_logger_names(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The targets the workspace's crates really log under (their crate names).
    targets = {
        "ferrograph_base::sched": "ferrograph.sched",
        "ferrograph_cpu::compute": "ferrograph.cpu.compute",
        "ferrograph_backends::remote::server": "ferrograph.remote.server",
        "_core::plugin": "ferrograph.python.plugin",
    }
    with caplog.at_level(logging.DEBUG, logger="ferrograph"):
        for target in targets:
            _core._testing.log(target, "info", target)
    names = {r.getMessage(): r.name for r in caplog.records}
    for target, name in targets.items():
        assert names.get(target) == name, (target, names.get(target))


def test_the_cpu_buffer_type_belongs_to_the_cpu_from_import_on() -> None:
    # A fresh interpreter: nothing but the import has made the CPU device yet.
    code = "import ferrograph as fg; print(fg.cpu_buffer_type().device.name)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "CPU"


def test_log_levels_filter(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ferrograph"):
        _core._testing.log("ferrograph::x", "info", "dropped")
    assert not [r for r in caplog.records if r.getMessage() == "dropped"]
    fg.set_log_level("error")
    try:
        with caplog.at_level(logging.DEBUG, logger="ferrograph"):
            _core._testing.log("ferrograph::x", "warn", "also dropped")
        assert not [r for r in caplog.records if r.getMessage() == "also dropped"]
    finally:
        fg.set_log_level("debug")
    with pytest.raises(fg.InvalidArgumentError):
        fg.set_log_level("loud")


def test_version_and_cpu() -> None:
    assert fg.__version__ == fg.version() == "0.1.0"
    features = fg.cpu.features()
    assert isinstance(features, dict) and all(isinstance(v, bool) for v in features.values())
    assert isinstance(fg.cpu.system_info(), str) and fg.system_info() == fg.cpu.system_info()
    assert isinstance(fg.simd_path(), str) and fg.cpu.simd_path() == fg.simd_path()


def test_fma_peak_is_measured_and_checks_its_arguments() -> None:
    if not fg.cpu.features().get("avx2"):
        with pytest.raises(fg.UnsupportedOpError):
            fg.cpu.fma_peak_gflops(1, seconds=0.001)
        return
    for n in (1, 2, 3, None):
        peak = fg.cpu.fma_peak_gflops(n, seconds=0.001)
        assert isinstance(peak, float) and 0 < peak < float("inf")
    with pytest.raises(fg.InvalidArgumentError):
        fg.cpu.fma_peak_gflops(0)
    with pytest.raises(fg.InvalidArgumentError):
        fg.cpu.fma_peak_gflops(1, seconds=-1.0)
    with pytest.raises(fg.InvalidArgumentError):
        fg.cpu.fma_peak_gflops(1, seconds=float("nan"))


def test_all_is_complete() -> None:
    for name in fg.__all__:
        assert hasattr(fg, name), name


def test_cpu_type_traits() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal(64).astype(np.float32)
    y = rng.standard_normal(64).astype(np.float32)
    exact = float(x.astype(np.float64) @ y.astype(np.float64))
    for name, tol in (("f32", 1e-4), ("f16", 2e-2), ("bf16", 2e-1), ("q8_0", 2e-1), ("q4_0", 1.0)):
        traits = fg.cpu.type_traits(name)
        assert traits.has_from_float and traits.has_vec_dot and traits.nrows == 1
        xr = traits.from_float(x)
        yr = fg.cpu.type_traits(traits.vec_dot_type).from_float(y)
        assert xr.dtype == np.uint8 and xr.nbytes == traits.dtype.row_size(64)
        assert abs(traits.vec_dot(xr, yr, 64) - exact) < tol, name
    assert fg.cpu.type_traits("q4_0").vec_dot_type is fg.q8_0
    assert not fg.cpu.type_traits("i32").has_vec_dot
    with pytest.raises(fg.ShapeError):
        fg.cpu.type_traits("f16").vec_dot(b"\0" * 8, b"\0" * 6, 4)
    with pytest.raises(fg.UnsupportedOpError):
        fg.cpu.type_traits("i32").vec_dot(b"", b"", 0)
