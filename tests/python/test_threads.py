"""Threads and the locks behind Python objects: every object that takes a core lock and calls
Python (the scheduler, the graph allocator, a graph plan, backends and buffer types written in
Python, log forwarding) is used from two threads at once, and from its own callbacks.

Concurrent use must work or wait, re-entrant use must raise ``BusyError``; nothing may
deadlock. Each scenario runs in a child process with a timeout, so a deadlock fails the test
instead of hanging the run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

TIMEOUT = 60

PRELUDE = """
import logging, threading, time
import numpy as np
import ferrograph as fg
from ferrograph.plugins import NumpyRegistration

cpu = fg.init_backend("CPU", n_threads=2)


def slow_copy(out, a):
    time.sleep(0.002)
    out[...] = a


def chain(n_ops=6, size=64, custom=True):
    ctx = fg.Context()
    x = ctx.new_tensor(fg.float32, (size,), name="x")
    with ctx:
        y = x
        for _ in range(n_ops):
            y = fg.ops.relu(fg.ops.scale(y, 1.0))
            if custom:
                y = fg.ops.custom(slow_copy, [y], fg.float32, (size,))
    buf = fg.alloc_ctx_tensors(ctx, cpu)
    x.set(np.arange(size, dtype=np.float32))
    return ctx, buf, x, y, fg.Graph.build(y)


def hammer(work, readers, seconds=1.5, n_workers=1):
    # Runs `work` in worker threads while the main thread calls each reader in turn; raises
    # the first error of a worker; fails if a worker does not finish (a deadlock).
    errors = []
    stop = threading.Event()

    def run():
        try:
            while not stop.is_set():
                work()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(n_workers)]
    for t in threads:
        t.start()
    end = time.monotonic() + seconds
    calls = 0
    while time.monotonic() < end and not errors:
        for read in readers:
            read()
            calls += 1
    stop.set()
    for t in threads:
        t.join(20)
        assert not t.is_alive(), "a worker thread did not finish: deadlock"
    if errors:
        raise errors[0]
    assert calls > 0
