"""Generation requests of many clients decoded together, one graph per step.

One worker thread owns the language model. Each admitted request is a *sequence* with its own
cache rows, handed out page by page (:data:`PAGE` rows, lowest free page first, so the rows in
use stay packed at the start of the cache and the attention window stays short). A step
evaluates the next token of every active sequence in one graph
(:meth:`ferrograph.models.LLM.evaluate`): row ``i`` writes its key and value to its own
sequence's next cache row and sees only that sequence's rows. A new sequence's prompt is
evaluated alone before it joins the steps.

At most ``parallel`` sequences decode at once (their rows never run out: the cache has
``parallel`` times the per-sequence context); up to ``max_queue`` more wait, and past that
:meth:`GenerationEngine.submit` raises a 429 error. A sequence whose client went away
(:meth:`Sequence.cancel`) leaves at the next step and its pages are free again.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..models.llm_tokenizer import StreamDecoder
from ..models.sampling import Sampler, SamplingParams
from .errors import APIError, bad_request, overloaded
from .metrics import Metrics

__all__ = ["PAGE", "GenerationEngine", "Sequence", "SequenceEvent"]

logger = logging.getLogger("ferrograph.server")

#: Cache rows per page of a sequence.
PAGE = 16


@dataclass
class SequenceEvent:
    """What a sequence reports to its request: a text piece, its end, or an error."""

    text: str = ""
    finish_reason: str | None = None
    """``"stop"`` or ``"length"`` on the last event."""
    error: APIError | None = None
    completion_tokens: int = 0


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


@dataclass
class Sequence:
    """One request being generated: its prompt, sampler, text state and cache rows."""

    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    stops: list[str]
    decoder: StreamDecoder
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[SequenceEvent]
    tokens: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    """Cache row of each position in use (prompt, then generated tokens)."""
    pages: list[int] = field(default_factory=list)
    held: str = ""
    """Text produced and not yet handed out (it may be the start of a stop string)."""
    logits: npt.NDArray[np.float32] | None = None
    ignore_eos: bool = False
    cancelled: bool = False
    finished: bool = False
    submitted: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """Marks the sequence as abandoned; the worker frees its rows at its next step."""
        self.cancelled = True

    def _emit(self, event: SequenceEvent) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def _finish(self, reason: str, tail: str) -> None:
        self.finished = True
        self.held = ""
        self._emit(SequenceEvent(tail, reason, None, len(self.tokens)))

    def fail(self, error: APIError) -> None:
        """Ends the sequence with an error event."""
        self.finished = True
        self._emit(SequenceEvent(error=error))

    def _cut_stop(self, text: str) -> str:
        for s in self.stops:
            at = text.find(s)
            if at >= 0:
                return text[:at]
        return text

    def advance(self, eog_ids: frozenset[int]) -> bool:
        """Samples the next token from :attr:`logits`, reports the text it completes; returns
        whether the sequence goes on (then its last token needs evaluating)."""
        if len(self.tokens) >= self.max_tokens:
            self._finish("length", self._cut_stop(self.held + self.decoder.flush()))
            return False
        assert self.logits is not None
        token = self.sampler.sample(self.logits, self.prompt + self.tokens)
        if token in eog_ids and not self.ignore_eos:
            self._finish("stop", self._cut_stop(self.held + self.decoder.flush()))
            return False
        self.tokens.append(token)
        self.held += self.decoder.push(token)
        for s in self.stops:
            at = self.held.find(s)
            if at >= 0:
                self._finish("stop", self.held[:at])
                return False
        keep = max((_overlap(self.held, s) for s in self.stops), default=0)
        piece = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep :]
        if piece:
            self._emit(SequenceEvent(piece))
        if len(self.tokens) >= self.max_tokens:
            self._finish("length", self._cut_stop(self.held + self.decoder.flush()))
            return False
        return True


class GenerationEngine:
    """Runs the language model's generations in one worker thread (see the module doc).

    Parameters
    ----------
    llm:
        A :class:`ferrograph.models.LLM` whose ``n_ctx`` is ``parallel * ctx_per_sequence``;
        the engine owns its cache.
    parallel:
        Sequences decoding at once.
    max_queue:
        Requests waiting for a free sequence at most.
    profile:
        Time every graph node; the sum over all steps is :attr:`profile`.
    """

    def __init__(
        self,
        llm: Any,
        metrics: Metrics,
        parallel: int = 4,
        max_queue: int = 64,
        profile: bool = False,
    ) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self.llm = llm
        self.metrics = metrics
        self.parallel = int(parallel)
        self.max_queue = max(0, int(max_queue))
        # whole pages per sequence, so `parallel` full sequences always fit the cache
        self.ctx_per_sequence: int = llm.n_ctx // self.parallel // PAGE * PAGE
        if self.ctx_per_sequence < PAGE:
            raise ValueError(f"the cache ({llm.n_ctx} rows) is smaller than {parallel} sequences")
        self.profile_enabled = profile
        self.profile: Any = None
        n_pages = llm.n_ctx // PAGE
        self._free_pages = list(range(n_pages))  # a heap: the lowest page first
        self._waiting: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._eog = llm.tokenizer.eog_ids
        self._thread = threading.Thread(target=self._run, name="ferrograph-generate", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a free sequence."""
        return len(self._waiting)

    @property
    def active(self) -> int:
        """Sequences being generated."""
        return len(self._active)

    def submit(
        self,
        prompt: list[int],
        max_tokens: int | None,
        params: SamplingParams,
        stops: list[str],
        param_name: str,
        ignore_eos: bool = False,
    ) -> Sequence:
        """Queues a generation (call on the event loop); its events arrive on
        ``sequence.events``. Raises a 400 error when the prompt does not fit a sequence's
        context, a 429 error when the queue is full."""
        limit = self.ctx_per_sequence
        if not prompt:
            raise bad_request("the prompt is empty (no tokens)", param_name)
        if len(prompt) >= limit:
            raise APIError(
                400,
                f"the prompt has {len(prompt)} tokens; this server's context is {limit} tokens "
                "per request (prompt and completion)",
                "invalid_request_error",
                param_name,
                "context_length_exceeded",
            )
        room = limit - len(prompt)
        loop = asyncio.get_running_loop()
        seq = Sequence(
            prompt=prompt,
            max_tokens=room if max_tokens is None else min(max_tokens, room),
            sampler=Sampler(params),
            stops=stops,
            decoder=StreamDecoder(self.llm.tokenizer, first=True),
            loop=loop,
            events=asyncio.Queue(),
            ignore_eos=ignore_eos,
        )
        with self._cond:
            if self._stopping:
                raise overloaded("the server is shutting down", 503)
            busy = len(self._active) + len(self._waiting)
            if busy >= self.parallel + self.max_queue:
                raise overloaded(
                    f"the generation queue is full ({len(self._waiting)} requests waiting); "
                    "retry later",
                    429,
                )
            self._waiting.append(seq)
            self._cond.notify()
        return seq

    def wake(self) -> None:
        """Wakes the worker (after a cancellation)."""
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        """Stops the worker after its current step; unfinished sequences get a 503 error."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)

    # ----- the worker -----

    def _row(self, seq: Sequence, position: int) -> int:
        """The cache row of ``position`` of ``seq``, taking a new page when needed."""
        while position >= len(seq.pages) * PAGE:
            seq.pages.append(heapq.heappop(self._free_pages))
        return seq.pages[position // PAGE] * PAGE + position % PAGE

    def _release(self, seq: Sequence) -> None:
        for page in seq.pages:
            heapq.heappush(self._free_pages, page)
        seq.pages = []
        seq.rows = []

    def _evaluate(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        visible: npt.NDArray[np.bool_],
        out_rows: int,
    ) -> npt.NDArray[np.float32]:
        logits: npt.NDArray[np.float32] = self.llm.evaluate(
            tokens, positions, slots, visible, out_rows=out_rows, profile=self.profile_enabled
        )
        if self.profile_enabled and self.llm.last_profile is not None:
            last = self.llm.last_profile
            self.profile = last if self.profile is None else self.profile + last
        return logits

    def _prefill(self, seq: Sequence) -> None:
        """Evaluates the prompt of ``seq`` (alone, in chunks of the model's ``n_batch``) and
        leaves the logits of its last position."""
        start_time = time.perf_counter()
        n = len(seq.prompt)
        seq.rows = [self._row(seq, p) for p in range(n)]
        rows = np.asarray(seq.rows, dtype=np.int64)
        step = self.llm.n_batch
        for start in range(0, n, step):
            end = min(n, start + step)
            width = int(rows[:end].max()) + 1
            order = np.full(width, np.iinfo(np.int64).max, dtype=np.int64)
            order[rows[:end]] = np.arange(end)
            positions = np.arange(start, end)
            visible = order[None, :] <= positions[:, None]
            logits = self._evaluate(
                seq.prompt[start:end],
                positions.tolist(),
                seq.rows[start:end],
                visible,
                1,
            )
        seq.logits = logits[-1]
        self.metrics.count_step(n, 1, time.perf_counter() - start_time)

    def _decode(self, batch: list[Sequence]) -> None:
        """One step: the last token of every sequence of ``batch`` in one graph."""
        start_time = time.perf_counter()
        tokens, positions, slots = [], [], []
        for seq in batch:
            position = len(seq.prompt) + len(seq.tokens) - 1
            seq.rows.append(self._row(seq, position))
            tokens.append(seq.tokens[-1])
            positions.append(position)
            slots.append(seq.rows[-1])
        width = max(slots) + 1
        visible = np.zeros((len(batch), width), dtype=bool)
        for i, seq in enumerate(batch):
            visible[i, seq.rows] = True
        logits = self._evaluate(tokens, positions, slots, visible, len(batch))
        for i, seq in enumerate(batch):
            seq.logits = logits[i]
        self.metrics.count_step(0, len(batch), time.perf_counter() - start_time)

    def _next_work(self) -> tuple[list[Sequence], list[Sequence]] | None:
        """Waits for work; returns the sequences to start and those to decode (``None``:
        stop). Drops cancelled sequences, freeing their pages."""
        with self._cond:
            while True:
                if self._stopping:
                    return None
                for seq in [s for s in self._active if s.cancelled]:
                    self._active.remove(seq)
                    self._release(seq)
                    logger.info(
                        "generation cancelled by its client after %d tokens", len(seq.tokens)
                    )
                self._waiting = deque(s for s in self._waiting if not s.cancelled)
                starting: list[Sequence] = []
                while self._waiting and len(self._active) + len(starting) < self.parallel:
                    starting.append(self._waiting.popleft())
                if starting or self._active:
                    self._active.extend(starting)
                    return starting, [s for s in self._active if s not in starting]
                self._cond.wait()

    def _retire(self, seq: Sequence) -> None:
        with self._cond:
            if seq in self._active:
                self._active.remove(seq)
            self._release(seq)

    def _advance(self, seq: Sequence) -> None:
        before = len(seq.tokens)
        goes_on = seq.advance(self._eog)
        self.metrics.count_generated(len(seq.tokens) - before)
        if not goes_on:
            self._retire(seq)

    def _run(self) -> None:
        while True:
            work = self._next_work()
            if work is None:
                break
            starting, decoding = work
            try:
                for seq in starting:
                    self._prefill(seq)
                    self._advance(seq)
                if decoding:
                    self._decode(decoding)
                    for seq in decoding:
                        self._advance(seq)
            except Exception as error:  # the requests get the error, the worker goes on
                logger.exception("generation step failed")
                failure = APIError(500, f"generation failed: {error}", "server_error")
                for seq in [*starting, *decoding]:
                    if not seq.finished:
                        seq.fail(failure)
                    self._retire(seq)
        with self._cond:
            left = [*self._active, *self._waiting]
            self._active.clear()
            self._waiting.clear()
        for seq in left:
            seq.fail(overloaded("the server is shutting down", 503))
