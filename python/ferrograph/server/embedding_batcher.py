"""Embedding requests of many clients gathered into one encoder call.

A single worker thread owns the encoder. Requests wait in a queue bounded in sentences; the
worker takes what is queued and encodes it all with one ``encode`` call, handing each request
its rows. It waits for company (at most ``max_wait`` seconds, while the batch has fewer than
``max_batch`` sentences) only under concurrent load — when requests arrived while the encoder
was busy, or the last batch served several requests; a lone client is encoded at once. The
event loop only queues and awaits: the model never runs on it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import overloaded
from .metrics import Metrics

__all__ = ["ENCODE_BATCH", "EmbeddingBatcher"]

logger = logging.getLogger("ferrograph.server")

#: Sentences per graph inside one encoder call (its padded shapes stay few and cached).
ENCODE_BATCH = 32


@dataclass
class _Pending:
    texts: list[str]
    future: asyncio.Future[tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]]
    loop: asyncio.AbstractEventLoop


def _deliver(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():  # the client went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class EmbeddingBatcher:
    """Batches :meth:`embed` calls across clients into ``encoder.encode`` calls.

    Parameters
    ----------
    encoder:
        A :class:`ferrograph.models.SentenceEncoder` (or anything with its ``encode``).
    max_batch:
        Sentences gathered into one encoder call at most (a larger request runs alone).
    max_wait:
        Seconds the worker waits for more requests once it has some, when other clients are
        active (requests queued during the previous batch, or a previous batch of several
        requests); an idle encoder takes a lone request at once.
    max_queue:
        Sentences waiting at most; past that :meth:`embed` raises a 429 error.
    profile:
        Time every graph node; the sum over all calls is :attr:`profile`.
    """

    def __init__(
        self,
        encoder: Any,
        metrics: Metrics,
        max_batch: int = 64,
        max_wait: float = 0.005,
        max_queue: int = 4096,
        profile: bool = False,
    ) -> None:
        self.encoder = encoder
        self.metrics = metrics
        self.max_batch = max(1, int(max_batch))
        self.max_wait = max(0.0, float(max_wait))
        self.max_queue = max(1, int(max_queue))
        self.profile_enabled = profile
        self.profile: Any = None
        self._queue: deque[_Pending] = deque()
        self._queued_sentences = 0
        self._cond = threading.Condition()
        self._stopping = False
        # Requests in the batch taken last (several: clients are active concurrently).
        self._last_requests = 0
        # Whether the encoder is computing a batch, and whether a request arrived meanwhile
        # (another client active at the same time).
        self._busy = False
        self._arrived_while_busy = False
        self._thread = threading.Thread(target=self._run, name="ferrograph-embed", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Sentences waiting for the encoder."""
        return self._queued_sentences

    async def embed(
        self, texts: list[str]
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """The embeddings of ``texts``, ``(len(texts), dim)``, computed with other clients',
        and the tokens of each text (after truncation)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]] = (
            loop.create_future()
        )
        with self._cond:
            if self._stopping:
                raise overloaded("the server is shutting down", 503)
            if self._queued_sentences + len(texts) > self.max_queue and self._queue:
                raise overloaded(
                    f"the embedding queue is full ({self._queued_sentences} sentences waiting); "
                    "retry later",
                    429,
                )
            self._queue.append(_Pending(texts, future, loop))
            self._queued_sentences += len(texts)
            self._arrived_while_busy |= self._busy
            self._cond.notify()
        return await future

    def close(self) -> None:
        """Stops the worker after the batch it is computing; waiting requests get a 503."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _take(self) -> list[_Pending] | None:
        with self._cond:
            # Requests that queued while the encoder was busy mean concurrent clients: worth
            # waiting a little for more of them. A request finding the encoder idle, after
            # batches of one, is a lone client's: it is encoded at once. (Whether the queue is
            # empty here says nothing: a lone client, answered before this point, may already
            # have sent its next request.)
            concurrent = self._arrived_while_busy or self._last_requests > 1
            self._arrived_while_busy = False
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            deadline = time.monotonic() + (self.max_wait if concurrent else 0.0)
            while self._queued_sentences < self.max_batch and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch: list[_Pending] = []
            count = 0
            while self._queue:
                nxt = self._queue[0]
                if batch and count + len(nxt.texts) > self.max_batch:
                    break
                self._queue.popleft()
                self._queued_sentences -= len(nxt.texts)
                if nxt.future.done():  # cancelled while waiting
                    continue
                batch.append(nxt)
                count += len(nxt.texts)
            self._last_requests = len(batch)
            self._busy = bool(batch)
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                break
            if not batch:
                continue
            texts = [t for p in batch for t in p.texts]
            start = time.perf_counter()
            try:
                rows = self.encoder.encode(
                    texts, batch_size=ENCODE_BATCH, profile=self.profile_enabled
                )
                counts = self.encoder.tokenize(texts).lengths
                error: BaseException | None = None
            except Exception as e:  # handed to the requests, never lost in the thread
                logger.exception("embedding batch failed")
                rows, counts, error = None, None, e
            if self.profile_enabled and getattr(self.encoder, "last_profile", None) is not None:
                last = self.encoder.last_profile
                self.profile = last if self.profile is None else self.profile + last
            elapsed = time.perf_counter() - start
            # Idle again before anyone is answered: a lone client's next request must not
            # count as arriving while busy.
            with self._cond:
                self._busy = False
            logger.debug(
                "embedded %d sentences of %d requests in %.1f ms",
                len(texts),
                len(batch),
                elapsed * 1e3,
            )
            self.metrics.count_embeddings(len(texts))
            at = 0
            for p in batch:
                part = None
                if rows is not None and counts is not None:
                    part = (rows[at : at + len(p.texts)], counts[at : at + len(p.texts)])
                at += len(p.texts)
                p.loop.call_soon_threadsafe(_deliver, p.future, part, error)
        with self._cond:
            waiting = list(self._queue)
            self._queue.clear()
            self._queued_sentences = 0
        for p in waiting:
            p.loop.call_soon_threadsafe(
                _deliver, p.future, None, overloaded("the server is shutting down", 503)
            )
