"""Helpers shared by the fixture scripts (make_*_fixtures.py): the random f16 scale fields
of generated blocks, and the sectioned binary files the Rust tests read."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"


def finite_f16_bits(rng: np.random.Generator) -> int:
    """A finite f16 bit pattern: mostly moderate normals (~1e-3..4), sometimes subnormal, zero,
    negative zero or large. Consumes the generator in a fixed order (the checked-in fixtures
    depend on it)."""
    kind = rng.integers(0, 10)
    sign = int(rng.integers(0, 2)) << 15
    if kind == 0:
        return sign | int(rng.integers(1, 0x400))  # subnormal
    if kind == 1:
        return sign  # +0 / -0
    if kind == 2:
        return sign | (int(rng.integers(24, 31)) << 10) | int(rng.integers(0, 0x400))  # large
    return sign | (int(rng.integers(5, 18)) << 10) | int(rng.integers(0, 0x400))


def write_sections(name: str, head: bytes, sections: list[bytes]) -> Path:
    """Writes tests/data/`name`: `head` (the file's magic and any header fields), the section
    count as a little-endian u32, then the sections; returns the path."""
    out = bytearray(head) + struct.pack("<I", len(sections))
    for sec in sections:
        out += sec
    path = DATA / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(out))
    print(f"wrote {path} ({len(out)} bytes)")
    return path
