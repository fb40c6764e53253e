"""Shared fixtures for the ferrograph Python tests."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import ferrograph as fg

HAVE_ML_DTYPES = importlib.util.find_spec("ml_dtypes") is not None
needs_ml_dtypes = pytest.mark.skipif(
    not HAVE_ML_DTYPES,
    reason="ml_dtypes is not installed (it is in the 'test' extra): no bf16 reference",
)


@pytest.fixture
def ctx() -> fg.Context:
    """A metadata-only context."""
    return fg.Context()


@pytest.fixture
def host_ctx() -> fg.Context:
    """A context that gives every tensor host memory."""
    return fg.Context(no_alloc=False)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
