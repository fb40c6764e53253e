"""Adversarial use of the Python API: every case runs in a child process with a timeout and is
classified as ``ok`` (the documented outcome), ``signal`` (the process died: segfault, abort),
``panic`` (a Rust panic reached Python), ``hang`` (no answer within the timeout) or ``wrong``
(another exception, or none, or a wrong result).

Cases run in batches: one child runs many cases in turn and reports each before starting the
next, so a crash or hang costs only that case (the parent restarts a child for the rest).

``python tests/python/test_adversarial.py`` prints the table of outcomes per category.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import pytest

# Seconds a single case may take before it counts as a hang.
CASE_TIMEOUT = 10.0


@dataclass(frozen=True)
class Case:
    """One adversarial call: `code` runs in a child with the prelude's names; `expect` is the
    exception class name it must raise (a ferrograph class, or a builtin), "ok" when it must
    return normally, or a tuple of acceptable names."""

    name: str
    category: str
    code: str
    expect: str | tuple[str, ...]


# Rust names that must not appear in a TypeError's message.
RUST_NAMES = (
    "BuftsArg",
    "ShapeArg",
    "Outputs",
    "BuftArg",
    "DeviceTypeArg",
    "PyRef",
    "enum",
    "'One",
    "Many",
    "PyBackend",
    "PyTensor",
)

PRELUDE = """
import gc, logging, threading, time
import numpy as np
import ferrograph as fg

cpu = fg.init_backend("CPU", n_threads=1)


def tensor(shape=(4, 4), dtype=fg.float32, name="t"):
    ctx = fg.Context()
    t = ctx.new_tensor(dtype, shape, name=name)
    buf = fg.alloc_ctx_tensors(ctx, cpu)
    return ctx, t, buf


def sched_graph(n=8, custom=None):
    # x has its own buffer; the ops' results live in the scheduler's compute memory.
    ctx = fg.Context()
    x = ctx.new_tensor(fg.float32, (n,), name="x")
    wbuf = fg.alloc_ctx_tensors(ctx, cpu)
    ops_ctx = fg.Context()
    with ops_ctx:
        y = fg.ops.relu(fg.ops.scale(x, 2.0))
        if custom is not None:
            y = fg.ops.custom(custom, [y], fg.float32, (n,), name="pyop")
        y = fg.ops.add(y, y)
    g = fg.Graph.build(y)
    ctx = (ctx, ops_ctx)
    s = fg.Scheduler([cpu])
    s.alloc_graph(g)
    x.set(np.arange(n, dtype=np.float32) - 3)
    return s, g, x, y, (ctx, wbuf)


def in_thread(fn, timeout=5.0):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def quant(dtype=fg.q8_0, shape=(4, 64)):
    ctx = fg.Context()
    q = ctx.new_tensor(dtype, shape, name="q")
    return ctx, q


class MemBuf:
    # Buffer memory of the Python backends below: a bytearray behind read/write/fill.
    def __init__(self, size):
        self.data = bytearray(size)

    def read(self, offset, size):
        return bytes(self.data[offset:offset + size])

    def write(self, offset, data):
        self.data[offset:offset + len(data)] = data

    def fill(self, offset, size, value):
        self.data[offset:offset + size] = bytes([value]) * size


class Plugin:
    # A minimal Python backend whose pieces can be replaced per case.
    def __init__(self, name, compute_result=True, init_result="backend", alloc_error=None):
        self.name = name
        self.compute_result = compute_result
        self.init_result = init_result
        self.alloc_error = alloc_error

    def devices(self):
        outer = self

        class Buft:
            name = outer.name + "_BUF"
            alignment = 32

            def alloc_buffer(self, size):
                if outer.alloc_error is not None:
                    raise outer.alloc_error
                return MemBuf(size)

        class Backend:
            name = outer.name

            def graph_compute(self, graph):
                return outer.compute_result

        class Device:
            name = outer.name
            buffer_type = Buft()

            def supports_op(self, t):
                return True

            def init_backend(self, params):
                return Backend() if outer.init_result == "backend" else outer.init_result

        return [Device()]

def original(fn):
    # Runs fn; a ferrograph error that carries a Python exception re-raises that exception, so
    # a case expecting the original class passes when it arrived directly or as __cause__.
    try:
        fn()
    except fg.Error as e:
        if e.__cause__ is not None:
            raise e.__cause__ from None
        raise


def names(fn, *words):
    # Runs fn; the ferrograph error it raises must mention every word.
    try:
        fn()
    except fg.Error as e:
        missing = [w for w in words if w not in str(e)]
        if missing:
            raise AssertionError(f"{missing} not in {e}") from None
        raise


def plugin(name, device=None, buft=None, backend=None, buf=None, reg=None):
    # A Python backend whose attributes can be replaced per object (plain functions, no self).
    class Buft:
        alignment = 32

        def __init__(self):
            self.name = name + "_BUF"

        def alloc_buffer(self, size):
            b = MemBuf(size)
            for k, v in (buf or {}).items():
                setattr(b, k, v)
            return b

    class Backend:
        def __init__(self):
            self.name = name

        def graph_compute(self, graph):
            return True

    class Device:
        def __init__(self):
            self.name = name
            self.buffer_type = Buft()
            for k, v in (buft or {}).items():
                setattr(self.buffer_type, k, v)

        def supports_op(self, t):
            return True

        def init_backend(self, params):
            b = Backend()
            for k, v in (backend or {}).items():
                setattr(b, k, v)
            return b

    class Reg:
        def __init__(self):
            self.name = name
            self.dev = Device()
            for k, v in (device or {}).items():
                setattr(self.dev, k, v)

        def devices(self):
            return [self.dev]

    r = Reg()
    for k, v in (reg or {}).items():
        setattr(r, k, v)
    return r


def registered(name, **parts):
    fg.register_backend(plugin(name, **parts))
    return [d for d in fg.devices() if d.name == name][0]


def boom(exc=ZeroDivisionError("boom")):
    def raiser(*args):
        raise exc

    return raiser
