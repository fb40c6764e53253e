"""Models built from ferrograph ops.

:class:`SentenceEncoder` -- any BERT-family sentence-transformers model directory (settings read
as sentence-transformers reads them: :mod:`ferrograph.models.settings`), embedded with
ferrograph; :class:`MiniLM` -- its short form for the packaged all-MiniLM-L6-v2. Weights are read
with ``safetensors`` and text split with ``tokenizers``; neither is imported until a model is
loaded. :class:`LLM` -- a GGUF language model (llama, mistral, qwen2) with a KV cache, sampling
and chat (:mod:`ferrograph.models.llm`).

Errors: :class:`ModelNotFoundError` (a missing directory or file), :class:`UnsupportedModelError`
(a module or setting that cannot be computed exactly as sentence-transformers does),
:class:`MissingDependencyError` (``safetensors`` / ``tokenizers`` not installed); all three are
:class:`ferrograph.Error` subclasses.
"""

from __future__ import annotations

from .llm import LLM, GenerationResult, LLMConfig
from .minilm import MODEL_PACKAGE, MiniLM, MiniLMConfig, find_model_dir
from .sentence_encoder import GRAPH_CACHE_SIZE, SentenceEncoder
from .settings import (
    POOLING_MODES,
    BertConfig,
    ModelNotFoundError,
    ModelSettings,
    PoolingConfig,
    UnsupportedModelError,
    read_settings,
)
from .weights import WEIGHT_DTYPES, MissingDependencyError

__all__ = [
    "GRAPH_CACHE_SIZE",
    "LLM",
    "MODEL_PACKAGE",
    "POOLING_MODES",
    "WEIGHT_DTYPES",
    "BertConfig",
    "GenerationResult",
    "LLMConfig",
    "MiniLM",
    "MiniLMConfig",
    "MissingDependencyError",
    "ModelNotFoundError",
    "ModelSettings",
    "PoolingConfig",
    "SentenceEncoder",
    "UnsupportedModelError",
    "find_model_dir",
    "read_settings",
]
