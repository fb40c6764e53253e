"""Generation requests of many clients decoded together, one graph per step.

One worker thread owns the language model. Each admitted request is a *sequence* with its own
cache rows, handed out page by page (:data:`PAGE` rows, lowest free page first, so the rows in
use stay packed at the start of the cache and the attention window stays short). A step
evaluates the next token of every active sequence in one graph
(:meth:`ferrograph.models.LLM.evaluate`): row ``i`` writes its key and value to its own
sequence's next cache row and sees only that sequence's rows. New sequences' prompts join the
same graphs chunk by chunk (as many rows as ``n_batch`` leaves beside the decoding ones), so a
long prompt does not stall the streams already running. A prompt's last token joins the
decoding rows of the next step, so a request alone has its prompt evaluated in chunks of
``n_batch`` and its last token by the one-token graph, as :meth:`ferrograph.models.LLM.generate`
does (and gets the same tokens).

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
        if not 1 <= parallel < llm.n_batch:
            raise ValueError(f"parallel must be in [1, n_batch), got {parallel}")
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

    def _step(self, prefilling: list[Sequence], decoding: list[Sequence]) -> None:
        """One graph: the next token of every sequence of ``decoding`` (its last prompt token
        or its last sampled one) and the next prompt chunks of ``prefilling`` (in order, as
        many rows as ``n_batch`` leaves). Leaves the logits in every sequence that has a new
        token to sample."""
        start_time = time.perf_counter()
        body: list[tuple[Sequence, int]] = []  # (sequence, position) of rows without logits
        tail: list[tuple[Sequence, int]] = []  # rows whose logits are wanted, last in the graph
        room = self.llm.n_batch - len(decoding)
        n_prompt = 0
        for seq in prefilling:
            if room <= 0:
                break
            # every prompt token but the last (which decodes with the sequence's first step)
            begin = len(seq.rows)
            end = min(len(seq.prompt) - 1, begin + room)
            room -= end - begin
            n_prompt += end - begin
            seq.rows.extend(self._row(seq, p) for p in range(begin, end))
            body.extend((seq, p) for p in range(begin, end))
        for seq in decoding:
            position = len(seq.prompt) + len(seq.tokens) - 1
            n_prompt += position < len(seq.prompt)  # a prompt's last token counts as prompt
            seq.rows.append(self._row(seq, position))
            tail.append((seq, position))
        # the order of the rows is free (each has its own position, slot and visible rows);
        # the rows whose logits are wanted go last, where `out_rows` takes them
        rows = body + tail
        tokens = [
            seq.prompt[p] if p < len(seq.prompt) else seq.tokens[p - len(seq.prompt)]
            for seq, p in rows
        ]
        slots = [seq.rows[p] for seq, p in rows]
        visible = np.zeros((len(rows), max(slots) + 1), dtype=bool)
        for r, (seq, p) in enumerate(rows):
            visible[r, seq.rows[: p + 1]] = True  # its own sequence, up to its own position
        logits = self._evaluate(tokens, [p for _, p in rows], slots, visible, max(1, len(tail)))
        for i, (seq, _) in enumerate(tail):
            seq.logits = logits[len(logits) - len(tail) + i]
        self.metrics.count_step(n_prompt, len(decoding), time.perf_counter() - start_time)

    def _next_work(self) -> bool:
        """Waits for work (``False``: stop). Drops cancelled sequences, freeing their pages,
        and admits waiting ones while fewer than ``parallel`` are active."""
        with self._cond:
            while True:
                if self._stopping:
                    return False
                for seq in [s for s in self._active if s.cancelled]:
                    self._active.remove(seq)
                    self._release(seq)
                    logger.info(
                        "generation cancelled by its client after %d tokens", len(seq.tokens)
                    )
                self._waiting = deque(s for s in self._waiting if not s.cancelled)
                while self._waiting and len(self._active) < self.parallel:
                    self._active.append(self._waiting.popleft())
                if self._active:
                    return True
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
        while self._next_work():
            with self._cond:
                active = list(self._active)
            # sequences whose prompt is in the cache decode; the others add their next prompt
            # chunks to the same graph (admission order, as many rows as n_batch leaves)
            decoding = [s for s in active if len(s.rows) >= len(s.prompt) - 1]
            prefilling = [s for s in active if len(s.rows) < len(s.prompt) - 1]
            try:
                self._step(prefilling, decoding)
                for seq in [*prefilling, *decoding]:
                    if seq.logits is not None:
                        self._advance(seq)
            except Exception as error:  # the requests get the error, the worker goes on
                logger.exception("generation step failed")
                failure = APIError(500, f"generation failed: {error}", "server_error")
                for seq in [*prefilling, *decoding]:
                    if not seq.finished:
                        seq.fail(failure)
                    self._retire(seq)
        with self._cond:
            left = [*self._active, *self._waiting]
            self._active.clear()
            self._waiting.clear()
        for seq in left:
            seq.fail(overloaded("the server is shutting down", 503))
