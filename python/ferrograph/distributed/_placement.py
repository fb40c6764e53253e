"""Layers over devices: :func:`place_layers`, the function form of
:meth:`ferrograph.models.SentenceEncoder.place_layers`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def copy_weights(
    weights: dict[str, Any], moved: dict[int, list[str]], backends: Sequence[Any]
) -> list[tuple[Any, Any]]:
    """Copies the named tensors of ``weights`` into a weights buffer on ``backends[home]``
    for each ``home, names`` of ``moved``, and points ``weights`` at the copies. Returns the
    (context, buffer) pairs that keep the copies alive.

    The same as :func:`ferrograph.models.weights.copy_weights`, where it lives now.

    Raises
    ------
    ferrograph.AllocationError
        If a backend gives no buffer.
    """
    from ..models.weights import copy_weights as copy

    return copy(weights, moved, backends)


def place_layers(model: Any, devices: Sequence[Any]) -> list[int]:
    """Spreads a :class:`ferrograph.models.SentenceEncoder`'s encoder layers over ``devices``:
    ``model.place_layers(devices)`` (see :meth:`ferrograph.models.SentenceEncoder.place_layers`).

    Returns ``model.layer_homes`` (per layer, an index into ``model.backends``: the local
    backend is 0, the devices follow).

    Raises
    ------
    ferrograph.InvalidArgumentError
        If ``devices`` is empty.
    ferrograph.DeviceLostError
        If a remote device's server is gone.
    """
    homes: list[int] = model.place_layers(devices)
    return homes
