"""What the Flask and the Starlette apps share for durable jobs: ``POST /jobs``, ``GET /jobs/<id>``,
``DELETE /jobs/<id>``. Request parsing and response bodies only; the apps do the I/O.

``POST /jobs`` takes ``{"inputs": [...], "ttl": seconds?, "meta": any?, "webhook": url?}`` (``ttl`` at most 30
days) and an optional ``X-Tenant`` header (whose quota and fair share the items take, as for ``/predict``), and
answers 202 with ``{"job_id", "status_url"}`` and a ``Location`` header. ``GET /jobs/<id>?start=0&count=1000``
answers the job's status and counters and, once it has finished, one page of its outputs
(``{"index", "output"}`` or ``{"index", "error": {"type", "message"}}``) with the URL of the next
page; ``count=0`` answers the status alone. An unknown or expired id is a 404.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rstreamer.errors import RemoteError
from rstreamer.jobs.core import JobInfo, JobItem, check_webhook
from rstreamer.settings import MAX_JOB_TTL

from .protocol import JSON, RequestHeaders, bad_request, dumps, json_body, request_tenant

MAX_PAGE = 1000
"""Most outputs one ``GET /jobs/<id>`` returns."""


@dataclass(frozen=True)
class JobRequest:
    """A parsed ``POST /jobs`` body."""

    inputs: list[Any]
    ttl: float | None = None
    meta: Any = None
    webhook: str | None = None
    tenant: str | None = None


def parse_job_request(content_type: str | None, body: bytes, headers: RequestHeaders) -> JobRequest:
    """The job a ``POST /jobs`` request asks for (the tenant from ``X-Tenant``); raises a 400
    HTTPError for anything else."""
    mimetype = (content_type or "").split(";", 1)[0].strip().lower()
    if mimetype != JSON and not mimetype.endswith("+json"):
        raise bad_request(f'send {JSON} {{"inputs": [...]}}, not {mimetype or "no type"}')
    document = json_body(body)
    if not isinstance(document, dict) or not isinstance(document.get("inputs"), list):
        raise bad_request('expected a JSON object {"inputs": [...]}')
    unknown = set(document) - {"inputs", "ttl", "meta", "webhook"}
    if unknown:
        raise bad_request(f"unknown fields {sorted(unknown)}: a job takes inputs, ttl, meta and webhook")
    webhook = document.get("webhook")
    try:
        check_webhook(webhook)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    ttl = document.get("ttl")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl)
                            or not 0 < ttl <= MAX_JOB_TTL):
        raise bad_request(f'"ttl" must be a number of seconds > 0 and at most {MAX_JOB_TTL:.0f} (30 days), '
                          f'got {ttl!r}')
    return JobRequest(document["inputs"], ttl, document.get("meta"), webhook, request_tenant(headers))


def status_url(job_id: str) -> str:
    return f"/jobs/{job_id}"


def submitted(job_id: str) -> tuple[bytes, dict[str, str]]:
    """The body and headers of the 202 answering ``POST /jobs``."""
    url = status_url(job_id)
    return dumps({"job_id": job_id, "status_url": url}), {"Location": url}


def page_params(query: Mapping[str, str]) -> tuple[int, int]:
    """``start`` and ``count`` of ``GET /jobs/<id>`` (``count=0``: no outputs, the status alone);
    raises a 400 HTTPError when they are not numbers in range."""
    values = []
    for name, default, low, high in (("start", 0, 0, None), ("count", MAX_PAGE, 0, MAX_PAGE)):
        raw = query.get(name)
        try:
            value = default if raw in (None, "") else int(str(raw))
        except ValueError:
            raise bad_request(f"{name} must be an integer, got {raw!r}") from None
        if value < low or (high is not None and value > high):
            raise bad_request(f"{name} must be between {low} and {high or 'infinity'}, got {value}")
        values.append(value)
    return values[0], values[1]


def wants_outputs(info: JobInfo, count: int = MAX_PAGE) -> bool:
    """Outputs are listed once the job has finished (a cancelled one lists what was answered),
    unless the request asked for none (``count=0``: the status alone)."""
    return info.state.finished and count > 0


def status_body(info: JobInfo, items: list[JobItem] | None, start: int, count: int) -> bytes:
    """The body of ``GET /jobs/<id>``: the job, and one page of outputs when ``items`` is given."""
    document = info.as_json()
    document["status_url"] = status_url(info.id)
    if items is not None:
        document["outputs"] = [_item(item) for item in items]
        document["start"] = start
        following = start + count
        document["next"] = (f"{status_url(info.id)}?start={following}&count={count}"
                            if following < info.progress.total else None)
    return dumps(document)


def _item(item: JobItem) -> dict[str, Any]:
    if item.error is None:
        return {"index": item.index, "output": item.value}
    error = item.error
    if isinstance(error, RemoteError):
        return {"index": item.index, "error": {"type": error.remote_type, "message": error.remote_message}}
    return {"index": item.index, "error": {"type": type(error).__name__, "message": str(error)}}
