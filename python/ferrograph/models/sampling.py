"""Choosing the next token from a row of logits.

The chain, in llama.cpp's order: penalties (repetition, frequency, presence, over the last
``penalty_last_n`` tokens), then greedy when ``temperature <= 0``, else top-k, top-p, min-p,
temperature, and a draw from the remaining distribution with the sampler's own random
generator (``seed``: the same seed gives the same tokens).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

import ferrograph as fg


@dataclass(frozen=True)
class SamplingParams:
    """Settings of :class:`Sampler` (defaults: llama.cpp's, but ``temperature`` 0 = greedy).

    ``top_k`` 0 keeps every token, ``top_p`` 1 and ``min_p`` 0 keep every token;
    ``repeat_penalty`` 1 and the two others 0 switch the penalties off.
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, value: object, rule: str) -> fg.InvalidArgumentError:
            return fg.InvalidArgumentError(f"{name} must be {rule}, got {value!r}")

        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "a finite number >= 0")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not np.isfinite(self.repeat_penalty) or self.repeat_penalty <= 0:
            raise bad("repeat_penalty", self.repeat_penalty, "a finite number > 0")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not np.isfinite(value):
                raise bad(name, value, "finite")
        if self.penalty_last_n < 0:
            raise bad("penalty_last_n", self.penalty_last_n, ">= 0")


class Sampler:
    """Picks tokens from logits with :class:`SamplingParams`; keeps its random state."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def apply_penalties(
        self, logits: npt.NDArray[np.float32], history: Sequence[int]
    ) -> npt.NDArray[np.float32]:
        """``logits`` (a copy) with the penalties for the last tokens of ``history``."""
        p = self.params
        if p.penalty_last_n == 0 or not history:
            return logits
        if p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0:
            return logits
        out = logits.copy()
        counts = Counter(history[-p.penalty_last_n :])
        ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        n = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
        vals = out[ids]
        vals = np.where(vals <= 0, vals * p.repeat_penalty, vals / p.repeat_penalty)
        vals = vals - n * p.frequency_penalty - p.presence_penalty
        out[ids] = vals.astype(np.float32)
        penalized: npt.NDArray[np.float32] = out
        return penalized

    def sample(self, logits: npt.NDArray[np.float32], history: Sequence[int] = ()) -> int:
        """The next token for one row of logits, given the tokens so far."""
        p = self.params
        row = self.apply_penalties(np.asarray(logits, dtype=np.float32), history)
        if p.temperature <= 0.0:
            return int(np.argmax(row))
        # candidates sorted by logit, highest first (ties: lower id first)
        order = np.argsort(-row, kind="stable")
        if p.top_k > 0:
            order = order[: p.top_k]
        z = row[order].astype(np.float64)
        probs = np.exp(z - z[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            cum = np.cumsum(probs)
            keep = int(np.searchsorted(cum, p.top_p) + 1)
            order, z = order[:keep], z[:keep]
            probs = probs[:keep] / probs[:keep].sum()
        if p.min_p > 0.0:
            keep_mask = probs >= p.min_p * probs[0]
            order, z = order[keep_mask], z[keep_mask]
        z = z / p.temperature
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        return int(order[self._rng.choice(len(order), p=probs)])
