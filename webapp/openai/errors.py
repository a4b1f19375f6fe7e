"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with headers
that tell OpenAI's clients whether, and when, to retry.

openai-python (and the clients modelled on it) retries 408, 409, 429 and every 5xx twice by
default, and honours ``x-should-retry``, ``retry-after-ms`` and ``Retry-After``. So a refusal a
retry can fix (a full queue, a tenant over its quota, no live worker yet, Redis away) says when
to come back, and every other error says ``x-should-retry: false``: an overloaded fleet must
not get three times its load, and a model that failed on an input fails on it again.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from rstreamer.errors import (
    NoLiveWorker,
    Overloaded,
    RateLimited,
    RemoteError,
    StreamerTimeout,
)

from .. import protocol

Headers = dict[str, str]

INVALID_INPUT_TYPES = frozenset({"InvalidInput"})
"""Remote error types of an input the model refuses (rstreamer's InvalidInput, which the chat model
raises): the request is wrong, a 400."""
_CONTEXT = re.compile(r"model's context (is|of) \d+ tokens")
"""How the chat model says a prompt (plus max_tokens) does not fit its context window."""
RETRY_AFTER_S = 1.0
"""When to retry a 503 that says no more (a full queue, no live worker yet, Redis away)."""
_RETRYABLE = (Overloaded, NoLiveWorker)
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 429: "requests"}


class OpenAIError(Exception):
    """An error the ``/v1`` routes answer themselves, already in OpenAI's terms."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 for a request OpenAI's API would refuse too."""
    return OpenAIError(400, message, "invalid_request_error", param, code)


def not_found(message: str, code: str = "not_found", param: str | None = None) -> OpenAIError:
    """A 404 (an unknown model, file or batch)."""
    return OpenAIError(404, message, "invalid_request_error", param, code)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def as_openai(exc: BaseException) -> OpenAIError:
    """The OpenAIError that answers ``exc`` (any error of a ``/v1`` route)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RemoteError) and (exc.remote_type in INVALID_INPUT_TYPES or exc.http_status == 400):
        return _refused_input(exc)
    status, rstreamer_type, message = protocol.describe(exc)
    if isinstance(exc, RemoteError):
        message = exc.remote_message  # the model's own message; the input's index is the caller's business
    error_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    code = "rate_limit_exceeded" if isinstance(exc, RateLimited) else _snake(rstreamer_type)
    return OpenAIError(status, message, error_type, None, code)


def _refused_input(exc: RemoteError) -> OpenAIError:
    if _CONTEXT.search(exc.remote_message):
        return bad_request(exc.remote_message, "messages", "context_length_exceeded")
    param = re.search(r"'(\w+)'", exc.remote_message)  # the chat model names the field it refuses
    return bad_request(exc.remote_message, param.group(1) if param else None, "invalid_value")


def retry_headers(exc: BaseException, status: int) -> Headers:
    """``Retry-After``/``retry-after-ms`` where a retry can succeed later, else ``x-should-retry: false``."""
    if isinstance(exc, RateLimited):
        return _after(exc.retry_after)
    if isinstance(exc, _RETRYABLE) or (status == 503 and not isinstance(exc, StreamerTimeout)):
        return _after(RETRY_AFTER_S)
    return {"x-should-retry": "false"}


def _after(seconds: float) -> Headers:
    # Retry-After in whole seconds (RFC 9110), never 0: "now" would only be refused again.
    return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, math.ceil(seconds * 1000)))}


def error_body(error: OpenAIError) -> dict[str, Any]:
    """The JSON document of an error."""
    return {"error": {"message": error.message, "type": error.error_type, "param": error.param, "code": error.code}}


def error_reply(exc: BaseException) -> tuple[int, bytes, Headers]:
    """Status, body and headers answering ``exc``."""
    error = as_openai(exc)
    return error.status, protocol.dumps(error_body(error)), retry_headers(exc, error.status)


def http_error(status: int, message: str) -> tuple[int, bytes, Headers]:
    """The reply to a request no route takes (404, 405...), under ``/v1``."""
    return error_reply(OpenAIError(status, message, _TYPES.get(status, "server_error" if status >= 500 else
                                                               "invalid_request_error"),
                                   code=_snake(protocol.http_error(status, message).error_type)))


def error_event(exc: BaseException) -> bytes:
    """The SSE event that ends a stream that failed after it started (openai-python raises
    ``APIError`` with it)."""
    return b"data: " + json.dumps(error_body(as_openai(exc)), separators=(",", ":")).encode() + b"\n\n"
