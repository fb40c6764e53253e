"""The ASGI app: OpenAI's endpoints over an embedding model and a language model.

``create_app(embedding_model=..., llm=...)`` returns a Starlette app (mount it in another ASGI
server, or run it with uvicorn as ``python -m ferrograph api`` does). Routes:

- ``GET /health`` (no key needed), ``GET /metrics`` (plain text), ``GET /profile`` (the
  per-op profiles, when created with ``profile=True``);
- ``GET /v1/models``, ``POST /v1/embeddings``, ``POST /v1/completions``,
  ``POST /v1/chat/completions`` with OpenAI's request and response shapes, streaming as
  server-sent events ending with ``data: [DONE]``.

Every failure is OpenAI's error object with its status (:mod:`ferrograph.server.errors`);
anything unexpected is logged and answered with a 500 that carries no traceback.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np

from ..models.sampling import SamplingParams
from .embedding_batcher import EmbeddingBatcher
from .errors import APIError, bad_request, model_not_found, too_large, unauthorized
from .generation import GenerationEngine, Sequence, SequenceEvent
from .metrics import Metrics
from .requests import GenerationRequest, parse_chat, parse_completion, parse_embeddings

__all__ = ["DEFAULT_MAX_BODY", "create_app"]

logger = logging.getLogger("ferrograph.server")

#: Largest request body accepted (bytes); larger ones get a 413.
DEFAULT_MAX_BODY = 8 << 20
#: The status logged for a request whose client left before the answer (nginx's convention).
CLIENT_CLOSED = 499
#: Bodies (and embedding answers) up to this many bytes / values are handled on the event loop;
#: larger ones on a worker thread.
_PARSE_INLINE = 64 << 10
#: Seconds between checks that a waiting (non-streaming) client is still connected.
_DISCONNECT_POLL = 0.25

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def _require_starlette() -> Any:
    try:
        import starlette  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "the server needs Starlette and uvicorn: pip install 'ferrograph[server]'"
        ) from e


class _AccessLog:
    """ASGI middleware: one log line and one metrics count per HTTP request."""

    def __init__(self, app: Any, metrics: Metrics, server: _Server) -> None:
        self.app = app
        self.metrics = metrics
        self.server = server
        """The models, batchers and counters behind the routes."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            self.metrics.count_request(path, status)
            client = scope.get("client") or ("-", 0)
            logger.info(
                "%s %s %s -> %d in %.1f ms",
                client[0],
                scope.get("method", ""),
                path,
                status,
                (time.perf_counter() - start) * 1e3,
            )


class _Server:
    """The state behind the routes: models, batchers, key, limits."""

    def __init__(
        self,
        embedding_model: Any,
        llm: Any,
        api_key: str | None,
        max_body: int,
        parallel: int,
        max_queue: int,
        embedding_max_batch: int,
        embedding_max_wait: float,
        profile: bool,
        embedding_id: str | None,
        llm_id: str | None,
    ) -> None:
        self.metrics = Metrics()
        self.api_key = api_key or None
        self.max_body = max_body
        self.profile = profile
        self.created = int(time.time())
        self.embedder: EmbeddingBatcher | None = None
        self.embedding_id: str | None = None
        self.max_input_chars = 0
        if embedding_model is not None:
            self.embedder = EmbeddingBatcher(
                embedding_model,
                self.metrics,
                max_batch=embedding_max_batch,
                max_wait=embedding_max_wait,
                max_queue=max(4 * embedding_max_batch, 2048),
                profile=profile,
            )
            self.embedding_id = embedding_id or Path(str(embedding_model.model_dir)).name
            # tokens are truncated at max_seq_length; a few characters per token at most
            self.max_input_chars = max(64 * int(embedding_model.max_seq_length), 1 << 16)
        self.engine: GenerationEngine | None = None
        self.llm_id: str | None = None
        if llm is not None:
            self.engine = GenerationEngine(
                llm, self.metrics, parallel=parallel, max_queue=max_queue, profile=profile
            )
            self.llm_id = llm_id or Path(str(llm.path)).stem
        self.llm = llm

    def close(self) -> None:
        if self.embedder is not None:
            self.embedder.close()
        if self.engine is not None:
            self.engine.close()

    @property
    def model_ids(self) -> list[str]:
        return [m for m in (self.embedding_id, self.llm_id) if m is not None]

    def check_key(self, headers: Any) -> None:
        if self.api_key is None:
            return
        header = str(headers.get("authorization", ""))
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            key.strip().encode(), self.api_key.encode()
        ):
            raise unauthorized()

    def check_model(self, model: str, wanted: str | None, kind: str) -> None:
        if model not in self.model_ids:
            raise model_not_found(model, self.model_ids)
        if model != wanted:
            raise bad_request(f"the model {model!r} cannot serve {kind}", "model")


