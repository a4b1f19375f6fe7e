"""What the Flask and the Starlette apps share: request parsing, JSON bodies, error statuses, readiness.

Both apps are thin adapters around these functions, so they answer the same inputs with the
same statuses and bodies.
"""
from __future__ import annotations

import http
import json
import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import parse_qs

import redis

from rstreamer.batching.priority import MAX_LEVELS
from rstreamer.batching.quotas import check_tenant
from rstreamer.errors import BrokerUnavailable, ConfigError, RateLimited, RemoteError, RStreamerError
from rstreamer.wire.published import live_workers

logger = logging.getLogger(__name__)

JSON = "application/json"
FORM = "application/x-www-form-urlencoded"
FORM_FIELD = "s"
PRIORITY_HEADER = "X-Priority"
TENANT_HEADER = "X-Tenant"
# Seconds a client should wait before retrying a 503: long enough for a queue to drain a batch.
RETRY_AFTER = "1"
# /readyz must answer fast when Redis is away, so its client neither waits long nor retries.
PROBE_TIMEOUT = 1.0

Headers = dict[str, str]


class HTTPError(Exception):
    """A request the web app refuses itself, before any call to the workers."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type

    @property
    def http_status(self) -> int:
        """The status, under the name rstreamer's errors give it (metrics read the outcome from it)."""
        return self.status


def http_error(status: int, message: str) -> HTTPError:
    """An error named after its status: 404 is ``NotFound``, 405 ``MethodNotAllowed``."""
    return HTTPError(status, http.HTTPStatus(status).phrase.replace(" ", ""), message)


def bad_request(message: str) -> HTTPError:
    return HTTPError(400, "BadRequest", message)


def too_large(limit: int) -> HTTPError:
    return HTTPError(413, "PayloadTooLarge", f"request body over the limit of {limit} bytes")


class RequestHeaders(Protocol):
    """The headers of a request, as Flask's and Starlette's requests both give them (case-insensitive)."""

    def get(self, key: str, /) -> str | None: ...


@dataclass(frozen=True)
class CallRequest:
    """What a ``/predict`` request asks for: its inputs and how to queue them."""

    inputs: list[Any]
    priority: int = 0
    tenant: str | None = None


def parse_call(content_type: str | None, body: bytes, headers: RequestHeaders) -> CallRequest:
    """The call a ``/predict`` request makes: inputs as :func:`parse_inputs` reads them; the
    priority level from ``"priority"`` in a JSON body or the ``X-Priority`` header (0, the most
    urgent, by default; both given must agree); the tenant whose quota it takes from ``X-Tenant``
    (none: no quota)."""
    document = _json_document(body) if _is_json(content_type) else {}
    inputs = _inputs_of(document) if _is_json(content_type) else parse_inputs(content_type, body)
    return CallRequest(inputs, *call_options(document.get("priority"), headers))


def call_options(in_body: Any, headers: RequestHeaders) -> tuple[int, str | None]:
    """The priority level and tenant of a call (``/predict`` and ``/generate`` alike): the level
    from ``in_body`` (the body's ``"priority"``, None when absent) or the ``X-Priority`` header,
    0 by default, both given must agree; the tenant from ``X-Tenant`` (None: no quota).
    HTTPError 400 says what is wrong."""
    return _priority(in_body, headers.get(PRIORITY_HEADER)), request_tenant(headers)


def request_tenant(headers: RequestHeaders) -> str | None:
    """The tenant a request names in ``X-Tenant`` (None: none); HTTPError 400 for an invalid name."""
    return _tenant(headers.get(TENANT_HEADER))


def _tenant(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return check_tenant(value.strip())
    except ConfigError as exc:
        raise bad_request(f"{TENANT_HEADER}: {exc}") from None


def _priority(in_body: Any, in_header: str | None) -> int:
    values = []
    if in_body is not None:
        if not isinstance(in_body, int) or isinstance(in_body, bool):
            raise bad_request(f'"priority" must be an integer, got {in_body!r}')
        values.append(in_body)
    if in_header is not None:
        try:
            values.append(int(in_header.strip()))
        except ValueError:
            raise bad_request(f"{PRIORITY_HEADER} must be an integer, got {in_header!r}") from None
    if len(set(values)) > 1:
        raise bad_request(f'"priority" {values[0]} and {PRIORITY_HEADER} {values[1]} disagree')
    priority = values[0] if values else 0
    if not 0 <= priority < MAX_LEVELS:
        raise bad_request(f"priority must be from 0 (most urgent) to {MAX_LEVELS - 1}, got {priority}")
    return priority


def _is_json(content_type: str | None) -> bool:
    mimetype = (content_type or "").split(";", 1)[0].strip().lower()
    return mimetype == JSON or mimetype.endswith("+json")


def parse_inputs(content_type: str | None, body: bytes) -> list[Any]:
    """The inputs of a ``/predict`` body: JSON ``{"inputs": [...]}`` or form fields ``s=...``."""
    mimetype = (content_type or "").split(";", 1)[0].strip().lower()
    if _is_json(content_type):
        return _inputs_of(_json_document(body))
    if _looks_like_json(body):
        # curl -d '{"inputs": ...}' sends a form type, and a bare client none: say what to change.
        raise bad_request(f"the body looks like JSON but its Content-Type is {mimetype or 'missing'}: "
                          f"send it with Content-Type: {JSON} (curl -H 'Content-Type: {JSON}')")
    if mimetype == FORM:
        return _form_inputs(body)
    raise bad_request(f'send {JSON} {{"inputs": [...]}} or {FORM} fields {FORM_FIELD}=..., not {mimetype or "no type"}')


def _looks_like_json(body: bytes) -> bool:
    return body.lstrip()[:1] in (b"{", b"[")


def json_body(body: bytes) -> Any:
    """The JSON value of a request body; a body that is not JSON is a 400 (never a 500)."""
    try:
        return json.loads(body)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both
        raise bad_request(f"body is not valid JSON: {exc}") from None
    except RecursionError:  # the parser recurses once per level: thousands of [[[[ exhaust the stack
        raise bad_request("body is JSON nested too deeply (arrays or objects thousands of levels deep)") from None


def _json_document(body: bytes) -> dict[str, Any]:
    document = json_body(body)
    if not isinstance(document, dict) or "inputs" not in document:
        raise bad_request('expected a JSON object {"inputs": [...]}')
    return document


def _inputs_of(document: dict[str, Any]) -> list[Any]:
    inputs = document["inputs"]
    if not isinstance(inputs, list):
        raise bad_request(f'"inputs" must be a list, got {type(inputs).__name__}')
    return inputs


def _form_inputs(body: bytes) -> list[Any]:
    try:
        fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, errors="strict")
    except UnicodeError:
        raise bad_request("form body is not valid UTF-8 url-encoding") from None
    inputs = fields.get(FORM_FIELD)
    if not inputs:
        raise bad_request(f"missing inputs: send one form field {FORM_FIELD}=... per input")
    return inputs


