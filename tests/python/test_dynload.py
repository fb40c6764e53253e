"""Backend libraries loaded at run time, and the BLAS accelerator under the scheduler."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import ferrograph as fg

ROOT = Path(__file__).resolve().parents[2]


def _blas_library() -> Path | None:
    """The loadable BLAS backend that `cargo build -p ferrograph-blas` produces."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    for profile in ("debug", "release"):
        candidate = target / profile / "libferrograph_blas.so"
        if candidate.exists():
            return candidate
    return None


def _need_library() -> Path:
    path = _blas_library()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("libferrograph_blas.so missing: run `cargo build -p ferrograph-blas`")
        pytest.skip("libferrograph_blas.so not built (run `cargo build -p ferrograph-blas`)")
    return path


def _need_blas() -> None:
    if not fg.blas_available():
        reason = fg.blas_unavailable_reason()
        if os.environ.get("CI"):
            pytest.fail(f"no BLAS library in CI: {reason}")
        pytest.skip(f"no BLAS library: {reason}")


def test_bad_libraries_leave_the_registry_intact(tmp_path: Path) -> None:
    before = [r.name for r in fg.registrations()]
    with pytest.raises(fg.BackendError):
        fg.load_backend(tmp_path / "libferrograph_missing.so")
    with pytest.raises(fg.BackendError):
        fg.load_backend("libm.so.6")
    (tmp_path / "libferrograph_fake.so").write_bytes(b"not an ELF file")
    with pytest.raises(fg.BackendError):
        fg.load_backend(tmp_path / "libferrograph_fake.so")
    assert fg.load_backends_from_path(tmp_path) == []
    assert [r.name for r in fg.registrations()] == before
    assert isinstance(fg.backend_search_paths(), list)


def test_load_the_blas_backend_library(rng: np.random.Generator) -> None:
    path = _need_library()
    _need_blas()
    try:
        reg = fg.load_backend(path)
    except fg.BackendError as exc:
        if "fingerprint mismatch" in str(exc) and not os.environ.get("CI"):
            pytest.skip(
                "libferrograph_blas.so was built from other sources than this module: "
                "rebuild it with `cargo build -p ferrograph-blas`"
            )
        raise
    try:
        assert reg.name == "BLAS"
        assert any(b["name"] == "BLAS" for b in fg.loaded_backends())
        dev = fg.dev_by_name("BLAS")
        assert dev is not None and dev.type == fg.DeviceType.ACCEL
        with pytest.raises(fg.BackendError, match="already"):
            fg.load_backend(path)
        blas = fg.init_backend("BLAS", n_threads=2)
        ctx = fg.Context()
        w = ctx.new_tensor(fg.float16, (64, 96), name="w")
        x = ctx.new_tensor(fg.float32, (40, 96), name="x")
        y = fg.ops.mul_mat(w, x, ctx=ctx)
        buf = fg.alloc_ctx_tensors(ctx, fg.init_backend("CPU"))
        assert buf is not None
        wn = rng.standard_normal((64, 96)).astype(np.float16)
        xn = rng.standard_normal((40, 96)).astype(np.float32)
        w.set(wn)
        x.set(xn)
        assert blas.supports_op(y)
        blas.graph_compute(fg.Graph.build(y))
        ref = xn.astype(np.float64) @ wn.astype(np.float64).T
        np.testing.assert_allclose(y.numpy(), ref, rtol=1e-3, atol=1e-3)
        # Under the scheduler: the library's host buffer type counts as the CPU's, so the
        # product moves to BLAS without copies.
        sched = fg.Scheduler([blas, fg.init_backend("CPU")])
        sched.graph_compute(fg.Graph.build(y))
        np.testing.assert_allclose(y.numpy(), ref, rtol=1e-3, atol=1e-3)
        plan = sched.plan
        assert plan is not None and plan.copies == []
        assert {n["op"]: n["backend"] for n in plan.nodes}["MUL_MAT"] == "BLAS"
    finally:
        fg.unload_backend("BLAS")
    assert fg.dev_by_name("BLAS") is None


def test_scheduler_moves_big_products_to_blas(rng: np.random.Generator) -> None:
    _need_blas()
    fg.register_blas()
    try:
        blas = fg.init_backend("BLAS", n_threads=2)
        cpu = fg.init_backend("CPU", n_threads=2)
        wctx = fg.Context()
        w = wctx.new_tensor(fg.float32, (128, 64), name="w")
        wbuf = fg.alloc_ctx_tensors(wctx, cpu)
        assert wbuf is not None
        wbuf.usage = fg.BufferUsage.WEIGHTS
        wn = rng.standard_normal((128, 64)).astype(np.float32)
        w.set(wn)
        ctx = fg.Context()
        x = ctx.new_tensor(fg.float32, (48, 64), name="x")
        x.set_input()
        with ctx:
            y = fg.ops.gelu(fg.ops.mul_mat(w, x))
            y.name = "y"
        g = fg.Graph.build(y)
        sched = fg.Scheduler([blas, cpu])
        sched.alloc_graph(g)
        xn = rng.standard_normal((48, 64)).astype(np.float32)
        x.set(xn)
        sched.graph_compute(g)
        z = xn.astype(np.float64) @ wn.T.astype(np.float64)
        ref = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))
        np.testing.assert_allclose(y.numpy(), ref, rtol=1e-3, atol=1e-3)
        plan = sched.plan
        assert plan is not None
        backends = {n["op"]: n["backend"] for n in plan.nodes}
        assert backends["MUL_MAT"] == "BLAS"
        assert plan.copies == []  # BLAS reads host memory: no copies
    finally:
        fg.unregister_backend("BLAS")
