"""What the Flask and the Starlette apps share: request parsing, JSON bodies, error statuses, readiness.

Both apps are thin adapters around these functions, so they answer the same inputs with the
same statuses and bodies.
"""
from __future__ import annotations

import http
import json
import logging
from typing import Any
from urllib.parse import parse_qs

import redis

from rstreamer.errors import BrokerUnavailable, RemoteError, RStreamerError
from rstreamer.liveness import live_workers

logger = logging.getLogger(__name__)

JSON = "application/json"
FORM = "application/x-www-form-urlencoded"
FORM_FIELD = "s"
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


def http_error(status: int, message: str) -> HTTPError:
    """An error named after its status: 404 is ``NotFound``, 405 ``MethodNotAllowed``."""
    return HTTPError(status, http.HTTPStatus(status).phrase.replace(" ", ""), message)


def bad_request(message: str) -> HTTPError:
    return HTTPError(400, "BadRequest", message)


def too_large(limit: int) -> HTTPError:
    return HTTPError(413, "PayloadTooLarge", f"request body over the limit of {limit} bytes")


def parse_inputs(content_type: str | None, body: bytes) -> list[Any]:
    """The inputs of a ``/predict`` body: JSON ``{"inputs": [...]}`` or form fields ``s=...``."""
    mimetype = (content_type or "").split(";", 1)[0].strip().lower()
    if mimetype == JSON or mimetype.endswith("+json"):
        return _json_inputs(body)
    if _looks_like_json(body):
        # curl -d '{"inputs": ...}' sends a form type, and a bare client none: say what to change.
        raise bad_request(f"the body looks like JSON but its Content-Type is {mimetype or 'missing'}: "
                          f"send it with Content-Type: {JSON} (curl -H 'Content-Type: {JSON}')")
    if mimetype == FORM:
        return _form_inputs(body)
    raise bad_request(f'send {JSON} {{"inputs": [...]}} or {FORM} fields {FORM_FIELD}=..., not {mimetype or "no type"}')


def _looks_like_json(body: bytes) -> bool:
    return body.lstrip()[:1] in (b"{", b"[")


def _json_inputs(body: bytes) -> list[Any]:
    try:
        document = json.loads(body)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both
        raise bad_request(f"body is not valid JSON: {exc}") from None
    except RecursionError:  # the parser recurses once per level: thousands of [[[[ exhaust the stack
        raise bad_request("body is JSON nested too deeply (arrays or objects thousands of levels deep)") from None
    if not isinstance(document, dict) or "inputs" not in document:
        raise bad_request('expected a JSON object {"inputs": [...]}')
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
    status, error_type, message = _describe(exc)
    headers = {"Retry-After": RETRY_AFTER} if status == 503 else {}
    return status, dumps({"error": {"type": error_type, "message": message}}), headers


def _describe(exc: BaseException) -> tuple[int, str, str]:
    if isinstance(exc, HTTPError):
        return exc.status, exc.error_type, str(exc)
    if isinstance(exc, RemoteError):
        # The model's own exception type and message; its traceback stays in the worker's log.
        return exc.http_status, exc.remote_type, exc.remote_message
    if isinstance(exc, (BrokerUnavailable, redis.RedisError)):
        # The detail names internal hosts: log it, do not send it.
        logger.warning("predict: broker error: %s", exc)
        return 503, "BrokerUnavailable", "the queue is unreachable; retry later"
    if isinstance(exc, RStreamerError):
        return exc.http_status, type(exc).__name__, str(exc)
    logger.error("predict: unexpected error", exc_info=exc)
    return 500, "InternalServerError", "internal error"


def readiness(now_ms: int, workers: dict[str, dict[str, Any]], dead_after: float, prefix: str) -> tuple[int, bytes]:
    """200 when at least one worker heart-beat on ``prefix`` within ``dead_after`` seconds, else 503."""
    live = len(live_workers(now_ms, workers, int(dead_after * 1000)))
    if live:
        return 200, dumps({"ready": True, "prefix": prefix, "live_workers": live})
    return 503, dumps({"ready": False, "prefix": prefix, "live_workers": 0,
                       "reason": f"no live worker serves prefix {prefix!r}"})


def unready(exc: BaseException, prefix: str) -> tuple[int, bytes]:
    """The 503 of ``/readyz`` when Redis does not answer."""
    logger.warning("readyz: Redis unreachable: %s", exc)
    return 503, dumps({"ready": False, "prefix": prefix, "live_workers": 0, "reason": "Redis unreachable"})
