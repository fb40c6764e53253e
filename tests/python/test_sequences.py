"""Random sequences of API calls (a Hypothesis state machine): each step either does what the
model predicts or raises the documented ``fg.Error`` subclass — never another exception, a
crash, a hang or a wrong value."""

from __future__ import annotations

import contextlib
from typing import Any

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import ferrograph as fg

N = 8
# Sizes and offsets from the harmless to the absurd (allocations must be checked first).
SIZES = st.one_of(
    st.integers(0, 64),
    st.sampled_from([2**31, 2**40, 2**62, 2**63, 2**64 - 1]),
)


class BoomError(Exception):
    """Raised by callbacks on purpose."""


class ApiSequence(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cpu = fg.init_backend("CPU", n_threads=1)
        self.ctx = fg.Context()
        self.x = self.ctx.new_tensor(fg.float32, (N,), name="x")
        with self.ctx:
            self.y = fg.ops.add(fg.ops.relu(fg.ops.scale(self.x, 2.0)), self.x)
        self.graph = fg.Graph.build(self.y)
        buf = fg.alloc_ctx_tensors(self.ctx, self.cpu)
        assert buf is not None
        self.buf = buf
        self.sched = fg.Scheduler([self.cpu])
        self.sched_reset_pending = False
        self.x_value: np.ndarray | None = None
        # x's memory is usable (its buffer alive, or the scheduler gave it new memory).
        self.buffer_alive = True
        self.buf_freed = False
        self.x_in_compute_memory = False
        self.callback = "none"
        self.y_expected: np.ndarray | None = None

    def expected_y(self) -> np.ndarray:
        assert self.x_value is not None
        return np.maximum(2 * self.x_value, 0) + self.x_value

    def lenient(self, call: Any) -> bool:
        """Once x's buffer is freed the scheduler may give x and y compute memory of unknown
        contents (as ggml does for inputs without memory): from then on a call must only
        succeed or raise a documented error (or the callback's own). True when handled."""
        if not self.buf_freed:
            return False
        with contextlib.suppress(fg.Error, BoomError):
            call()
        self.y_expected = None
        return True

    @rule(values=st.lists(st.floats(-1e3, 1e3, width=32), min_size=N, max_size=N))
    def set_x(self, values: list[float]) -> None:
        array = np.array(values, np.float32)
        if self.lenient(lambda: self.x.set(array)):
            return
        if self.buffer_alive:
            self.x.set(array)
            self.x_value = array
            self.y_expected = None
        else:
            try:
                self.x.set(array)
            except fg.StaleTensorError:
                return
            raise AssertionError("set on a freed buffer succeeded")

    @rule(kind=st.sampled_from(["none", "true", "false", "raise", "reentrant"]))
    def set_eval_callback(self, kind: str) -> None:
        sched = self.sched

        def raising(t: Any, ask: bool) -> bool:
            raise BoomError()

        callbacks: dict[str, Any] = {
            "none": None,
            "true": lambda t, ask: True,
            "false": lambda t, ask: ask,  # asks for every node, then cancels
            "raise": raising,
            "reentrant": lambda t, ask: sched.n_splits >= 0,
        }
        sched.set_eval_callback(callbacks[kind])
        self.callback = kind

    @rule(value=st.one_of(st.integers(-3, 70), st.sampled_from([2**40, 2**63])))
    def set_n_copies(self, value: int) -> None:
        try:
            self.sched.n_copies = value
        except (fg.InvalidArgumentError, OverflowError):
            assert not 1 <= value <= 64
            return
        assert 1 <= value <= 64 and self.sched.n_copies == value

    @precondition(lambda self: self.x_value is not None)
    @rule()
    def compute(self) -> None:
        if self.lenient(lambda: self.sched.graph_compute(self.graph)):
            return
        expected: type[BaseException] | None = {
            "none": None,
            "true": None,
            "false": fg.AbortedError,
            "raise": BoomError,
            "reentrant": fg.BusyError,
        }[self.callback]
        if not self.buffer_alive:
            # x's buffer was freed: a stale-tensor error, the callback's outcome first, or (the
            # scheduler gives a leaf without memory compute memory, as ggml does for inputs)
            # a result from unset input memory.
            expected = fg.Error
        elif self.sched_reset_pending:
            expected = fg.NotAllocatedError  # a reset scheduler needs alloc_graph
        try:
            self.sched.graph_compute(self.graph)
        except BaseException as e:
            if expected is None or not isinstance(e, (expected, fg.Error)):
                raise
            if expected is not fg.Error:
                assert isinstance(e, expected), repr(e)
            self.y_expected = None
            return
        if expected is fg.Error:
            self.y_expected = None  # computed from an input with unknown contents
            return
        assert expected is None, f"expected {expected}"
        self.y_expected = self.expected_y()
        np.testing.assert_array_equal(self.y.numpy(), self.y_expected)

    @rule()
    def sched_reset(self) -> None:
        self.sched.reset()
        self.sched_reset_pending = True
        if self.x_in_compute_memory:
            self.buffer_alive = False  # reset made the compute memory stale
        self.y_expected = None

    @rule()
    def alloc_graph(self) -> None:
        if self.lenient(lambda: self.sched.alloc_graph(self.graph)):
            return
        try:
            self.sched.alloc_graph(self.graph)
        except fg.StaleTensorError:
            assert not self.buffer_alive
            return
        if not self.buffer_alive:
            # A leaf whose buffer was freed has no memory: the scheduler may place it in
            # compute memory (then it is usable again, with unknown contents).
            x_buf = self.x.buffer
            self.buffer_alive = x_buf is not None and not x_buf.is_freed
            self.x_in_compute_memory = self.buffer_alive
            self.x_value = None
        self.sched_reset_pending = False
        self.y_expected = None

    @rule()
    def read_plan(self) -> None:
        plan = self.sched.plan
        assert plan is None or plan.n_copies >= 1
        assert self.sched.n_splits >= 0

    @rule(offset=SIZES, size=SIZES)
    def buffer_read(self, offset: int, size: int) -> None:
        try:
            data = self.buf.read(offset, size)
        except fg.OutOfBoundsError:
            assert offset + size > self.buf.size or self.buf_freed
            return
        except fg.StaleTensorError:
            assert self.buf_freed
            return
        assert len(data) == size <= self.buf.size

    @rule(offset=SIZES, size=st.one_of(st.none(), SIZES))
    def tensor_get(self, offset: int, size: int | None) -> None:
        try:
            data = fg.tensor_get(self.x, offset, size)
        except (fg.OutOfBoundsError, fg.StaleTensorError):
            return
        assert offset + len(data) <= self.x.nbytes

    @rule(offset=SIZES, size=SIZES)
    def get_tensor_async(self, offset: int, size: int) -> None:
        try:
            data = self.cpu.get_tensor_async(self.x, offset, size)
        except (fg.OutOfBoundsError, fg.StaleTensorError):
            return
        assert len(data) == size and offset + size <= self.x.nbytes

    @rule()
    def free_buffer(self) -> None:
        y_in_buf = self.y.buffer == self.buf and not self.buf_freed
        self.buf.free()
        self.buf_freed = True
        self.y_expected = None  # y may live in the same buffer
        if not y_in_buf:
            return
        try:
            self.y.numpy()
        except fg.StaleTensorError:
            pass
        else:
            raise AssertionError("a tensor of a freed buffer was readable")
        if self.x.buffer is None or self.x.buffer.is_freed:
            self.buffer_alive = False

    @invariant()
    def y_stays_computed(self) -> None:
        # A result read after a successful compute stays readable and right until the next
        # reset or set (the compute memory is not reused behind the caller's back).
        if self.y_expected is not None:
            np.testing.assert_array_equal(self.y.numpy(), self.y_expected)


ApiSequence.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestApiSequence = ApiSequence.TestCase
