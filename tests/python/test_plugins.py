"""Backends written in Python: registration, computing through non-host buffers, entry-point
discovery, and plugins that break the protocol."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import ferrograph as fg
from ferrograph.plugins import NumpyRegistration


@pytest.fixture
def numpy_backend() -> Iterator[fg.Backend]:
    fg.register_backend(NumpyRegistration("NUMPYTEST"))
    try:
        yield fg.init_backend("numpytest")
    finally:
        fg.unregister_backend("NUMPYTEST")


def test_plugin_device_is_listed_and_unregistered() -> None:
    before = fg.dev_count()
    fg.register_backend(NumpyRegistration("NUMPYLIST"))
    try:
        dev = fg.dev_by_name("NUMPYLIST")
        assert dev is not None and fg.dev_count() == before + 1
        assert dev.type == fg.DeviceType.ACCEL
        assert dev.memory == (1 << 30, 1 << 30)
        assert "numpy kernels" in dev.description
        assert not dev.buffer_type.is_host
        assert not dev.supports_buft(fg.cpu_buffer_type())
        assert dev.supports_buft(dev.buffer_type)
        with pytest.raises(fg.BackendError, match="already"):
            fg.register_backend(NumpyRegistration("NUMPYLIST"))
    finally:
        fg.unregister_backend("NUMPYLIST")
    assert fg.dev_by_name("NUMPYLIST") is None and fg.dev_count() == before
    with pytest.raises(fg.BackendError):
        fg.unregister_backend("NUMPYLIST")
    with pytest.raises(fg.BackendError):
        fg.unregister_backend("CPU")


def test_plugin_computes_through_non_host_memory(
    numpy_backend: fg.Backend, rng: np.random.Generator
) -> None:
    ctx = fg.Context()
    a = ctx.new_tensor(fg.float32, (5, 7), name="a")
    w = ctx.new_tensor(fg.float32, (3, 7), name="w")
    with ctx:
        y = fg.ops.relu(fg.ops.add(fg.ops.mul_mat(w, a), fg.ops.scale(fg.ops.mul_mat(w, a), 2.0)))
    g = fg.Graph.build(y)
    assert all(numpy_backend.supports_op(n) for n in g.nodes)
    buf = fg.alloc_ctx_tensors(ctx, numpy_backend)
    assert buf is not None and not buf.is_host and buf.base is None
    an = rng.standard_normal((5, 7)).astype(np.float32)
    wn = rng.standard_normal((3, 7)).astype(np.float32)
    a.set(an)  # through the plugin's write()
    w.set(wn)
    np.testing.assert_array_equal(a.numpy(), an)  # through read()
    numpy_backend.graph_compute(g)
    expected = np.maximum(3 * (an @ wn.T), 0)
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-5, atol=1e-5)
    buf.clear(0)  # through fill()
    assert not a.numpy().any()
    with pytest.raises(fg.OutOfBoundsError):
        numpy_backend.set_tensor_async(a, np.zeros(100, np.float32))


def test_plugin_reports_unsupported_ops(numpy_backend: fg.Backend) -> None:
    ctx = fg.Context()
    x = ctx.new_tensor(fg.float16, (4,), name="x")
    assert not numpy_backend.supports_op(fg.ops.sqr(x, ctx=ctx))
    y = ctx.new_tensor(fg.float32, (4,), name="y")
    assert not numpy_backend.supports_op(fg.ops.soft_max(y, ctx=ctx))


class _Broken:
    """A registration whose device breaks the protocol in chosen places."""

    def __init__(self, name: str, fail: str) -> None:
        self.name = name
        self.fail = fail
        inner = NumpyRegistration(name).devices()[0]
        outer = self

        class Device:
            def __init__(self) -> None:
                self.name = name
                self.buffer_type = inner.buffer_type if fail != "buffer_type" else None

            def supports_op(self, tensor: fg.Tensor) -> bool:
                if outer.fail == "supports_op":
                    raise RuntimeError("supports_op exploded")
                return inner.supports_op(tensor)

            def init_backend(self, params: dict[str, str]) -> object:
                if outer.fail == "init_backend":
                    raise RuntimeError("cannot open")
                return inner.init_backend(params)

        self.device = Device()

    def devices(self) -> list[object]:
        if self.fail == "devices":
            raise RuntimeError("no devices today")
        return [self.device]


@pytest.mark.parametrize("fail", ["devices", "buffer_type"])
def test_broken_registration_is_rejected_and_registry_intact(fail: str) -> None:
    before = [d.name for d in fg.devices()]
    with pytest.raises(fg.BackendError, match="BROKEN"):
        fg.register_backend(_Broken("BROKEN", fail))
    assert [d.name for d in fg.devices()] == before
    assert fg.reg_by_name("BROKEN") is None


def test_plugin_that_raises_at_run_time() -> None:
    fg.register_backend(_Broken("FLAKY", "init_backend"))
    try:
        with pytest.raises(fg.BackendError, match="cannot open"):
            fg.init_backend("FLAKY")
        reg = _Broken("FLAKY2", "supports_op")
        fg.register_backend(reg)
        try:
            dev = fg.dev_by_name("FLAKY2")
            assert dev is not None
            x = fg.Context().new_tensor(fg.float32, (2,))
            # Asked directly, the plugin's exception reaches the caller (as __cause__); the
            # scheduler, which cannot take an error there, logs it and treats the op as
            # unsupported.
            with pytest.raises(fg.BackendError, match="supports_op") as info:
                dev.supports_op(x)
            assert isinstance(info.value.__cause__, RuntimeError)
        finally:
            fg.unregister_backend("FLAKY2")
    finally:
        fg.unregister_backend("FLAKY")


def test_entry_point_discovery(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fg_demo_plugin.py").write_text(
        textwrap.dedent(
            """
            from ferrograph.plugins import NumpyRegistration

            def make():
                return NumpyRegistration("EPDEMO")

            def broken():
                raise RuntimeError("this plugin cannot start")
            """
        )
    )
    dist = tmp_path / "fg_demo_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fg-demo-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[ferrograph.backends]\ndemo = fg_demo_plugin:make\nbad = fg_demo_plugin:broken\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        loaded = fg.load_all_backends()
        assert "EPDEMO" in loaded
        assert fg.dev_by_name("EPDEMO") is not None
        assert fg.init_backend("EPDEMO").name == "EPDEMO"
    finally:
        if fg.reg_by_name("EPDEMO") is not None:
            fg.unregister_backend("EPDEMO")
        sys.modules.pop("fg_demo_plugin", None)
