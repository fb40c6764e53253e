"""An OpenAI-compatible HTTP server: embeddings, completions and chat.

``python -m ferrograph api`` runs it with uvicorn; :func:`create_app` returns the ASGI app to
mount elsewhere. Needs the ``server`` extra (``pip install 'ferrograph[server]'``: Starlette
and uvicorn). Embedding requests of many clients are batched into one encoder call
(:mod:`~ferrograph.server.embedding_batcher`); generations decode together, one graph per step
(:mod:`~ferrograph.server.generation`).
"""

from __future__ import annotations

from .app import DEFAULT_MAX_BODY, create_app
from .embedding_batcher import EmbeddingBatcher
from .errors import APIError
from .generation import PAGE, GenerationEngine

__all__ = [
    "DEFAULT_MAX_BODY",
    "PAGE",
    "APIError",
    "EmbeddingBatcher",
    "GenerationEngine",
    "create_app",
]
