"""Reads that would return bytes which are not the tensor's value raise StaleTensorError:
an intermediate whose memory the allocator gave to a later node, a result not computed since
its memory was bound, a result older than its inputs. Checked on every kind of backend: CPU,
a backend written in Python, a remote device, and a scheduler with several splits."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest

import ferrograph as fg
from ferrograph.plugins import NumpyRegistration

TOKEN = "stale-read-test-token"


@dataclass
class Runner:
    """Allocates and computes graphs on one kind of backend."""

    name: str
    alloc: Callable[[fg.Graph], None]
    compute: Callable[[fg.Graph], None]


def _galloc_runner(name: str, backend: fg.Backend) -> Runner:
    galloc = fg.GraphAllocator(backend.default_buffer_type)
    return Runner(name, galloc.alloc_graph, lambda g: backend.graph_compute(g))


@pytest.fixture(params=["cpu", "python", "remote", "sched"])
def runner(request: pytest.FixtureRequest) -> Iterator[Runner]:
    kind = request.param
    if kind == "cpu":
        yield _galloc_runner(kind, fg.init_backend("CPU", n_threads=1))
    elif kind == "python":
        fg.register_backend(NumpyRegistration("NPSTALE"))
        try:
            yield _galloc_runner(kind, fg.init_backend("npstale"))
        finally:
            fg.unregister_backend("NPSTALE")
    elif kind == "remote":
        with fg.remote.RemoteServer(TOKEN, n_threads=1) as server:
            device = fg.remote.connect(server.address, token=TOKEN)[0]
            yield _galloc_runner(kind, device.init_backend())
    else:
        fg.register_backend(NumpyRegistration("NPSTALESCHED"))
        try:
            npb = fg.init_backend("npstalesched")
            cpu = fg.init_backend("CPU", n_threads=1)
            sched = fg.Scheduler([npb, cpu])

            def alloc(g: fg.Graph) -> None:
                # Every SCALE on the Python backend, the rest on the CPU: several splits.
                for node in g.nodes:
                    sched.set_tensor_backend(node, npb if node.op == "SCALE" else cpu)
                sched.alloc_graph(g)

            runner = Runner(kind, alloc, lambda g: sched.graph_compute(g))
            runner.n_splits = lambda: sched.n_splits  # type: ignore[attr-defined]
            yield runner
        finally:
            fg.unregister_backend("NPSTALESCHED")


def _chain(keep_m: bool = False) -> tuple[fg.Tensor, fg.Tensor, fg.Tensor, fg.Graph]:
    """x -> m = 3x -> scale(m, 1) (in place over m unless m is an output) -> neg -> relu."""
    ctx = fg.Context()
    x = ctx.new_tensor(fg.float32, (4,), name="x").set_input()
    with ctx:
        m = fg.ops.scale(x, 3.0)
        m.name = "m"
        if keep_m:
            m.set_output()
        z = fg.ops.relu(fg.ops.neg(fg.ops.scale(m, 1.0))).set_output()
    return x, m, z, fg.Graph.build(z)


def test_an_overwritten_intermediate_raises(runner: Runner) -> None:
    x, m, z, g = _chain()
    runner.alloc(g)
    x.set(np.arange(4, dtype=np.float32) - 2)
    runner.compute(g)
    np.testing.assert_array_equal(z.numpy(), [6, 3, 0, 0])
    # The second SCALE computes in place over m (its only consumer): m's bytes are its now.
    with pytest.raises(fg.StaleTensorError, match=r"tensor 'm'.*later step.*set_output\(\)"):
        m.numpy()
    with pytest.raises(fg.StaleTensorError):
        fg.tensor_get(m)
    if runner.name == "sched":
        assert runner.n_splits() >= 2  # type: ignore[attr-defined]
        # The input was copied to the Python backend, then its memory held the copy of the
        # second SCALE's result coming back to the CPU.
        with pytest.raises(fg.StaleTensorError, match="tensor 'x' no longer holds its value"):
            x.numpy()
    else:
        np.testing.assert_array_equal(x.numpy(), np.arange(4) - 2)


def test_a_replayed_allocation_keeps_detecting_overwrites(runner: Runner) -> None:
    """The same graph allocated again (a decode loop) may reuse what its last allocation
    recorded, but not after another graph's allocation recorded something else about m."""
    x, m, z, g = _chain()

    def step() -> None:
        runner.alloc(g)
        x.set(np.arange(4, dtype=np.float32) - 2)
        runner.compute(g)
        np.testing.assert_array_equal(z.numpy(), [6, 3, 0, 0])
        with pytest.raises(fg.StaleTensorError, match=r"tensor 'm'.*later step"):
            m.numpy()

    step()
    step()
    # Another graph reading m, in its own memory: nothing of it overwrites m.
    with fg.Context():
        y = fg.ops.scale(m, 1.0).set_output()
    other = fg.Graph.build(y)
    fg.GraphAllocator(fg.cpu_buffer_type()).alloc_graph(other)
    step()
    step()


