"""A dependency-free progress bar written to a text stream (stderr by default)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """A one-line progress bar, redrawn in place with a carriage return.

    Call the instance with ``(done, total)``; it redraws at most every ``min_interval`` seconds
    (and always on the last step), and ends the line when ``done == total``.

    Parameters
    ----------
    label
        Text shown before the bar.
    stream
        Where to draw; ``sys.stderr`` when ``None``.
    width
        Characters of the bar itself.
    min_interval
        Seconds between redraws.
    """

    def __init__(
        self,
        label: str = "",
        stream: TextIO | None = None,
        width: int = 30,
        min_interval: float = 0.1,
    ) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.min_interval = min_interval
        self._start = time.perf_counter()
        self._last_draw = -1.0

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        finished = done >= total
        if not finished and now - self._last_draw < self.min_interval:
            return
        self._last_draw = now
        fraction = 1.0 if total <= 0 else min(done / total, 1.0)
        filled = round(fraction * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = now - self._start
        rate = done / elapsed if elapsed > 0 else 0.0
        prefix = f"{self.label} " if self.label else ""
        self.stream.write(
            f"\r{prefix}[{bar}] {done}/{total} ({100 * fraction:5.1f}%) "
            f"{elapsed:6.1f}s {rate:7.1f}/s"
        )
        if finished:
            self.stream.write("\n")
        self.stream.flush()
