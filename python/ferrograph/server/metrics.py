"""Counters of the server and their ``/metrics`` text (Prometheus' plain-text format)."""

from __future__ import annotations

import threading
import time
from collections import Counter

__all__ = ["Metrics"]


class Metrics:
    """Thread-safe counters: requests by endpoint and status, sentences embedded, tokens read
    and generated, and the queue depths reported by the batchers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.sentences_embedded = 0
        self.embedding_batches = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.decode_steps = 0
        self.decode_rows = 0
        self.generation_seconds = 0.0

    def count_request(self, path: str, status: int) -> None:
        """One answered request."""
        with self._lock:
            self.requests[(path, status)] += 1

    def count_embeddings(self, sentences: int) -> None:
        """One encoder call over ``sentences`` sentences."""
        with self._lock:
            self.sentences_embedded += sentences
            self.embedding_batches += 1

    def count_step(self, prompt_tokens: int, rows: int, seconds: float) -> None:
        """One graph of the generation loop: the prompt tokens it read, the sequences it
        decoded (``rows``) and its wall time."""
        with self._lock:
            self.prompt_tokens += prompt_tokens
            if rows:
                self.decode_steps += 1
                self.decode_rows += rows
            self.generation_seconds += seconds

    def count_generated(self, tokens: int) -> None:
        """Tokens sampled and handed to their sequences."""
        with self._lock:
            self.generated_tokens += tokens

    def render(self, gauges: dict[str, float]) -> str:
        """The metrics text; ``gauges`` are current values (queue depths, active sequences)."""
        with self._lock:
            lines = [
                "# HELP ferrograph_requests_total Requests answered, by path and HTTP status.",
                "# TYPE ferrograph_requests_total counter",
            ]
            for (path, status), n in sorted(self.requests.items()):
                lines.append(f'ferrograph_requests_total{{path="{path}",status="{status}"}} {n}')
            busy = self.generation_seconds
            values = {
                "ferrograph_uptime_seconds": time.monotonic() - self.started,
                "ferrograph_sentences_embedded_total": self.sentences_embedded,
                "ferrograph_embedding_batches_total": self.embedding_batches,
                "ferrograph_prompt_tokens_total": self.prompt_tokens,
                "ferrograph_generated_tokens_total": self.generated_tokens,
                "ferrograph_decode_steps_total": self.decode_steps,
                "ferrograph_decode_rows_total": self.decode_rows,
                "ferrograph_generation_busy_seconds_total": busy,
                "ferrograph_generated_tokens_per_busy_second": (
                    self.generated_tokens / busy if busy > 0 else 0.0
                ),
            }
        values.update(gauges)
        for name, value in values.items():
            lines.append(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}")
        return "\n".join(lines) + "\n"
