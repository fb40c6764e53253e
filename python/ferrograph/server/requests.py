"""Request bodies read and checked field by field.

Each ``parse_*`` function takes the decoded JSON body and returns a frozen dataclass, or raises
:func:`~ferrograph.server.errors.bad_request` naming the field that is wrong (its ``param``).
Unknown fields are ignored, as OpenAI's API does for fields it does not use (``user``, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..models.tokenization import unicode_problem
from .errors import APIError, bad_request

__all__ = [
    "MAX_EMBEDDING_INPUTS",
    "MAX_STOP_STRINGS",
    "EmbeddingRequest",
    "GenerationRequest",
    "parse_chat",
    "parse_completion",
    "parse_embeddings",
]

#: Inputs one embeddings request may carry (OpenAI's limit).
MAX_EMBEDDING_INPUTS = 2048
#: Stop strings one request may carry (OpenAI's limit).
MAX_STOP_STRINGS = 4
#: Characters of one stop string at most.
MAX_STOP_LENGTH = 256


@dataclass(frozen=True)
class EmbeddingRequest:
    """``POST /v1/embeddings``."""

    model: str
    inputs: list[str]
    encoding_format: str
    dimensions: int | None


@dataclass(frozen=True)
class GenerationRequest:
    """``POST /v1/completions`` and ``POST /v1/chat/completions``: the prompt (text, or token
    ids) or the chat messages, and the sampling settings."""

    model: str
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repeat_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string", "model")
    return model


def _number(
    body: dict[str, Any], name: str, default: float, low: float, high: float, low_open: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number", name)
    if value < low or value > high or (low_open and value == low):
        left = "(" if low_open else "["
        raise bad_request(f"'{name}' must be in {left}{low}, {high}], got {value}", name)
    return float(value)


def _integer(
    body: dict[str, Any], name: str, default: int | None, low: int, high: int
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer", name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be in [{low}, {high}], got {value}", name)
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false", name)
    return value


def _unicode(text: str, param: str, label: str) -> str:
    """``text``, checked to be valid Unicode (:func:`unicode_problem`: JSON's ``\\ud800``
    escapes decode to lone surrogates, which no tokenizer and no UTF-8 reply can carry)."""
    problem = unicode_problem(text)
    if problem is not None:
        raise bad_request(f"'{label}' is not valid Unicode text ({problem})", param)
    return text


def parse_embeddings(raw: Any, max_input_chars: int) -> EmbeddingRequest:
    """``input`` is a string or a list of 1 to :data:`MAX_EMBEDDING_INPUTS` strings, none
    longer than ``max_input_chars`` nor empty; ``encoding_format`` ``float`` or ``base64``."""
    body = _require_object(raw)
    model = _model(body)
    value = body.get("input")
    inputs: list[str]
    if isinstance(value, str):
        inputs = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        inputs = list(value)
    elif isinstance(value, list) and value and all(isinstance(v, (int, list)) for v in value):
        raise bad_request("token-id inputs are not supported: send the text", "input")
    else:
        raise bad_request("'input' must be a string or a non-empty list of strings", "input")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise bad_request(
            f"'input' has {len(inputs)} items; at most {MAX_EMBEDDING_INPUTS} per request", "input"
        )
    for i, text in enumerate(inputs):
        if not text:
            raise bad_request(f"'input[{i}]' is an empty string", "input")
        _unicode(text, "input", f"input[{i}]")
        if len(text) > max_input_chars:
            raise APIError(
                413,
                f"'input[{i}]' has {len(text)} characters; at most {max_input_chars}",
                "invalid_request_error",
                "input",
                "request_too_large",
            )
    encoding = body.get("encoding_format", "float")
    if encoding is None:
        encoding = "float"
    if encoding not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dimensions = _integer(body, "dimensions", None, 1, 1 << 20)
    return EmbeddingRequest(model, inputs, str(encoding), dimensions)


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS}", "stop")
    if any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise bad_request(f"a stop string is longer than {MAX_STOP_LENGTH} characters", "stop")
    return [_unicode(s, "stop", f"stop[{i}]") for i, s in enumerate(stops)]


def _sampling(body: dict[str, Any], max_tokens_names: tuple[str, ...]) -> dict[str, Any]:
    n = _integer(body, "n", 1, 1, 1 << 20)
    if n != 1:
        raise bad_request("only 'n' = 1 is supported", "n")
    if body.get("logprobs") not in (None, False, 0):
        raise bad_request("'logprobs' is not supported", "logprobs")
    if body.get("echo") not in (None, False):
        raise bad_request("'echo' is not supported", "echo")
    if body.get("logit_bias"):
        raise bad_request("'logit_bias' is not supported", "logit_bias")
    if body.get("best_of") not in (None, 1):
        raise bad_request("only 'best_of' = 1 is supported", "best_of")
    max_tokens = None
    for name in max_tokens_names:
        value = _integer(body, name, None, 0, 1 << 24)
        if value is not None:
            max_tokens = value
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = _flag(options, "include_usage")
    seed = _integer(body, "seed", None, -(1 << 63), (1 << 64) - 1)
    return {
        "max_tokens": max_tokens,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        "top_k": _integer(body, "top_k", 40, 0, 1 << 20),
        "min_p": _number(body, "min_p", 0.05, 0.0, 1.0),
        "repeat_penalty": _number(body, "repeat_penalty", 1.0, 0.0, 10.0, low_open=True),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "seed": None if seed is None else seed % (1 << 64),
        "stop": _stop(body),
        "stream": stream,
        "include_usage": include_usage and stream,
        "ignore_eos": _flag(body, "ignore_eos"),
    }


def parse_completion(raw: Any) -> GenerationRequest:
    """``prompt``: a string, a list of one string, or a list of token ids."""
    body = _require_object(raw)
    model = _model(body)
    value = body.get("prompt")
    prompt: str | list[int]
    if isinstance(value, str):
        prompt = _unicode(value, "prompt", "prompt")
    elif isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        prompt = _unicode(value[0], "prompt", "prompt")
    elif (
        isinstance(value, list)
        and value
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        prompt = list(value)
    elif isinstance(value, list) and len(value) > 1:
        raise bad_request("one prompt per request ('n' = 1): send a single string", "prompt")
    else:
        raise bad_request("'prompt' must be a string or a list of token ids", "prompt")
    if body.get("suffix") not in (None, ""):
        raise bad_request("'suffix' is not supported", "suffix")
    return GenerationRequest(model, prompt, None, **_sampling(body, ("max_tokens",)))


def _content(value: Any, index: int) -> str:
    return _unicode(_content_text(value, index), "messages", f"messages[{index}].content")


def _content_text(value: Any, index: int) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(
                    f"'messages[{index}].content' parts must be of type 'text'", "messages"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"'messages[{index}].content' text must be a string", "messages")
            parts.append(text)
        return "".join(parts)
    raise bad_request(f"'messages[{index}].content' must be a string or text parts", "messages")


def parse_chat(raw: Any) -> GenerationRequest:
    """``messages``: a non-empty list of ``{"role", "content"}`` objects (content a string or a
    list of text parts); ``max_completion_tokens`` is read as ``max_tokens``."""
    body = _require_object(raw)
    model = _model(body)
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list", "messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad_request(f"'messages[{i}]' must be an object", "messages")
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"'messages[{i}].role' {role!r} is not a known role", "messages")
        # the chat templates of small models know "system", not OpenAI's newer "developer"
        messages.append(
            {
                "role": "system" if role == "developer" else str(role),
                "content": _content(message.get("content"), i),
            }
        )
    if body.get("tools") or body.get("functions"):
        raise bad_request("tool calls are not supported", "tools")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_request("only the 'text' response_format is supported", "response_format")
    sampling = _sampling(body, ("max_tokens", "max_completion_tokens"))
    return GenerationRequest(model, None, messages, **sampling)
