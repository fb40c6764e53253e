"""Where a block's f16 super-block scale lives, for tests that write random blocks with a
chosen scale (the i-quants below 4 bits have no quantizer to make blocks from values)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def put_f16_scale(raw: npt.NDArray[np.uint8], name: str, bits: npt.ArrayLike) -> None:
    """Writes the f16 bit patterns ``bits`` (one per block, or one for all) as the scale of
    each block (row) of ``raw``: at the block's first two bytes, or for iq1_m spread over the
    top nibbles of its four trailing scale words (nibble ``i`` of the f16 in word ``i``)."""
    b = np.broadcast_to(np.asarray(bits, dtype=np.uint16), raw.shape[:1])
    if name == "iq1_m":
        size = raw.shape[1]
        for i in range(4):
            at = size - 7 + 2 * i
            nibble = ((b >> (4 * i)) & 0xF).astype(np.uint8)
            raw[:, at] = (raw[:, at] & 0x0F) | (nibble << 4)
    else:
        raw[:, 0] = (b & 0xFF).astype(np.uint8)
        raw[:, 1] = (b >> 8).astype(np.uint8)