def test_set_output_keeps_the_value(runner: Runner) -> None:
    x, m, z, g = _chain(keep_m=True)
    runner.alloc(g)
    x.set(np.arange(4, dtype=np.float32))
    runner.compute(g)
    np.testing.assert_array_equal(m.numpy(), [0, 3, 6, 9])
    np.testing.assert_array_equal(z.numpy(), [0, 0, 0, 0])


def test_reading_before_compute_raises(runner: Runner) -> None:
    x, m, z, g = _chain(keep_m=True)
    runner.alloc(g)
    x.set(np.ones(4, dtype=np.float32))
    with pytest.raises(fg.StaleTensorError, match=r"not been computed.*compute"):
        z.numpy()
    with pytest.raises(fg.StaleTensorError, match="tensor 'm' has not been computed"):
        np.asarray(m)
    # The input itself holds what was set.
    np.testing.assert_array_equal(x.numpy(), np.ones(4))
    runner.compute(g)
    np.testing.assert_array_equal(m.numpy(), [3, 3, 3, 3])


def test_inputs_set_after_compute_make_results_stale(runner: Runner) -> None:
    x, m, z, g = _chain(keep_m=True)
    runner.alloc(g)
    x.set(np.full(4, -1, dtype=np.float32))
    runner.compute(g)
    np.testing.assert_array_equal(z.numpy(), [3, 3, 3, 3])
    x.set(np.full(4, 2, dtype=np.float32))
    with pytest.raises(fg.StaleTensorError, match="computed before tensor 'x' was last set"):
        z.numpy()
    with pytest.raises(fg.StaleTensorError, match="compute its graph again"):
        fg.tensor_get(m)
    runner.compute(g)
    np.testing.assert_array_equal(z.numpy(), [0, 0, 0, 0])
    np.testing.assert_array_equal(m.numpy(), [6, 6, 6, 6])


def test_a_view_reads_its_sources_state(runner: Runner) -> None:
    ctx = fg.Context()
    x = ctx.new_tensor(fg.float32, (2, 3), name="x").set_input()
    with ctx:
        y = fg.ops.scale(x, 2.0).set_output()
        y.name = "y"
        row = fg.ops.view(y, (3,), None, 12)
    g = fg.Graph.build(y)
    runner.alloc(g)
    x.set(np.arange(6, dtype=np.float32).reshape(2, 3))
    with pytest.raises(fg.StaleTensorError, match="a view of tensor 'y'"):
        row.numpy()
    runner.compute(g)
    np.testing.assert_array_equal(row.numpy(), [6, 8, 10])


def test_cpu_graph_compute_with_ctx_results_are_current() -> None:
    host = fg.Context(no_alloc=False)
    x = host.new_tensor(fg.float32, (3,), name="x")
    y = fg.ops.scale(x, 2.0, ctx=host)
    x.set(np.array([1, 2, 3], np.float32))
    with pytest.raises(fg.StaleTensorError, match="not been computed"):
        y.numpy()
    fg.graph_compute_with_ctx(fg.Graph.build(y), 1)
    np.testing.assert_array_equal(y.numpy(), [2, 4, 6])


def test_unallocated_message_says_what_to_do() -> None:
    ctx = fg.Context()
    x = ctx.new_tensor(fg.float32, (3,))
    y = fg.ops.relu(x, ctx=ctx)
    with pytest.raises(fg.NotAllocatedError, match=r"RELU, shape \(3,\).*alloc_graph"):
        y.numpy()


def test_the_eval_callback_reads_what_it_asked_for() -> None:
    cpu = fg.init_backend("CPU", n_threads=1)
    sched = fg.Scheduler([cpu])
    x, _m, _z, g = _chain()
    seen: dict[str, np.ndarray] = {}

    def callback(t: fg.Tensor, ask: bool) -> bool:
        if ask:
            return t.name == "m"
        seen[t.name] = t.numpy()
        return True

    sched.set_eval_callback(callback)
    sched.alloc_graph(g)
    x.set(np.arange(4, dtype=np.float32))
    sched.graph_compute(g)
    np.testing.assert_array_equal(seen["m"], [0, 3, 6, 9])