"""


def _cases() -> list[Case]:
    cases: list[Case] = []

    def add(category: str, name: str, code: str, expect: str | tuple[str, ...]) -> None:
        cases.append(Case(f"{category}/{name}", category, textwrap.dedent(code).strip(), expect))

    # ---- 1. sizes, offsets and counts -----------------------------------------------------
    s = "sizes"
    oob = "OutOfBoundsError"
    add(s, "buffer_read_2e62", "cpu.alloc_buffer(64).read(0, 2**62)", oob)
    add(s, "buffer_read_2e63", "cpu.alloc_buffer(64).read(0, 2**63)", oob)
    add(s, "buffer_read_max", "cpu.alloc_buffer(64).read(1, 2**64 - 1)", oob)
    add(s, "buffer_read_offset_huge", "cpu.alloc_buffer(64).read(2**63, 1)", oob)
    add(s, "buffer_read_past_end", "cpu.alloc_buffer(64).read(60, 8)", oob)
    add(s, "buffer_write_offset_huge", "cpu.alloc_buffer(64).write(2**64 - 2, b'abc')", oob)
    add(s, "tensor_get_2e40", "_, t, b = tensor(); fg.tensor_get(t, 0, 2**40)", oob)
    add(s, "tensor_get_2e63", "_, t, b = tensor(); fg.tensor_get(t, 0, 2**63)", oob)
    add(s, "tensor_get_offset", "_, t, b = tensor(); fg.tensor_get(t, 2**62)", oob)
    add(s, "get_tensor_async_2e62", "_, t, b = tensor(); cpu.get_tensor_async(t, 0, 2**62)", oob)
    add(
        s, "get_tensor_async_2e63", "_, t, b = tensor(); cpu.get_tensor_async(t, 2, 2**64 - 1)", oob
    )
    add(s, "tensor_memset_huge", "_, t, b = tensor(); fg.tensor_memset(t, 1, 0, 2**62)", oob)
    add(s, "tensor_memset_offset", "_, t, b = tensor(); fg.tensor_memset(t, 1, 2**64 - 1)", oob)
    add(s, "tensor_set_offset", "_, t, b = tensor(); fg.tensor_set(t, b'abcd', 2**64 - 2)", oob)
    add(
        s,
        "set_tensor_async_offset",
        "_, t, b = tensor(); cpu.set_tensor_async(t, b'abcd', 2**64 - 2)",
        oob,
    )
    add(s, "n_copies_2e40", "s = fg.Scheduler([cpu]); s.n_copies = 2**40", "InvalidArgumentError")
    add(s, "n_copies_0", "s = fg.Scheduler([cpu]); s.n_copies = 0", "InvalidArgumentError")
    add(
        s,
        "graph_size_huge",
        "fg.Scheduler([cpu], graph_size=2**62)",
        ("ok", "InvalidArgumentError"),
    )
    add(s, "alloc_buffer_2e62", "cpu.alloc_buffer(2**62)", "AllocationError")
    add(s, "buft_alloc_2e64", "fg.cpu_buffer_type().alloc_buffer(2**64 - 1)", "AllocationError")
    add(s, "threadpool_2e40", "fg.Threadpool(2**40)", "InvalidArgumentError")
    add(s, "n_threads_2e40", "fg.init_backend('CPU', n_threads=2**40)", "InvalidArgumentError")
    add(s, "set_n_threads_2e40", "cpu.n_threads = 2**40", "InvalidArgumentError")
    add(
        s,
        "graph_compute_with_ctx_threads",
        """
        ctx = fg.Context(no_alloc=False)
        x = ctx.new_tensor(fg.float32, (4,))
        fg.graph_compute_with_ctx(fg.Graph.build(fg.ops.relu(x, ctx=ctx)), 2**40)
        """,
        "InvalidArgumentError",
    )
    add(
        s,
        "new_tensor_overflow",
        "fg.Context().new_tensor(fg.float32, (2**40, 2**40))",
        ("ShapeError", "InvalidArgumentError"),
    )
    add(
        s,
        "host_ctx_huge",
        "fg.Context(no_alloc=False).new_tensor(fg.float32, (2**61,))",
        ("AllocationError", "ShapeError"),
    )
    add(
        s, "dequantize_n_huge", "fg.dequantize(np.zeros(34, np.uint8), 'q8_0', 2**62)", "ShapeError"
    )
    add(
        s,
        "dtype_row_size_huge",
        "fg._core.dtype_row_size('f32', 2**63)",
        ("ShapeError", "InvalidArgumentError"),
    )
    add(
        s,
        "view_past_end",
        "_, t, b = tensor(); fg.ops.view(t, (2**40,), ctx=fg.Context())",
        "ShapeError",
    )
    add(
        s,
        "view_offset_overflow",
        "_, t, b = tensor(); fg.ops.view(t, (4,), offset=2**64 - 4, ctx=fg.Context())",
        "ShapeError",
    )
    add(
        s,
        "reserve_n_bad_id",
        """
        ctx = fg.Context()
        x = ctx.new_tensor(fg.float32, (4,))
        g = fg.Graph.build(fg.ops.relu(x, ctx=ctx))
        fg.GraphAllocator(cpu).reserve_n(g, [2**40], [0])
        """,
        ("InvalidArgumentError", "OutOfBoundsError"),
    )
    add(s, "graph_view_range", "fg.Graph.build(tensor()[1]).view(0, 2**62)", oob)
    add(s, "dev_get_huge", "fg.dev_get(2**63)", oob)
    add(
        s,
        "cpu_vec_dot_n",
        "fg._core.cpu_vec_dot('f32', 2**62, b'\\0' * 8, b'\\0' * 8)",
        ("ShapeError", "InvalidArgumentError"),
    )
    add(
        s,
        "tensor_allocator_offset",
        "_, t, b = tensor(); u = fg.Context().new_tensor(fg.float32, (4,))"
        "; fg.tensor_alloc(u, b, 2**64 - 8)",
        ("OutOfBoundsError", "AllocationError"),
    )

    add(
        s,
        "zero_stride_quant_view_numpy",
        """
        ctx = fg.Context(no_alloc=False)
        q = ctx.new_tensor(fg.q8_0, (2, 64))
        q.set(np.ones((2, 64), np.float32))
        fg.ops.view(q, (2**33, 64), strides=(0, 34), ctx=ctx).numpy()
        """,
        "AllocationError",
    )
    add(
        s,
        "zero_stride_f32_view_numpy",
        """
        ctx = fg.Context(no_alloc=False)
        t = ctx.new_tensor(fg.float32, (4,))
        fg.ops.view(t, (2**40, 4), strides=(0, 4), ctx=ctx).numpy()
        """,
        "AllocationError",
    )
    add(
        s,
        "reserve_n_size_short_ids",
        """
        ctx = fg.Context(); x = ctx.new_tensor(fg.float32, (4,))
        g = fg.Graph.build(fg.ops.relu(fg.ops.relu(x, ctx=ctx), ctx=ctx))
        fg.GraphAllocator(cpu).reserve_n_size(g, [0], [])
        """,
        ("InvalidArgumentError", "ShapeError", "OutOfBoundsError"),
    )
    add(s, "graph_view_reversed", "fg.Graph.build(tensor()[1]).view(1, 0)", oob)
    add(
        s,
        "tensor_allocator_huge",
        "u = fg.Context().new_tensor(fg.float32, (2**40,))"
        "; fg.TensorAllocator(cpu.alloc_buffer(64)).alloc(u)",
        "AllocationError",
    )
    add(
        s,
        "dequantize_short_data",
        "fg.dequantize(np.zeros(10, np.uint8), 'q8_0', 32)",
        "ShapeError",
    )
    for label, index in [("past_end", "99"), ("negative", "-1")]:
        add(
            s,
            f"get_rows_index_{label}",
            f"""
            ctx = fg.Context(no_alloc=False)
            a = ctx.new_tensor(fg.float32, (4, 8)); i = ctx.new_tensor(fg.int32, (2,))
            i.set(np.array([1, {index}], np.int32))
            cpu.graph_compute(fg.Graph.build(fg.ops.get_rows(a, i, ctx=ctx)))
            """,
            oob,
        )
    add(
        s,
        "set_rows_index_huge",
        """
        ctx = fg.Context(no_alloc=False)
        a = ctx.new_tensor(fg.float32, (4, 8)); b = ctx.new_tensor(fg.float32, (2, 8))
        i = ctx.new_tensor(fg.int64, (2,)); i.set(np.array([1, 2**40], np.int64))
        cpu.graph_compute(fg.Graph.build(fg.ops.set_rows(a, b, i, ctx=ctx)))
        """,
        oob,
    )
    add(s, "threadpool_0", "fg.Threadpool(0)", "InvalidArgumentError")

    # ---- 2. arrays that are not plain data ---------------------------------------------------
    d = "dtypes"
    obj = "np.array([object()] * 64, dtype=object)"
    # An aligned slice of a larger array, so only the dtype can be the reason to refuse it.
    aligned = "a = {}; o = a[(-a.ctypes.data % 64) // a.itemsize:][:8]"
    add(
        d,
        "buffer_from_object_array",
        aligned.format("np.array([object()] * 64, dtype=object)")
        + "; fg.cpu_buffer_from_array(o); o[:] = 0",
        "DTypeError",
    )
    add(
        d,
        "buffer_from_object_then_write",
        aligned.format("np.array([object()] * 64, dtype=object)")
        + "; b = fg.cpu_buffer_from_array(o); b.write(0, b'\\xff' * 64); del o, a; gc.collect()",
        "DTypeError",
    )
    add(
        d,
        "buffer_from_structured_object",
        aligned.format("np.zeros(64, dtype=[('a', 'f8'), ('b', 'O')])")
        + "; fg.cpu_buffer_from_array(o)",
        "DTypeError",
    )
    add(
        d,
        "buffer_from_nested_object",
        aligned.format("np.zeros(64, dtype=[('a', 'f8'), ('b', [('c', 'O')])])")
        + "; fg.cpu_buffer_from_array(o)",
        "DTypeError",
    )
    add(d, "tensor_set_object", f"_, t, b = tensor((64,)); fg.tensor_set(t, {obj})", "DTypeError")
    add(
        d,
        "set_tensor_async_object",
        f"_, t, b = tensor((64,)); cpu.set_tensor_async(t, {obj})",
        "DTypeError",
    )
    add(d, "tensor_set_method_object", f"_, t, b = tensor((64,)); t.set({obj})", "DTypeError")
    add(
        d,
        "quant_set_object",
        "q = fg.Context(no_alloc=False).new_tensor(fg.q8_0, (32,))"
        "; q.set(np.array([object()] * 32))",
        "DTypeError",
    )
    add(d, "quantize_object", "fg.quantize(np.array([object()] * 32), 'q8_0')", "DTypeError")
    add(d, "fp32_to_fp16_object", "fg.fp32_to_fp16(np.array([object()] * 8))", "DTypeError")
    add(
        d, "dequantize_object", "fg.dequantize(np.array([object()] * 34), 'q8_0', 32)", "DTypeError"
    )
    add(
        d,
        "cpu_from_float_object",
        "fg._core.cpu_from_float('f16', np.array([object()] * 8))",
        "DTypeError",
    )
    add(
        d,
        "tensor_set_structured",
        "_, t, b = tensor((4,)); fg.tensor_set(t, np.zeros(2, dtype=[('a', 'f4'), ('b', 'f4')]))",
        "ok",
    )
    add(
        d,
        "buffer_from_datetime_ok",
        "fg.cpu_buffer_from_array(fg.aligned_empty((8,), np.float32))",
        "ok",
    )
    add(
        d,
        "buffer_write_object_bytes",
        f"cpu.alloc_buffer(64).write(0, {obj})",
        ("TypeError", "DTypeError"),
    )

    add(
        d,
        "buffer_write_object_array",
        aligned.format("np.array([object()] * 64, dtype=object)")
        + "; cpu.alloc_buffer(512).write(0, o)",
        "DTypeError",
    )
    add(d, "tensor_set_str", "_, t, b = tensor((4,)); fg.tensor_set(t, 'abcd')", "TypeError")
    add(d, "tensor_set_int", "_, t, b = tensor((4,)); fg.tensor_set(t, 16)", "TypeError")
    add(
        d,
        "buffer_write_memoryview",
        "b = cpu.alloc_buffer(16); b.write(4, memoryview(b'abcd')); assert b.read(4, 4) == b'abcd'",
        "ok",
    )
    add(
        d,
        "tensor_set_bytearray",
        "_, t, b = tensor((1,)); fg.tensor_set(t, bytearray(np.float32(2).tobytes()))"
        "; assert t.numpy()[0] == 2",
        "ok",
    )

    # ---- 3. locks and the interpreter -----------------------------------------------------------
    k = "locks"
    busy = ("BusyError",)
    add(
        k,
        "eval_callback_reads_n_splits",
        """
        s, g, x, y, keep = sched_graph()
        s.set_eval_callback(lambda t, ask: s.n_splits or True)
        s.graph_compute(g)
        """,
        busy,
    )
    add(
        k,
        "eval_callback_reads_plan",
        """
        s, g, x, y, keep = sched_graph()
        s.set_eval_callback(lambda t, ask: s.plan is not None)
        s.graph_compute(g)
        """,
        busy,
    )
    add(
        k,
        "eval_callback_resets",
        """
        s, g, x, y, keep = sched_graph()
        def cb(t, ask):
            s.reset()
            return True
        s.set_eval_callback(cb)
        s.graph_compute(g)
        """,
        busy,
    )
    add(
        k,
        "eval_callback_computes_again",
        """
        s, g, x, y, keep = sched_graph()
        s.set_eval_callback(lambda t, ask: s.graph_compute(g) or True)
        s.graph_compute(g)
        """,
        busy,
    )
    add(
        k,
        "custom_op_thread_plan",
        """
        slow = lambda o, a: (time.sleep(0.3), o.__setitem__(Ellipsis, a))
        s, g, x, y, keep = sched_graph(custom=slow)
        th, box = in_thread(lambda: s.graph_compute(g))
        time.sleep(0.1)
        for _ in range(20):
            s.plan; s.n_splits; s.n_copies
        th.join(5)
        assert not th.is_alive(), "compute did not finish"
        if "error" in box: raise box["error"]
        """,
        "ok",
    )
    add(
        k,
        "custom_op_reads_scheduler",
        """
        s, g, x, y, keep = sched_graph(custom=lambda o, a: (s.n_splits, o.__setitem__(Ellipsis, a)))
        s.graph_compute(g)
        """,
        ("BusyError", "BackendError"),
    )
    add(
        k,
        "trace_logging_thread_plan",
        """
        logging.basicConfig(level=1, handlers=[logging.NullHandler()])
        logging.getLogger("ferrograph").setLevel(1)
        fg.set_log_level("trace")
        slow = lambda o, a: (time.sleep(0.2), o.__setitem__(Ellipsis, a))
        s, g, x, y, keep = sched_graph(custom=slow)
        th, box = in_thread(lambda: [s.graph_compute(g) for _ in range(3)])
        for _ in range(200):
            s.plan; s.n_splits
        th.join(8)
        assert not th.is_alive(), "compute did not finish"
        if "error" in box: raise box["error"]
        """,
        "ok",
    )
    add(
        k,
        "log_handler_uses_scheduler",
        """
        s, g, x, y, keep = sched_graph()
        class H(logging.Handler):
            def emit(self, record):
                s.n_splits; s.plan
        logging.getLogger("ferrograph").addHandler(H())
        logging.getLogger("ferrograph").setLevel(1)
        fg.set_log_level("trace")
        s.reset(); s.reserve(g); s.alloc_graph(g); s.graph_compute(g)
        """,
        "ok",
    )
    add(
        k,
        "graph_allocator_thread",
        """
        ctx = fg.Context()
        x = ctx.new_tensor(fg.float32, (64,))
        with ctx:
            y = x
            for _ in range(50):
                copy = lambda o, a: o.__setitem__(Ellipsis, a)
                y = fg.ops.custom(copy, [fg.ops.relu(y)], fg.float32, (64,))
        g = fg.Graph.build(y)
        ga = fg.GraphAllocator(cpu)
        stop = []
        th, box = in_thread(lambda: [ga.reserve(g) or ga.alloc_graph(g) for _ in range(30)])
        while th.is_alive():
            ga.buffer_size(0); ga.plan
        th.join(5)
        if "error" in box: raise box["error"]
        """,
        "ok",
    )
    add(
        k,
        "python_buffer_type_reserve_thread",
        """
        fg.register_backend(Plugin("PYLOCK"))
        be = fg.init_backend("PYLOCK")
        ctx = fg.Context()
        x = ctx.new_tensor(fg.float32, (64,))
        with ctx:
            y = fg.ops.relu(fg.ops.relu(x))
        g = fg.Graph.build(y)
        ga = fg.GraphAllocator(be)
        th, box = in_thread(lambda: [ga.reserve(g) for _ in range(200)])
        while th.is_alive():
            ga.buffer_size(0); ga.plan
        th.join(5)
        if "error" in box: raise box["error"]
        """,
        "ok",
    )
    add(
        k,
        "python_backend_scheduler_thread",
        """
        from ferrograph.plugins import NumpyRegistration
        fg.register_backend(NumpyRegistration("NPLOCK"))
        nb = fg.init_backend("NPLOCK")
        ctx = fg.Context()
        x = ctx.new_tensor(fg.float32, (4, 8), name="x")
        w = ctx.new_tensor(fg.float32, (3, 8), name="w")
        with ctx:
            y = fg.ops.relu(fg.ops.mul_mat(w, x))
        g = fg.Graph.build(y)
        buf = fg.alloc_ctx_tensors(ctx, cpu)
        x.set(np.ones((4, 8), np.float32)); w.set(np.ones((3, 8), np.float32))
        s = fg.Scheduler([nb, cpu])
        th, box = in_thread(lambda: [s.graph_compute(g) for _ in range(20)])
        while th.is_alive():
            s.n_splits; s.plan; s.get_buffer_size(cpu)
        th.join(5)
        if "error" in box: raise box["error"]
        assert np.allclose(y.numpy(), 8.0)
        """,
        "ok",
    )
    add(
        k,
        "abort_callback_uses_backend",
        """
        s, g, x, y, keep = sched_graph()
        cpu.set_abort_callback(lambda: s.n_splits and False)
        try:
            s.graph_compute(g)
        finally:
            cpu.set_abort_callback(None)
        """,
        ("BusyError", "AbortedError"),
    )
    add(
        k,
        "two_threads_compute_same_scheduler",
        """
        s, g, x, y, keep = sched_graph(custom=lambda o, a: o.__setitem__(Ellipsis, a))
        ths = [in_thread(lambda: [s.graph_compute(g) for _ in range(20)]) for _ in range(2)]
        for th, box in ths:
            th.join(8)
            assert not th.is_alive()
            if "error" in box: raise box["error"]
        """,
        "ok",
    )

    add(
        k,
        "plugin_buffer_type_uses_its_allocator",
        """
        ga = None
        class P(Plugin):
            def devices(self):
                d = super().devices()
                orig = d[0].buffer_type.alloc_buffer
                def alloc(size):
                    ga.buffer_size(0)
                    return orig(size)
                d[0].buffer_type.alloc_buffer = alloc
                return d
        fg.register_backend(P("PYGA"))
        be = fg.init_backend("PYGA")
        ctx = fg.Context(); x = ctx.new_tensor(fg.float32, (64,))
        g = fg.Graph.build(fg.ops.relu(fg.ops.relu(x, ctx=ctx), ctx=ctx))
        ga = fg.GraphAllocator(be)
        try:
            ga.reserve(g)
        except fg.Error as e:
            assert "busy" in str(e).lower(), e
            raise
        """,
        ("BusyError", "BackendError"),
    )
    add(
        k,
        "log_handler_raises",
        """
        class H(logging.Handler):
            def emit(self, record):
                raise KeyError("handler")
        logging.getLogger("ferrograph").addHandler(H())
        logging.getLogger("ferrograph").setLevel(1)
        logging.raiseExceptions = False
        fg._core._testing.log("ferrograph.x", "info", "m")
        """,
        "ok",
    )
    add(
        k,
        "graph_plan_custom_op_uses_plan",
        """
        ctx = fg.Context(no_alloc=False); x = ctx.new_tensor(fg.float32, (4,))
        plan = None
        def peek(o, a):
            plan.work_size
            o[...] = a
        y = fg.ops.custom(peek, [x], fg.float32, (4,), ctx=ctx)
        plan = cpu.graph_plan_create(fg.Graph.build(y))
        try:
            plan.compute()
        except fg.Error as e:
            assert "busy" in str(e).lower(), e
            raise
        """,
        ("BusyError", "BackendError"),
    )

    # ---- 4. exceptions in callbacks and plugin results ----------------------------------------
    c = "callbacks"
    add(
        c,
        "eval_callback_raises",
        """
        s, g, x, y, keep = sched_graph()
        def cb(t, ask):
            raise KeyError("from the callback")
        s.set_eval_callback(cb)
        try:
            s.graph_compute(g)
        except KeyError as e:
            assert "from the callback" in str(e)
        except fg.AbortedError as e:
            assert isinstance(e.__cause__, KeyError), repr(e.__cause__)
        else:
            raise AssertionError("no exception")
        """,
        "ok",
    )
    add(
        c,
        "abort_callback_raises",
        """
        s, g, x, y, keep = sched_graph()
        def cb():
            raise KeyError("from abort")
        cpu.set_abort_callback(cb)
        try:
            s.graph_compute(g)
        except KeyError:
            pass
        except fg.AbortedError as e:
            assert isinstance(e.__cause__, KeyError), repr(e.__cause__)
        else:
            raise AssertionError("no exception")
        """,
        "ok",
    )
    add(
        c,
        "global_abort_callback_raises",
        """
        ctx = fg.Context(no_alloc=False)
        x = ctx.new_tensor(fg.float32, (4,))
        def cb():
            raise KeyError("global")
        fg.set_global_abort_callback(cb)
        try:
            cpu.graph_compute(fg.Graph.build(fg.ops.relu(x, ctx=ctx)))
        except KeyError:
            pass
        except fg.AbortedError as e:
            assert isinstance(e.__cause__, KeyError), repr(e.__cause__)
        else:
            raise AssertionError("no exception")
        finally:
            fg.set_global_abort_callback(None)
        """,
        "ok",
    )
    add(
        c,
        "eval_callback_not_callable",
        "fg.Scheduler([cpu]).set_eval_callback(5)",
        ("TypeError", "InvalidArgumentError"),
    )
    add(
        c,
        "abort_callback_not_callable",
        "cpu.set_abort_callback(5)",
        ("TypeError", "InvalidArgumentError"),
    )
    add(
        c,
        "global_abort_not_callable",
        "fg.set_global_abort_callback('x')",
        ("TypeError", "InvalidArgumentError"),
    )
    add(
        c,
        "compare_callback_not_callable",
        """
        ctx = fg.Context(no_alloc=False); x = ctx.new_tensor(fg.float32, (4,))
        fg.compare_graph_backend(cpu, cpu, fg.Graph.build(fg.ops.relu(x, ctx=ctx)), 3)
        """,
        ("TypeError", "InvalidArgumentError"),
    )
    add(
        c,
        "eval_callback_returns_junk",
        """
        s, g, x, y, keep = sched_graph()
        class Bad:
            def __bool__(self):
                raise ValueError("no truth")
        s.set_eval_callback(lambda t, ask: Bad())
        s.graph_compute(g)
        """,
        ("ValueError", "AbortedError"),
    )
    for label, value in [
        ("zero", "0"),
        ("junk", "'junk'"),
        ("none_ok", "None"),
        ("false", "False"),
    ]:
        expect = {"none_ok": "ok", "false": "AbortedError"}.get(
            label, ("BackendError", "TypeError")
        )
        add(
            c,
            f"plugin_graph_compute_returns_{label}",
            f"""
            fg.register_backend(Plugin("PYRET", compute_result={value}))
            be = fg.init_backend("PYRET")
            ctx = fg.Context(); x = ctx.new_tensor(fg.float32, (4,))
            y = fg.ops.relu(x, ctx=ctx); buf = fg.alloc_ctx_tensors(ctx, be)
            be.graph_compute(fg.Graph.build(y))
            """,
            expect,
        )
    add(
        c,
        "plugin_init_backend_none",
        """
        fg.register_backend(Plugin("PYNONE", init_result=None))
        fg.init_backend("PYNONE")
        """,
        "BackendError",
    )
    add(
        c,
        "plugin_init_backend_int",
        """
        fg.register_backend(Plugin("PYINT", init_result=5))
        fg.init_backend("PYINT")
        """,
        "BackendError",
    )
    add(
        c,
        "plugin_alloc_buffer_returns_none",
        """
        class P(Plugin):
            def devices(self):
                d = super().devices()
                d[0].buffer_type.alloc_buffer = lambda size: None
                return d
        fg.register_backend(P("PYNONEBUF"))
        try:
            fg.init_backend("PYNONEBUF").alloc_buffer(64)
        except fg.BackendError as e:
            assert "alloc_buffer" in str(e), e
            raise
        """,
        "BackendError",
    )
    add(
        c,
        "plugin_read_returns_short",
        """
        fg.register_backend(Plugin("PYSHORT"))
        be = fg.init_backend("PYSHORT")
        b = be.alloc_buffer(64)
        b.read(0, 8)
        """,
        "ok",
    )
    add(
        c,
        "plugin_alloc_memoryerror",
        """
        fg.register_backend(Plugin("PYMEM", alloc_error=MemoryError("out of numpy memory")))
        fg.init_backend("PYMEM").alloc_buffer(64)
        """,
        "AllocationError",
    )
    add(
        c,
        "custom_op_raises_in_scheduler",
        """
        def boom(o, a):
            raise KeyError("custom boom")
        s, g, x, y, keep = sched_graph(custom=boom)
        s.graph_compute(g)
        """,
        ("BackendError", "KeyError"),
    )
    add(
        c,
        "compare_callback_raises",
        """
        ctx = fg.Context(no_alloc=False); x = ctx.new_tensor(fg.float32, (4,))
        x.set(np.ones(4, np.float32))
        def cb(i, a, b):
            raise KeyError("compare")
        fg.compare_graph_backend(cpu, cpu, fg.Graph.build(fg.ops.relu(x, ctx=ctx)), cb)
        """,
        "KeyError",
    )

    # ---- 5. views of block-quantized tensors and misaligned views -----------------------------
    v = "views"
    for qt in ("q8_0", "q4_0"):
        add(
            v, f"transpose_{qt}", f"c, q = quant(fg.{qt}); fg.ops.transpose(q, ctx=c)", "ShapeError"
        )
        add(
            v,
            f"permute_{qt}",
            f"c, q = quant(fg.{qt}, (2, 3, 64)); fg.ops.permute(q, (0, 1, 2), ctx=c)",
            "ok",
        )
        add(
            v,
            f"permute_rows_{qt}",
            f"c, q = quant(fg.{qt}, (2, 3, 64)); fg.ops.permute(q, (2, 1, 0), ctx=c)",
            "ShapeError",
        )
        add(
            v,
            f"view_offset1_{qt}",
            f"c, q = quant(fg.{qt}); fg.ops.view(q, (32,), offset=1, ctx=c)",
            "ShapeError",
        )
        add(
            v,
            f"view_partial_block_{qt}",
            f"c, q = quant(fg.{qt}); fg.ops.view(q, (16,), ctx=c)",
            "ShapeError",
        )
        add(v, f"view_rows_ok_{qt}", f"c, q = quant(fg.{qt}); fg.ops.view(q, (2, 64), ctx=c)", "ok")
        add(
            v,
            f"view_strided_{qt}",
            f"c, q = quant(fg.{qt}); fg.ops.view(q, (2, 64), strides=(5, 1), ctx=c)",
            "ShapeError",
        )
        add(v, f"reshape_{qt}", f"c, q = quant(fg.{qt}); fg.ops.reshape(q, (8, 32), ctx=c)", "ok")
        add(
            v,
            f"reshape_cut_{qt}",
            f"c, q = quant(fg.{qt}); fg.ops.reshape(q, (16, 16), ctx=c)",
            "ShapeError",
        )
    add(
        v,
        "permuted_q8_values",
        """
        ctx = fg.Context(no_alloc=False)
        q = ctx.new_tensor(fg.q8_0, (2, 3, 64))
        q.set(np.random.default_rng(0).standard_normal((2, 3, 64)).astype(np.float32))
        ref = q.numpy().transpose(1, 0, 2)
        p = fg.ops.permute(q, (1, 0, 2), ctx=ctx)
        np.testing.assert_array_equal(p.numpy(), ref)
        c = fg.ops.cont(p, ctx=ctx)
        out = ctx.new_tensor(fg.float32, (3, 2, 64))
        fg.graph_compute_with_ctx(fg.Graph.build([c, fg.ops.cpy(p, out, ctx=ctx)]))
        np.testing.assert_array_equal(c.numpy(), ref)
        np.testing.assert_array_equal(out.numpy(), ref)
        """,
        "ok",
    )
    add(
        v,
        "transpose_q8_numpy",
        """
        ctx = fg.Context(no_alloc=False)
        q = ctx.new_tensor(fg.q8_0, (32, 32))
        q.set(np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32))
        t = fg.ops.transpose(q, ctx=ctx)
        t.numpy()
        """,
        "ShapeError",
    )
    add(
        v,
        "view_f32_offset2",
        "_, t, b = tensor(); fg.ops.view(t, (2,), offset=2, ctx=fg.Context())",
        "ShapeError",
    )
    add(
        v,
        "view_f16_offset1",
        "_, t, b = tensor(dtype=fg.float16); fg.ops.view(t, (2,), offset=1, ctx=fg.Context())",
        "ShapeError",
    )
    add(
        v,
        "view_f32_offset4_ok",
        "_, t, b = tensor(); fg.ops.view(t, (2,), offset=4, ctx=fg.Context())",
        "ok",
    )
    add(
        v,
        "view_f32_stride_odd",
        "_, t, b = tensor(); fg.ops.view(t, (2, 2), strides=(6, 4), ctx=fg.Context())",
        "ShapeError",
    )
    add(
        v,
        "get_rows_from_transposed_q",
        """
        c, q = quant(fg.q8_0, (64, 64))
        i = c.new_tensor(fg.int32, (2,))
        fg.ops.get_rows(fg.ops.transpose(q, ctx=c), i, ctx=c)
        """,
        "ShapeError",
    )
    add(
        v,
        "cpy_misaligned_f32_view",
        """
        ctx = fg.Context(no_alloc=False)
        a = ctx.new_tensor(fg.float32, (16,))
        b = ctx.new_tensor(fg.float32, (3,))
        fg.ops.cpy(fg.ops.view(a, (3,), offset=3, ctx=ctx), b, ctx=ctx)
        """,
        "ShapeError",
    )

    # ---- 7. validation and messages ------------------------------------------------------------
    m = "validation"
    add(
        m,
        "graph_allocator_buffer_size_99",
        "fg.GraphAllocator(cpu).buffer_size(99)",
        ("OutOfBoundsError", "InvalidArgumentError"),
    )
    add(
        m,
        "graph_allocator_buffers_99",
        "fg.GraphAllocator(cpu).buffers(99)",
        ("OutOfBoundsError", "InvalidArgumentError"),
    )
    add(
        m,
        "init_backend_garbage_params",
        "fg.init_backend('CPU', params='garbage=,,=x')",
        "InvalidArgumentError",
    )
    add(
        m,
        "init_backend_unknown_param",
        "fg.init_backend('CPU', params='n_thread=2')",
        "InvalidArgumentError",
    )
    add(
        m,
        "init_backend_bad_threads",
        "fg.init_backend('CPU', params='n_threads=abc')",
        "InvalidArgumentError",
    )
    add(
        m,
        "init_backend_zero_threads",
        "fg.init_backend('CPU', params='n_threads=0')",
        "InvalidArgumentError",
    )
    for label, dev in [("empty", "''"), ("nul", "'A\\x00B'"), ("space", "'  '")]:
        add(
            m, f"device_name_{label}", f"fg.register_backend(Plugin({dev}))", "InvalidArgumentError"
        )
    add(
        m,
        "device_name_duplicate",
        """
        class Two(Plugin):
            def devices(self):
                return super().devices() * 2
        fg.register_backend(Two("PYDUP"))
        """,
        "InvalidArgumentError",
    )
    add(
        m,
        "device_name_clash_cpu",
        "fg.register_backend(Plugin('cpu'))",
        ("InvalidArgumentError", "BackendError"),
    )
    for label, call in [
        ("graph_allocator", "fg.GraphAllocator(5)"),
        ("new_tensor_shape", "fg.Context().new_tensor(fg.float32, 'abc')"),
        ("graph_build", "fg.Graph.build(5)"),
        ("scheduler_backends", "fg.Scheduler([5])"),
        ("reshape_shape", "fg.ops.reshape(tensor()[1], {'a': 1}, ctx=fg.Context())"),
        ("alloc_ctx_target", "fg.alloc_ctx_tensors(fg.Context(), 5)"),
        ("dev_by_type", "fg.dev_by_type(3.5)"),
    ]:
        add(
            m,
            f"type_message_{label}",
            f"""
            try:
                {call}
            except TypeError as e:
                text = str(e)
                for rust in RUST_NAMES:
                    assert rust not in text, text
                raise
            """,
            ("TypeError", "DTypeError", "ShapeError"),
        )
    add(
        m,
        "mul_mat_message",
        """
        c = fg.Context()
        a = c.new_tensor(fg.float32, (4, 32)); b = c.new_tensor(fg.int32, (2, 32))
        try:
            fg.ops.mul_mat(a, b, ctx=c)
        except fg.DTypeError as e:
            assert "f32 or f32" not in str(e), str(e)
            raise
        """,
        "DTypeError",
    )
    add(
        m,
        "mul_mat_zero_width",
        """
        c = fg.Context()
        a = c.new_tensor(fg.float32, (4, 0)); b = c.new_tensor(fg.float32, (2, 0))
        try:
            fg.ops.mul_mat(a, b, ctx=c)
        except fg.Error as e:
            assert "transposed" not in str(e), str(e)
            raise
        """,
        ("ok", "ShapeError"),
    )
    add(
        m,
        "tensor_set_strided",
        """
        _, t, b = tensor((4,))
        a = np.arange(8, dtype=np.float32)[::2]
        fg.tensor_set(t, a)
        assert (t.numpy() == a).all()
        """,
        "ok",
    )
    add(
        m,
        "set_tensor_async_strided",
        """
        _, t, b = tensor((4,))
        a = np.arange(8, dtype=np.float32)[::2]
        cpu.set_tensor_async(t, a); cpu.synchronize()
        assert (t.numpy() == a).all()
        """,
        "ok",
    )
    add(
        m,
        "argmax_empty_rows",
        """
        ctx = fg.Context(no_alloc=False)
        x = ctx.new_tensor(fg.float32, (3, 0))
        y = fg.ops.argmax(x, ctx=ctx)
        fg.graph_compute_with_ctx(fg.Graph.build(y))
        """,
        "ShapeError",
    )
    add(
        m,
        "offload_policy_negative",
        "fg.Scheduler([cpu]).offload_policy = -3",
        ("InvalidArgumentError", "OverflowError"),
    )
    add(m, "scheduler_no_backends", "fg.Scheduler([])", "InvalidArgumentError")
    add(
        m, "scheduler_duplicate_backend", "fg.Scheduler([cpu, cpu])", ("InvalidArgumentError", "ok")
    )
    add(m, "set_log_level_bad", "fg.set_log_level('loud')", "InvalidArgumentError")
    add(m, "status_to_string_unknown", "fg.status_to_string(7)", "ok")
    add(m, "status_to_string_huge", "fg.status_to_string(2**70)", ("ok", "OverflowError"))
    add(m, "get_backend_oob", "fg.Scheduler([cpu]).get_backend(3)", "OutOfBoundsError")
    add(m, "graph_index_oob", "fg.Graph.build(tensor()[1])[5]", ("OutOfBoundsError", "IndexError"))
    add(m, "dtype_unknown", "fg.Context().new_tensor('float128', (2,))", "DTypeError")

    # ---- misc: lifetimes and state ---------------------------------------------------------------
    x = "lifetimes"
    add(x, "read_after_free", "_, t, b = tensor(); b.free(); t.numpy()", "StaleTensorError")
    add(
        x,
        "buffer_read_after_free",
        "b = cpu.alloc_buffer(64); b.free(); b.read(0, 8)",
        ("StaleTensorError", "InvalidArgumentError"),
    )
    add(
        x,
        "set_after_reset",
        "_, t, b = tensor(); b.reset(); t.set(np.zeros((4, 4), np.float32))",
        "StaleTensorError",
    )
    add(
        x,
        "sched_compute_after_reset_reads",
        """
        s, g, x, y, keep = sched_graph()
        s.graph_compute(g); s.reset(); y.numpy()
        """,
        "StaleTensorError",
    )
    add(
        x,
        "unallocated_numpy",
        "fg.Context().new_tensor(fg.float32, (2,)).numpy()",
        "NotAllocatedError",
    )
    add(
        x,
        "graph_plan_after_free",
        """
        ctx = fg.Context(no_alloc=False); x = ctx.new_tensor(fg.float32, (4,))
        p = cpu.graph_plan_create(fg.Graph.build(fg.ops.relu(x, ctx=ctx))); p.free(); p.compute()
        """,
        "StaleTensorError",
    )
    add(
        x,
        "nan_inputs_ok",
        """
        _, t, b = tensor((4,))
        t.set(np.array([np.nan, np.inf, -np.inf, 0], np.float32))
        cpu.graph_compute(fg.Graph.build(fg.ops.soft_max(t, ctx=fg.Context())))
        """,
        ("ok", "NotAllocatedError"),
    )
    add(
        x,
        "buffer_from_readonly_array",
        "a = fg.aligned_empty((16,), np.float32); a.flags.writeable = False"
        "; fg.cpu_buffer_from_array(a)",
        "InvalidArgumentError",
    )

    # ---- exceptions from custom ops and Python plugins reach the caller ---------------------
    # (the original exception, directly or as the __cause__ of a documented fg.Error)
    r = "raised"
    custom_graph = textwrap.dedent(
        """
        ctx = fg.Context(no_alloc=False)
        x = ctx.new_tensor(fg.float32, (4,)); x.set(np.ones(4, np.float32))
        y = fg.ops.custom(boom({exc}), [x], fg.float32, (4,), name="bad", ctx=ctx)
        g = fg.Graph.build(fg.ops.relu(y, ctx=ctx))
        """
    )
    for label, exc, cls in [
        ("zero_division", "ZeroDivisionError('x')", "ZeroDivisionError"),
        ("key_error", "KeyError('k')", "KeyError"),
        ("own_class", "type('MyError', (Exception,), {})('mine')", "MyError"),
        ("value_error", "ValueError('v')", "ValueError"),
    ]:
        setup = custom_graph.format(exc=exc)
        add(r, f"custom_{label}_backend", setup + "original(lambda: cpu.graph_compute(g))", cls)
        add(
            r,
            f"custom_{label}_with_ctx",
            setup + "original(lambda: fg.graph_compute_with_ctx(g, 2))",
            cls,
        )
    add(
        r,
        "custom_in_scheduler",
        """
        s, g, x, y, keep = sched_graph(custom=boom(KeyError("sched")))
        original(lambda: s.graph_compute(g))
        """,
        "KeyError",
    )
    add(
        r,
        "custom_run_custom",
        custom_graph.format(exc="OSError('io')") + "original(lambda: fg.ops.run_custom(y))",
        "OSError",
    )
    add(
        r,
        "custom_cause_is_the_object",
        custom_graph.format(exc="LookupError('same')")
        + textwrap.dedent(
            """
            try:
                cpu.graph_compute(g)
            except fg.BackendError as e:
                assert isinstance(e.__cause__, LookupError), e.__cause__
                assert str(e.__cause__) == "same", e.__cause__
                assert "python exception #" not in str(e), str(e)
                raise
            """
        ),
        "BackendError",
    )
    plugin_raises = [
        (
            "alloc_buffer",
            "buft={'alloc_buffer': boom(KeyError('a'))}",
            "d.buffer_type.alloc_buffer(64)",
            "KeyError",
        ),
        (
            "alloc_buffer_memory",
            "buft={'alloc_buffer': boom(MemoryError('m'))}",
            "d.buffer_type.alloc_buffer(64)",
            "MemoryError",
        ),
        (
            "buffer_read",
            "buf={'read': boom(ValueError('r'))}",
            "d.buffer_type.alloc_buffer(64).read(0, 8)",
            "ValueError",
        ),
        (
            "buffer_write",
            "buf={'write': boom(ValueError('w'))}",
            "d.buffer_type.alloc_buffer(64).write(0, b'ab')",
            "ValueError",
        ),
        (
            "buffer_fill",
            "buf={'fill': boom(ValueError('f'))}",
            "d.buffer_type.alloc_buffer(64).clear(1)",
            "ValueError",
        ),
        (
            "init_backend",
            "device={'init_backend': boom(RuntimeError('i'))}",
            "fg.init_backend(NAME)",
            "RuntimeError",
        ),
        (
            "graph_compute",
            "backend={'graph_compute': boom(ArithmeticError('g'))}",
            "fg.init_backend(NAME).graph_compute(fg.Graph.build(tensor()[1]))",
            "ArithmeticError",
        ),
        (
            "synchronize",
            "backend={'synchronize': boom(EOFError('s'))}",
            "fg.init_backend(NAME).synchronize()",
            "EOFError",
        ),
        (
            "supports_op",
            "device={'supports_op': boom(KeyError('o'))}",
            "d.supports_op(tensor()[1])",
            "KeyError",
        ),
        ("memory", "device={'memory': boom(KeyError('m'))}", "d.memory", "KeyError"),
        (
            "get_alloc_size",
            "buft={'get_alloc_size': boom(KeyError('s'))}",
            "d.buffer_type.alloc_size(tensor()[1])",
            "KeyError",
        ),
        ("devices", "reg={'devices': boom(IndexError('d'))}", "pass", "IndexError"),
    ]
    for label, parts, call, cls in plugin_raises:
        add(
            r,
            f"plugin_{label}",
            f"""
            NAME = "PYR_{label}"
            def run():
                d = registered(NAME, {parts})
                {call}
            original(run)
            """,
            cls,
        )
    add(
        r,
        "plugin_memory_error_is_allocation_error",
        """
        d = registered("PYR_mem", buft={'alloc_buffer': boom(MemoryError('m'))})
        try:
            d.buffer_type.alloc_buffer(64)
        except fg.AllocationError as e:
            assert isinstance(e.__cause__, MemoryError), e.__cause__
            raise
        """,
        "AllocationError",
    )

    # ---- what Python plugins return is validated -------------------------------------------
    v = "plugin_returns"
    bad_returns = [
        (
            "supports_op_str",
            "device={'supports_op': lambda t: 'junk'}",
            "d.supports_op(tensor()[1])",
            ("supports_op", "junk"),
        ),
        (
            "supports_op_int",
            "device={'supports_op': lambda t: 1}",
            "d.supports_op(tensor()[1])",
            ("supports_op", "int"),
        ),
        (
            "supports_op_none",
            "device={'supports_op': lambda t: None}",
            "d.supports_op(tensor()[1])",
            ("supports_op", "None"),
        ),
        (
            "backend_supports_op",
            "device={'supports_op': lambda t: 'junk'}",
            "fg.init_backend(NAME).supports_op(tensor()[1])",
            ("supports_op", "junk"),
        ),
        ("memory_str", "device={'memory': lambda: 'junk'}", "d.memory", ("memory", "junk")),
        ("memory_short", "device={'memory': lambda: (1,)}", "d.memory", ("memory", "(1,)")),
        (
            "memory_free_gt_total",
            "device={'memory': lambda: (5, 2)}",
            "d.memory",
            ("memory", "(5, 2)"),
        ),
        ("memory_negative", "device={'memory': lambda: (-1, 10)}", "d.memory", ("memory", "-1")),
        ("memory_float", "device={'memory': lambda: (1.5, 2)}", "d.memory", ("memory", "1.5")),
        ("memory_bool", "device={'memory': lambda: (True, 2)}", "d.memory", ("memory", "True")),
        (
            "memory_huge",
            "device={'memory': lambda: (0, 2**70)}",
            "d.memory",
            ("memory", str(2**70)),
        ),
        ("alignment_str", "buft={'alignment': 'junk'}", "pass", ("alignment", "junk")),
        ("alignment_bool", "buft={'alignment': True}", "pass", ("alignment", "True")),
        ("alignment_negative", "buft={'alignment': -8}", "pass", ("alignment", "-8")),
        ("alignment_huge", "buft={'alignment': 2**70}", "pass", ("alignment", str(2**70))),
        ("alignment_not_pow2", "buft={'alignment': 24}", "pass", ("alignment", "24")),
        ("max_size_negative", "buft={'max_size': -1}", "pass", ("max_size", "-1")),
        ("max_size_str", "buft={'max_size': '10'}", "pass", ("max_size", "'10'")),
        ("max_size_zero", "buft={'max_size': 0}", "pass", ("max_size",)),
        ("buft_name_int", "buft={'name': 5}", "pass", ("name", "5")),
        ("buft_name_nul", "buft={'name': 'a\\x00b'}", "pass", ("name",)),
        ("device_description_int", "device={'description': 5}", "pass", ("description", "5")),
        ("device_type_int", "device={'type': 5}", "pass", ("type", "5")),
        (
            "accepts_host_buffers_str",
            "device={'accepts_host_buffers': 'yes'}",
            "pass",
            ("accepts_host_buffers", "yes"),
        ),
        ("backend_name_int", "backend={'name': 7}", "fg.init_backend(NAME)", ("name", "7")),
        ("backend_name_nul", "backend={'name': 'x\\x00'}", "fg.init_backend(NAME)", ("name",)),
        (
            "read_str",
            "buf={'read': lambda o, n: 'x' * n}",
            "d.buffer_type.alloc_buffer(64).read(0, 8)",
            ("read", "str"),
        ),
        (
            "read_int",
            "buf={'read': lambda o, n: 5}",
            "d.buffer_type.alloc_buffer(64).read(0, 8)",
            ("read", "5"),
        ),
        (
            "read_list",
            "buf={'read': lambda o, n: [0] * n}",
            "d.buffer_type.alloc_buffer(64).read(0, 8)",
            ("read", "list"),
        ),
        (
            "read_short",
            "buf={'read': lambda o, n: b'x'}",
            "d.buffer_type.alloc_buffer(64).read(0, 8)",
            ("read",),
        ),
        (
            "alloc_size_str",
            "buft={'get_alloc_size': lambda t: 'junk'}",
            "d.buffer_type.alloc_size(tensor()[1])",
            ("get_alloc_size", "junk"),
        ),
        (
            "alloc_size_negative",
            "buft={'get_alloc_size': lambda t: -4}",
            "d.buffer_type.alloc_size(tensor()[1])",
            ("get_alloc_size", "-4"),
        ),
        (
            "alloc_size_over_max",
            "buft={'max_size': 100, 'get_alloc_size': lambda t: 10**6}",
            "d.buffer_type.alloc_size(tensor()[1])",
            ("get_alloc_size", "1000000"),
        ),
        ("devices_int", "reg={'devices': lambda: 5}", "pass", ("devices", "5")),
        ("reg_name_int", "reg={'name': 5}", "pass", ("name", "5")),
    ]
    for label, parts, call, words in bad_returns:
        add(
            v,
            label,
            f"""
            NAME = "PYV_{label}"
            def run():
                d = registered(NAME, {parts})
                {call}
            names(run, *{words!r})
            """,
            # A name of the right type with a NUL in it is refused as the registry refuses
            # such names; every other bad value breaks the protocol.
            "InvalidArgumentError" if label.endswith("_nul") else "BackendError",
        )
    add(
        v,
        "scheduler_treats_bad_supports_op_as_unsupported",
        """
        registered("PYV_sched", device={'supports_op': lambda t: 'junk'})
        be = fg.init_backend("PYV_sched")
        s, g, x, y, keep = sched_graph()
        s2 = fg.Scheduler([be, cpu])
        s2.graph_compute(g)
        assert (y.numpy() == 4 * np.maximum(np.arange(8) - 3, 0)).all(), y.numpy()
        """,
        "ok",
    )

    # ---- per-backend abort slots go with their backends -------------------------------------
    add(
        "lifetimes",
        "abort_slots_do_not_grow",
        """
        gc.collect()
        before = fg._core._testing.abort_slot_count()
        for i in range(300):
            b = fg.init_backend("CPU", n_threads=1)
            b.set_abort_callback(lambda: False)
            del b
        gc.collect()
        after = fg._core._testing.abort_slot_count()
        assert after <= before + 1, (before, after)
        """,
        "ok",
    )

    # ---- op arguments of the wrong Python type -----------------------------------------------
    # ArgumentTypeError (a TypeError and an InvalidArgumentError) saying what was expected.
    o = "op_arg_types"
    for label, call, words in [
        ("permute_str", "fg.ops.permute(x, 'abc')", ("axes", "sequence of ints", "str")),
        ("permute_floats", "fg.ops.permute(x, (0.0, 1, 2))", ("axes", "sequence of ints")),
        ("transpose_str", "fg.ops.transpose(x, 'ab')", ("axes", "str")),
        ("view_strides_str", "fg.ops.view(x, (2,), strides='x')", ("strides", "str")),
        ("view_offset_str", "fg.ops.view(x, (2,), offset='1')", ("offset", "an int")),
        ("view_shape_dict", "fg.ops.view(x, {'a': 1})", ("shape",)),
        ("reshape_shape_float", "fg.ops.reshape(x, 2.5)", ("shape",)),
        ("scale_str", "fg.ops.scale(x, 'a')", ("s", "a float")),
        ("add_str", "fg.ops.add(x, '5')", ("b", "a Tensor or a number", "str")),
        ("relu_list", "fg.ops.relu([x])", ("a", "a Tensor", "list")),
        ("get_rows_none", "fg.ops.get_rows(x, None)", ("b", "a Tensor")),
        ("concat_axis_str", "fg.ops.concat(x, x, '0')", ("axis", "an int")),
        ("acc_strides_int", "fg.ops.acc(x, x, 5)", ("strides",)),
        ("custom_srcs_int", "fg.ops.custom(print, 5, fg.float32, (2,))", ("srcs", "Tensors")),
        ("custom_name_int", "fg.ops.custom(print, [x], fg.float32, (2,), name=5)", ("name", "str")),
        ("ctx_int", "fg.ops.relu(x, ctx=5)", ("ctx", "Context")),
        ("unary_op_int", "fg.ops.unary(x, 5)", ("op", "a str")),
        ("rope_mode_int", "fg.ops.rope(x, x, 2, mode=1)", ("mode", "a str")),
        ("soft_max_mask_str", "fg.ops.soft_max(x, 'm')", ("mask", "Tensor")),
        ("norm_eps_list", "fg.ops.rms_norm(x, [1e-6])", ("eps", "a float")),
        ("glu_swapped_str", "fg.ops.swiglu(x, swapped='yes')", ("swapped", "a bool")),
    ]:
        add(
            o,
            label,
            f"""
            ctx = fg.Context(no_alloc=False)
            x = ctx.new_tensor(fg.float32, (2, 3, 4))
            try:
                with ctx:
                    {call}
            except fg.ArgumentTypeError as e:
                assert isinstance(e, TypeError) and isinstance(e, fg.InvalidArgumentError)
                missing = [w for w in {words!r} if w not in str(e)]
                assert not missing, (missing, str(e))
                assert not any(r in str(e) for r in RUST_NAMES + ("Vec", "extract")), str(e)
                raise
            """,
            "ArgumentTypeError",
        )
    add(
        o,
        "every_builder_every_argument",
        """
        # Each builder with each positional argument in turn replaced by a wrong type: a
        # documented ferrograph error, never a bare TypeError or a Rust type name.
        import inspect
        ctx = fg.Context(no_alloc=False)
        x = ctx.new_tensor(fg.float32, (2, 3, 4))
        bad = []
        for name in fg.ops.__all__:
            f = getattr(fg.ops, name)
            try:
                params = [
                    p for p in inspect.signature(f).parameters.values()
                    if p.kind is p.POSITIONAL_OR_KEYWORD
                ]
            except (TypeError, ValueError):
                continue
            for i in range(len(params)):
                args = [x] * len(params)
                args[i] = object()
                try:
                    with ctx:
                        f(*args)
                except fg.Error as e:
                    if any(r in str(e) for r in RUST_NAMES + ("Vec", "extract")):
                        bad.append((name, i, str(e)))
                except Exception as e:
                    bad.append((name, i, repr(e)))
        assert not bad, bad[:5]
        """,
        "ok",
    )

    # ---- inputs given fresh compute memory read as zeros, never leftovers -------------------
    # The documented choice: a leaf the graph allocator (or scheduler) places in compute memory
    # (never allocated, or its own buffer freed) starts as zeros; ggml leaves such an input
    # undefined, ferrograph defines it so a forgotten set is deterministic, not garbage.
    for label, poison in [("poisoned", True), ("reused", False)]:
        add(
            "lifetimes",
            f"freed_input_reads_zeros_{label}",
            f"""
            ctx = fg.Context()
            x = ctx.new_tensor(fg.float32, (64,), name="x")
            wbuf = fg.alloc_ctx_tensors(ctx, cpu)
            x.set(np.arange(64, dtype=np.float32) + 1)
            oc = fg.Context()
            with oc:
                y = fg.ops.add(fg.ops.scale(x, 2.0), fg.ops.scale(x, 3.0))
            g = fg.Graph.build(y)
            ga = fg.GraphAllocator(cpu)
            ga.poison = {poison}
            ga.alloc_graph(g)
            cpu.graph_compute(g)
            assert (y.numpy() == 5 * (np.arange(64) + 1)).all()
            # Free x's own buffer (the plan changes: x now needs compute memory), leave
            # non-zero bytes all over the compute memory, and allocate again with that plan.
            wbuf.free()
            ga.alloc_graph(g)
            for b in ga.buffers(0):
                b.clear(0x41)
            ga.alloc_graph(g)
            assert (x.numpy() == 0).all(), x.numpy()[:8]
            cpu.graph_compute(g)
            assert (y.numpy() == 0).all(), y.numpy()[:8]
            # Set after allocation, as usual: computed from the new values.
            x.set(np.ones(64, np.float32))
            cpu.graph_compute(g)
            assert (y.numpy() == 5).all(), y.numpy()[:8]
            """,
            "ok",
        )
    add(
        "lifetimes",
        "scheduler_freed_input_reads_zeros",
        """
        s, g, x, y, keep = sched_graph()
        s.graph_compute(g)
        keep[1].free()
        s.reset(); s.alloc_graph(g); s.graph_compute(g)
        assert (y.numpy() == 0).all(), y.numpy()
        try:  # x's compute memory (zeros) went to a later node after its last use
            x.numpy()
            raise AssertionError("reading x must raise: a later node wrote its memory")
        except fg.StaleTensorError as e:
            assert "tensor 'x'" in str(e) or "tensor #" in str(e), e
        """,
        "ok",
    )
    return cases


CASES = _cases()


# ---- the child ----------------------------------------------------------------------------------


def _child() -> None:
    """Runs the cases given on stdin ([[name, code], ...]) in order, printing one JSON line
    before and after each."""
    todo = json.loads(sys.stdin.read())
    base: dict[str, object] = {}
    exec(compile(PRELUDE, "<prelude>", "exec"), base)
    base["RUST_NAMES"] = RUST_NAMES
    for name, code in todo:
        print(json.dumps({"start": name}), flush=True)
        # A fresh CPU backend per case, so callbacks a case installs do not leak.
        base["cpu"] = base["fg"].init_backend("CPU", n_threads=1)  # type: ignore[attr-defined]
        scope = dict(base)
        outcome: dict[str, object] = {"name": name}
        try:
            exec(compile(code, f"<{name}>", "exec"), scope)
            outcome["raised"] = None
        except BaseException as e:
            outcome["raised"] = type(e).__name__
            outcome["mro"] = [k.__name__ for k in type(e).__mro__]
            outcome["message"] = str(e)[:300]
            outcome["cause"] = type(e.__cause__).__name__ if e.__cause__ is not None else None
        # Plugins registered by a case must not leak into the next one.
        fg = base["fg"]
        for reg in fg.registrations():  # type: ignore[attr-defined]
            if reg.name.startswith(("PY", "NP")) or reg.name in ("", "cpu", "A\x00B", "  "):
                with contextlib.suppress(Exception):
                    fg.unregister_backend(reg.name)  # type: ignore[attr-defined]
        fg.set_log_level("debug")  # type: ignore[attr-defined]
        fg.set_global_abort_callback(None)  # type: ignore[attr-defined]
        print(json.dumps(outcome), flush=True)


def classify(case: Case, outcome: dict[str, object]) -> str:
    """ok / panic / wrong for a case that finished (signal and hang are decided by the parent)."""
    raised = outcome.get("raised")
    mro = outcome.get("mro") or []
    message = str(outcome.get("message") or "")
    if raised == "PanicException" or "panicked" in message or "capacity overflow" in message:
        return "panic"
    expected = (case.expect,) if isinstance(case.expect, str) else case.expect
    if raised is None:
        return "ok" if "ok" in expected else "wrong"
    return "ok" if any(e in mro for e in expected if e != "ok") else "wrong"


def run_cases(cases: list[Case], timeout: float = CASE_TIMEOUT) -> dict[str, tuple[str, str]]:
    """Runs `cases` in as few children as crashes allow; returns {name: (verdict, detail)}."""
    results: dict[str, tuple[str, str]] = {}
    pending = [c.name for c in cases]
    by_name = {c.name: c for c in cases}
    env = dict(os.environ, PYTHONFAULTHANDLER="0", RUST_BACKTRACE="0")
    while pending:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        assert proc.stdout is not None and proc.stdin is not None
        proc.stdin.write(json.dumps([[n, by_name[n].code] for n in pending]).encode())
        proc.stdin.close()
        current: str | None = None
        deadline = time.monotonic() + timeout * 3  # the first case also pays the imports
        buffer = b""
        while True:
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([proc.stdout], [], [], max(remaining, 0))
            if not ready:
                # Hung: the current case (or, before any started, the first pending one).
                name = current or pending[0]
                results[name] = ("hang", f"no answer within {timeout:.0f} s")
                pending.remove(name)
                os.killpg(proc.pid, 9)
                proc.wait()
                break
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                proc.wait()
                if current is not None:
                    rc = proc.returncode
                    results[current] = ("signal", f"child exited with {rc} during the case")
                    pending.remove(current)
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if "start" in msg:
                    current = msg["start"]
                    deadline = time.monotonic() + timeout
                else:
                    name = msg["name"]
                    verdict = classify(by_name[name], msg)
                    detail = f"{msg.get('raised')}: {msg.get('message', '')}"
                    results[name] = (verdict, detail)
                    pending.remove(name)
                    current = None
            if not pending:
                proc.wait()
                break
    return results


@pytest.fixture(scope="module")
def adversarial_results() -> dict[str, tuple[str, str]]:
    return run_cases(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_adversarial_case(case: Case, adversarial_results: dict[str, tuple[str, str]]) -> None:
    verdict, detail = adversarial_results[case.name]
    assert verdict == "ok", f"{case.name}: {verdict} ({detail}); expected {case.expect}"


def test_classifier_sees_crashes_hangs_and_panics() -> None:
    """The harness itself: a segfault, a hang and a wrong exception are told apart."""
    probes = [
        Case("probe/signal", "probe", "import ctypes; ctypes.string_at(0)", "ok"),
        Case("probe/hang", "probe", "time.sleep(60)", "ok"),
        Case("probe/wrong", "probe", "raise KeyError('x')", "ValueError"),
        Case("probe/ok", "probe", "fg._core._testing.raise_error('Shape', 'x')", "ShapeError"),
    ]
    results = run_cases(probes, timeout=3.0)
    assert {k: v[0] for k, v in results.items()} == {
        "probe/signal": "signal",
        "probe/hang": "hang",
        "probe/wrong": "wrong",
        "probe/ok": "ok",
    }


def _table() -> None:
    results = run_cases(CASES)
    by_cat: dict[str, dict[str, int]] = {}
    for case in CASES:
        verdict = results[case.name][0]
        row = by_cat.setdefault(case.category, {})
        row[verdict] = row.get(verdict, 0) + 1
        if verdict != "ok":
            print(f"{verdict:7} {case.name}: {results[case.name][1][:160]}")
    print()
    print(f"{'category':12} cases  ok  wrong  panic  signal  hang")
    for cat, row in by_cat.items():
        total = sum(row.values())
        print(
            f"{cat:12} {total:5} {row.get('ok', 0):3} {row.get('wrong', 0):6} "
            f"{row.get('panic', 0):6} {row.get('signal', 0):7} {row.get('hang', 0):5}"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child()
    else:
        _table()
