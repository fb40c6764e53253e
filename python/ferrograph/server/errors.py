"""The OpenAI error object and the HTTP status of each kind of failure.

Every failure a client can cause becomes an :class:`APIError`, which the app turns into
``{"error": {"message", "type", "param", "code"}}`` with its status: the shape the ``openai``
package parses into ``BadRequestError`` (400), ``AuthenticationError`` (401),
``NotFoundError`` (404), ``APIStatusError`` (413), ``RateLimitError`` (429) and
``InternalServerError`` (503).
"""

from __future__ import annotations

from typing import Any

import ferrograph as fg

__all__ = [
    "APIError",
    "bad_request",
    "model_not_found",
    "overloaded",
    "too_large",
    "unauthorized",
]


class APIError(fg.Error):
    """A request the server answers with an OpenAI error object and ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body: OpenAI's error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> APIError:
    """400: the request is malformed; ``param`` names the offending field."""
    return APIError(400, message, "invalid_request_error", param, None)


def unauthorized() -> APIError:
    """401: a missing or wrong API key."""
    return APIError(
        401,
        "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
        "invalid_request_error",
        None,
        "invalid_api_key",
    )


def model_not_found(model: str, served: list[str]) -> APIError:
    """404: no served model has this name."""
    return APIError(
        404,
        f"The model {model!r} does not exist on this server "
        f"(served: {', '.join(served) or 'none'})",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def too_large(message: str, param: str | None = None) -> APIError:
    """413: the body, or one of its parts, is larger than the server accepts."""
    return APIError(413, message, "invalid_request_error", param, "request_too_large")


def overloaded(message: str, status: int = 503) -> APIError:
    """429 or 503: the queue is full; the client may retry later."""
    return APIError(status, message, "server_error", None, "server_overloaded")