async def _read_json(request: Any, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(f"the request body has {declared} bytes; at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"the request body is larger than {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        # a large body takes a while to parse: not on the event loop
        if len(raw) > _PARSE_INLINE:
            return await asyncio.to_thread(json.loads, raw)
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {type(e).__name__}") from None


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def create_app(
    embedding_model: Any = None,
    llm: Any = None,
    *,
    api_key: str | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    parallel: int = 4,
    max_queue: int = 64,
    embedding_max_batch: int = 64,
    embedding_max_wait: float = 0.005,
    profile: bool = False,
    embedding_id: str | None = None,
    llm_id: str | None = None,
) -> Any:
    """The server as an ASGI app (Starlette).

    Parameters
    ----------
    embedding_model:
        A :class:`ferrograph.models.SentenceEncoder` for ``/v1/embeddings`` (or ``None``).
    llm:
        A :class:`ferrograph.models.LLM` for the completions (or ``None``); the server owns its
        KV cache, split into ``parallel`` sequences of ``llm.n_ctx // parallel`` positions.
    api_key:
        When set, every route but ``/health`` needs ``Authorization: Bearer <api_key>``.
    max_body:
        Largest request body in bytes (413 beyond).
    parallel, max_queue:
        Generations decoded at once; generations waiting at most (429 beyond).
    embedding_max_batch, embedding_max_wait:
        Sentences per encoder call at most; seconds a batch waits for more requests.
    profile:
        Time every graph node of both models; ``GET /profile`` prints the per-op sums.
    embedding_id, llm_id:
        The models' ids in requests and ``/v1/models`` (default: the embedding model's
        directory name, the GGUF file's stem).
    """
    _require_starlette()
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    state = _Server(
        embedding_model,
        llm,
        api_key,
        max_body,
        parallel,
        max_queue,
        embedding_max_batch,
        embedding_max_wait,
        profile,
        embedding_id,
        llm_id,
    )

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": state.model_ids})

    async def metrics(request: Request) -> Response:
        state.check_key(request.headers)
        gauges: dict[str, float] = {}
        if state.embedder is not None:
            gauges["ferrograph_embedding_queue_sentences"] = state.embedder.queue_depth
        if state.engine is not None:
            gauges["ferrograph_generation_queue_requests"] = state.engine.queue_depth
            gauges["ferrograph_generation_active_sequences"] = state.engine.active
        return PlainTextResponse(state.metrics.render(gauges))

    async def profile_route(request: Request) -> Response:
        state.check_key(request.headers)
        if not state.profile:
            raise APIError(
                404, "profiling is off (start the server with --profile)", "invalid_request_error"
            )
        parts = []
        for name, source in (("embeddings", state.embedder), ("generation", state.engine)):
            if source is not None and source.profile is not None:
                parts.append(f"{name}:\n{source.profile.table(20)}")
        return PlainTextResponse("\n\n".join(parts) or "nothing computed yet\n")

    async def models(request: Request) -> Response:
        state.check_key(request.headers)
        data = [
            {"id": m, "object": "model", "created": state.created, "owned_by": "ferrograph"}
            for m in state.model_ids
        ]
        return JSONResponse({"object": "list", "data": data})

    async def embeddings(request: Request) -> Response:
        state.check_key(request.headers)
        body = await _read_json(request, state.max_body)
        req = parse_embeddings(body, max(state.max_input_chars, 1))
        state.check_model(req.model, state.embedding_id, "embeddings")
        assert state.embedder is not None
        dim = int(embedding_model.dim)
        if req.dimensions is not None and req.dimensions > dim:
            raise bad_request(
                f"'dimensions' is {req.dimensions}; this model's embeddings have {dim}",
                "dimensions",
            )
        rows, counts = await state.embedder.embed(req.inputs)

        def answer() -> bytes:
            vectors = np.asarray(rows, dtype=np.float32)
            if req.dimensions is not None and req.dimensions < dim:
                vectors = vectors[:, : req.dimensions]
                if embedding_model.normalize:
                    norms = np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
                    vectors = (vectors / norms).astype(np.float32)
            data = []
            for i, row in enumerate(vectors):
                vector: Any
                if req.encoding_format == "base64":
                    vector = base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
                else:
                    vector = row.tolist()
                data.append({"object": "embedding", "index": i, "embedding": vector})
            tokens = int(np.sum(counts))
            body = {
                "object": "list",
                "data": data,
                "model": req.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
            return json.dumps(body, separators=(",", ":")).encode()

        # many vectors take a while to write out: not on the event loop
        content = await asyncio.to_thread(answer) if rows.size > _PARSE_INLINE else answer()
        return Response(content, media_type="application/json")

    def start(req: GenerationRequest, prompt: list[int], param: str) -> Sequence:
        assert state.engine is not None
        try:
            params = SamplingParams(
                temperature=req.temperature,
                top_k=req.top_k,
                top_p=req.top_p,
                min_p=req.min_p,
                repeat_penalty=req.repeat_penalty,
                frequency_penalty=req.frequency_penalty,
                presence_penalty=req.presence_penalty,
                seed=req.seed,
            )
        except ValueError as e:
            raise bad_request(str(e)) from None
        return state.engine.submit(
            prompt, req.max_tokens, params, req.stop, param, ignore_eos=req.ignore_eos
        )

    def prompt_ids(req: GenerationRequest) -> tuple[list[int], str]:
        if req.messages is not None:
            try:
                text = llm.apply_chat_template(req.messages)
            except Exception as e:  # the template refused the conversation
                raise bad_request(str(e), "messages") from None
            return llm.tokenize(text, add_special=True, parse_special=True), "messages"
        if isinstance(req.prompt, str):
            return llm.tokenize(req.prompt, add_special=True, parse_special=True), "prompt"
        assert req.prompt is not None
        try:
            return llm.tokenizer.check_ids(req.prompt), "prompt"
        except Exception as e:
            raise bad_request(str(e), "prompt") from None

    async def collect(request: Request, seq: Sequence) -> tuple[str, str, int] | None:
        """Waits for the whole text; a client that leaves cancels the sequence (``None``)."""
        pieces = []
        checked = time.monotonic()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(seq.events.get(), _DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    event = None
                # tokens may come faster than the poll: check by the clock, not on timeouts
                if time.monotonic() - checked >= _DISCONNECT_POLL:
                    if await request.is_disconnected():
                        return None
                    checked = time.monotonic()
                if event is None:
                    continue
                if event.error is not None:
                    raise event.error
                pieces.append(event.text)
                if event.finish_reason is not None:
                    return "".join(pieces), event.finish_reason, event.completion_tokens
        finally:
            if not seq.finished:
                seq.cancel()
                assert state.engine is not None
                state.engine.wake()

    async def events(seq: Sequence) -> AsyncIterator[SequenceEvent]:
        try:
            while True:
                event = await seq.events.get()
                yield event
                if event.error is not None or event.finish_reason is not None:
                    return
        finally:
            if not seq.finished:
                seq.cancel()
                assert state.engine is not None
                state.engine.wake()

    def sse(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def generate(request: Request, chat: bool) -> Response:
        state.check_key(request.headers)
        body = await _read_json(request, state.max_body)
        req = parse_chat(body) if chat else parse_completion(body)
        state.check_model(req.model, state.llm_id, "chat completions" if chat else "completions")
        # tokenizing a long prompt takes a while: not on the event loop
        prompt, param = await asyncio.to_thread(prompt_ids, req)
        seq = start(req, prompt, param)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        head = {"id": ident, "created": created, "model": req.model}
        if not req.stream:
            collected = await collect(request, seq)
            if collected is None:  # nobody reads the answer: nginx's "client closed request"
                return Response(status_code=CLIENT_CLOSED)
            text, reason, n_generated = collected
            usage = _usage(len(prompt), n_generated)
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": reason,
                    "logprobs": None,
                }
                return JSONResponse(
                    {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
                )
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
            return JSONResponse(
                {**head, "object": "text_completion", "choices": [choice], "usage": usage}
            )

        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, reason: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                c: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
            else:
                c = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
            return {**head, "object": kind, "choices": [c]}

        async def stream() -> AsyncIterator[str]:
            if chat:
                yield sse(chunk("", None, role=True))
            async for event in events(seq):
                if event.error is not None:
                    yield sse(event.error.body())
                    return
                if event.finish_reason is None:
                    yield sse(chunk(event.text, None))
                    continue
                if event.text:
                    yield sse(chunk(event.text, None))
                yield sse(chunk(None if chat else "", event.finish_reason))
                if req.include_usage:
                    usage = _usage(len(prompt), event.completion_tokens)
                    yield sse({**head, "object": kind, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        if exc.status == 429:
            headers = {"Retry-After": "1"}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        error = APIError(exc.status_code, str(exc.detail), "invalid_request_error")
        return JSONResponse(error.body(), status_code=exc.status_code)

    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error on %s", request.url.path)
        error = APIError(500, f"internal error: {type(exc).__name__}", "server_error")
        return JSONResponse(error.body(), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await asyncio.to_thread(state.close)

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/profile", profile_route, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ],
        exception_handlers={
            APIError: api_error,
            HTTPException: http_error,
            Exception: internal_error,
        },
        lifespan=lifespan,
    )
    return _AccessLog(app, state.metrics, state)
