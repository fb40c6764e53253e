"""Models built from ferrograph ops.

:mod:`ferrograph.models.minilm` -- all-MiniLM-L6-v2 sentence embeddings (BERT encoder, mean
pooling, L2 normalisation), weights read with ``safetensors`` and text split with
``tokenizers``; neither is imported until a model is loaded.
"""

from __future__ import annotations

from .minilm import (
    MODEL_PACKAGE,
    WEIGHT_DTYPES,
    MiniLM,
    MiniLMConfig,
    MissingDependencyError,
    ModelNotFoundError,
    find_model_dir,
)

__all__ = [
    "MODEL_PACKAGE",
    "WEIGHT_DTYPES",
    "MiniLM",
    "MiniLMConfig",
    "MissingDependencyError",
    "ModelNotFoundError",
    "find_model_dir",
]