def dumps(document: Any) -> bytes:
    """``document`` as JSON; numpy arrays and tensors become lists."""
    return json.dumps(document, default=_to_json, separators=(",", ":")).encode()


def _to_json(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset)):  # the codec keeps sets; JSON has only arrays
        return list(value)
    raise HTTPError(500, "UnserializableOutput",
                    f"the model returned a {type(value).__name__}, which JSON cannot carry")


def outputs_body(outputs: list[Any]) -> bytes:
    return dumps({"outputs": outputs})


def error_reply(exc: BaseException) -> tuple[int, bytes, Headers]:
    """Status, JSON body ``{"error": {"type", "message"}}`` and headers answering ``exc``."""
    status, error_type, message = describe(exc)
    headers = {"Retry-After": RETRY_AFTER} if status == 503 else {}
    if isinstance(exc, RateLimited):  # whole seconds (RFC 9110), never 0: "now" would only be refused again
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
    error: dict[str, Any] = {"type": error_type, "message": message}
    if isinstance(exc, RemoteError) and exc.index is not None:
        error["input"] = exc.index  # the failed input's position in the request's "inputs"
    return status, dumps({"error": error}), headers


def describe(exc: BaseException) -> tuple[int, str, str]:
    """The status, error type and message that answer ``exc`` (the OpenAI routes reshape them)."""
    if isinstance(exc, HTTPError):
        return exc.status, exc.error_type, str(exc)
    if isinstance(exc, RemoteError):
        # The model's own exception type and message, naming the input by its index in the
        # request (InvalidInput: 400); the traceback stays in the worker's log.
        where = f"input {exc.index}: " if exc.index is not None else ""
        return exc.http_status, exc.remote_type, f"{where}{exc.remote_message}"
    if isinstance(exc, (BrokerUnavailable, redis.RedisError)):
        # The detail names internal hosts: log it, do not send it.
        logger.warning("predict: broker error: %s", exc)
        return 503, "BrokerUnavailable", "the queue is unreachable; retry later"
    if isinstance(exc, RStreamerError):
        return exc.http_status, type(exc).__name__, str(exc)
    logger.error("predict: unexpected error", exc_info=exc)
    return 500, "InternalServerError", "internal error"


def readiness(now_ms: int, workers: dict[str, dict[str, Any]], dead_after: float, prefix: str,
              cold_start_wait: float = 0.0) -> tuple[int, bytes]:
    """200 when at least one worker heart-beat on ``prefix`` within ``dead_after`` seconds, else 503.

    With a cold-start wait (``cold_start_wait`` > 0) the app is ready without a live worker: a call
    then waits, enqueued, for one to start (an autoscaler wakes the fleet from zero on that very
    item), so a fleet at zero must not take the web pods out of their Service.
    """
    live = len(live_workers(now_ms, workers, int(dead_after * 1000)))
    if live:
        return 200, dumps({"ready": True, "prefix": prefix, "live_workers": live})
    if cold_start_wait > 0:
        return 200, dumps({"ready": True, "prefix": prefix, "live_workers": 0,
                           "cold_start": f"calls wait up to {cold_start_wait:g}s for a worker to start"})
    return 503, dumps({"ready": False, "prefix": prefix, "live_workers": 0,
                       "reason": f"no live worker serves prefix {prefix!r}"})


def unready(exc: BaseException, prefix: str) -> tuple[int, bytes]:
    """The 503 of ``/readyz`` when Redis does not answer."""
    logger.warning("readyz: Redis unreachable: %s", exc)
    return 503, dumps({"ready": False, "prefix": prefix, "live_workers": 0, "reason": "Redis unreachable"})
