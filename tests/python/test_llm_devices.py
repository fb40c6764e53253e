"""A GGUF language model's layers spread over devices: two ``ferrograph serve`` servers on
loopback give the local logits and tokens, and a server killed mid-generation raises
``DeviceLostError`` within seconds."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import ferrograph as fg
from ferrograph.models import llm as llm_mod
from test_llm import write_tiny_model

TOKEN = "pytest-llm-devices"


@pytest.fixture(scope="module")
def servers() -> Iterator[list[fg.remote.ServerProcess]]:
    procs = [fg.remote.spawn_server(TOKEN, n_threads=1) for _ in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llm-devices") / "tiny.gguf"
    write_tiny_model(path, "qwen2", seed=11, dtype="q8_0")
    return path


def test_layers_over_two_servers_equal_local(
    servers: list[fg.remote.ServerProcess], tiny: Path
) -> None:
    local = llm_mod.LLM(tiny, n_threads=1, n_ctx=128)
    devices = [fg.remote.connect(s.address, token=TOKEN)[0] for s in servers]
    split = llm_mod.LLM(tiny, n_threads=1, n_ctx=128, devices=devices)
    n_layer = split.config.n_layer
    assert split.layer_homes == [1 + i * 2 // n_layer for i in range(n_layer)]
    assert len(split.backends) == 3
    ids = [5, 80, 17, 200, 33, 120, 7, 99]
    want = local.logits(ids)
    got = split.logits(ids)
    # the servers run the same CPU kernels on the same partition: the same numbers
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    plan = split.scheduler.plan
    assert plan is not None
    names = {s["backend"] for s in plan.splits}
    assert {d.name for d in devices} <= names, names
    # decoding (one graph per bucket, its plan reused) gives the local tokens
    a = local.generate([3, 4, 5], max_tokens=12, ignore_eos=True)
    b = split.generate([3, 4, 5], max_tokens=12, ignore_eos=True)
    assert a.tokens == b.tokens


def test_local_devices_are_accepted(tiny: Path) -> None:
    cpu = next(d for d in fg.devices() if d.name == "CPU")
    model = llm_mod.LLM(tiny, n_threads=1, n_ctx=64, devices=[cpu])
    assert model.layer_homes == [1] * model.config.n_layer
    ref = llm_mod.LLM(tiny, n_threads=1, n_ctx=64)
    ids = [9, 8, 7, 6]
    np.testing.assert_allclose(model.logits(ids), ref.logits(ids), rtol=0, atol=1e-5)


def test_a_killed_server_raises_device_lost(tiny: Path) -> None:
    with fg.remote.spawn_server(TOKEN, n_threads=1) as server:
        device = fg.remote.connect(server.address, token=TOKEN, heartbeat=0.2, dead_after=1.5)[0]
        model = llm_mod.LLM(tiny, n_threads=1, n_ctx=256, devices=[device])
        model.generate([3, 4], max_tokens=2, ignore_eos=True)
        threading.Timer(0.2, server.kill).start()
        start = time.monotonic()
        with pytest.raises(fg.DeviceLostError):
            for _ in range(10_000):  # keeps decoding past the kill
                model.generate([3, 4, 5], max_tokens=200, ignore_eos=True)
        assert time.monotonic() - start < 10.0


def test_cli_generate_with_remote_servers_prints_the_local_text(
    servers: list[fg.remote.ServerProcess], tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ferrograph.__main__ import main

    monkeypatch.setenv("FERROGRAPH_TOKEN", TOKEN)
    args = ["generate", "--model", str(tiny), "--threads", "1", "--max-tokens", "8", "abc"]
    out = []
    for extra in ([], ["--remote", ",".join(s.address for s in servers)]):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main([*args, *extra]) == 0
        out.append(buf.getvalue())
    assert out[0] == out[1] and out[0].strip()