"""


def run_scenario(body: str) -> None:
    code = PRELUDE + "\n" + textwrap.dedent(body)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"deadlock: the scenario did not finish within {TIMEOUT} s")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_scheduler_compute_with_custom_ops_while_another_thread_reads() -> None:
    run_scenario(
        """
        ctx, buf, x, y, g = chain()
        s = fg.Scheduler([cpu])
        hammer(
            lambda: s.graph_compute(g),
            [lambda: s.plan, lambda: s.n_splits, lambda: s.n_copies, lambda: repr(s),
             lambda: s.memory_plan, lambda: s.get_buffer_size(cpu)],
        )
        s.graph_compute(g)
        np.testing.assert_array_equal(y.numpy(), np.arange(64, dtype=np.float32))
        """
    )


def test_scheduler_two_threads_compute_and_reset() -> None:
    run_scenario(
        """
        ctx, buf, x, y, g = chain(n_ops=3)
        s = fg.Scheduler([cpu])
        def work():
            try:
                s.alloc_graph(g)
                s.graph_compute(g)
            except fg.NotAllocatedError:
                pass  # the other thread's reset between our allocation and compute
        hammer(work, [lambda: s.reset(), lambda: s.plan], n_workers=2)
        """
    )


def test_scheduler_callback_reentry_is_busy_error() -> None:
    run_scenario(
        """
        ctx, buf, x, y, g = chain(n_ops=2, custom=False)
        s = fg.Scheduler([cpu])
        for use in (lambda: s.n_splits, lambda: s.plan, lambda: s.reset(),
                    lambda: s.graph_compute(g), lambda: s.set_eval_callback(None)):
            s.set_eval_callback(lambda t, ask, use=use: use() or True)
            try:
                s.graph_compute(g)
            except fg.BusyError as e:
                assert "Scheduler" in str(e) and "busy" in str(e)
            else:
                raise AssertionError("re-entrant use did not raise BusyError")
        s.set_eval_callback(None)
        s.graph_compute(g)  # still usable
        """
    )


def test_custom_op_using_its_scheduler_is_busy_not_deadlock() -> None:
    run_scenario(
        """
        s = None
        def peek(out, a):
            s.n_splits
            out[...] = a
        ctx = fg.Context()
        x = ctx.new_tensor(fg.float32, (8,))
        with ctx:
            y = fg.ops.custom(peek, [fg.ops.relu(x)], fg.float32, (8,))
        buf = fg.alloc_ctx_tensors(ctx, cpu)
        x.set(np.ones(8, np.float32))
        s = fg.Scheduler([cpu])
        try:
            s.graph_compute(fg.Graph.build(y))
        except fg.Error as e:
            assert "busy" in str(e).lower(), e
        else:
            raise AssertionError("no error")
        """
    )


def test_graph_allocator_with_python_buffer_type_from_two_threads() -> None:
    run_scenario(
        """
        fg.register_backend(NumpyRegistration("NPTHREADS"))
        nb = fg.init_backend("NPTHREADS")
        ctx = fg.Context()
        x = ctx.new_tensor(fg.float32, (256,))
        with ctx:
            y = fg.ops.relu(fg.ops.scale(fg.ops.relu(x), 2.0))
        g = fg.Graph.build(y)
        ga = fg.GraphAllocator(nb)
        def work():
            ga.reserve(g)
            ga.alloc_graph(g)
            ga.release()
        hammer(work, [lambda: ga.buffer_size(0), lambda: ga.plan, lambda: repr(ga)])
        """
    )


def test_python_backend_in_scheduler_while_another_thread_reads() -> None:
    run_scenario(
        """
        fg.register_backend(NumpyRegistration("NPSCHED"))
        nb = fg.init_backend("NPSCHED")
        ctx = fg.Context()
        x = ctx.new_tensor(fg.float32, (4, 8), name="x")
        w = ctx.new_tensor(fg.float32, (3, 8), name="w")
        with ctx:
            y = fg.ops.relu(fg.ops.mul_mat(w, x))
        g = fg.Graph.build(y)
        buf = fg.alloc_ctx_tensors(ctx, cpu)
        x.set(np.ones((4, 8), np.float32)); w.set(np.ones((3, 8), np.float32))
        s = fg.Scheduler([nb, cpu])
        hammer(lambda: s.graph_compute(g), [lambda: s.plan, lambda: s.n_splits,
                                            lambda: s.get_buffer_size(nb)])
        s.graph_compute(g)
        np.testing.assert_array_equal(y.numpy(), np.full((4, 3), 8, np.float32))
        """
    )


def test_graph_plan_compute_while_another_thread_asks() -> None:
    run_scenario(
        """
        ctx = fg.Context(no_alloc=False)
        x = ctx.new_tensor(fg.float32, (64,))
        x.set(np.ones(64, np.float32))
        with ctx:
            y = fg.ops.custom(slow_copy, [fg.ops.relu(x)], fg.float32, (64,))
        plan = cpu.graph_plan_create(fg.Graph.build(y))
        hammer(plan.compute, [lambda: plan.work_size, lambda: repr(plan)])
        """
    )


def test_trace_logging_during_scheduler_work_from_two_threads() -> None:
    run_scenario(
        """
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
                s.n_splits  # a handler may use the scheduler: never a deadlock
        logger = logging.getLogger("ferrograph")
        logger.addHandler(Keep())
        logger.setLevel(1)
        fg.set_log_level("trace")
        ctx, buf, x, y, g = chain(n_ops=3)
        s = fg.Scheduler([cpu])
        def work():
            s.reset()
            s.reserve(g)
            s.graph_compute(g)
        hammer(work, [lambda: s.plan, lambda: s.n_splits])
        fg._core._testing.log("ferrograph.test", "info", "marker")
        assert "marker" in records
        """
    )


def test_abort_callback_touching_a_busy_scheduler() -> None:
    run_scenario(
        """
        ctx, buf, x, y, g = chain(n_ops=2, custom=False)
        s = fg.Scheduler([cpu])
        cpu.set_abort_callback(lambda: s.n_splits < 0)
        try:
            s.graph_compute(g)
        except fg.BusyError:
            pass
        cpu.set_abort_callback(None)
        s.graph_compute(g)
        """
    )
