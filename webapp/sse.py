"""``POST /generate``: one item's answer streamed as Server-Sent Events, for both apps.

The body is JSON ``{"input": item}`` (and optionally ``"timeout": seconds``, which bounds the
whole answer, at most a day, and ``"priority": level``; the ``X-Priority`` and ``X-Tenant`` headers as for
``/predict``). A refused request (bad body, full queue, Redis away, no live worker) is a JSON
error with its status, as for ``/predict``; once the stream has started, every chunk is an event::

    event: chunk       data: <the chunk, JSON>
    event: restarted   data: {"discarded": n}     (a sampling model's item was restarted)
    event: error       data: {"type": ..., "message": ..., "status": ...}   (last event)
    event: end         data: {}                   (last event)

A client that disconnects cancels the generation: the server notices when it writes the next
event (gunicorn) or at once (uvicorn), and the stream's close marks the call cancelled.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from rstreamer import Restarted
from rstreamer.client.streams import AsyncChunkStream, ChunkStream
from rstreamer.errors import ConfigError
from rstreamer.settings import MAX_TIMEOUT, check_timeout

from . import protocol

SSE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may buffer the events


@dataclass(frozen=True)
class GenerateRequest:
    """What a ``/generate`` request asks for: its item, the timeout of the whole answer, and how
    to queue it (as for ``/predict``: ``"priority"`` or ``X-Priority``, ``X-Tenant``)."""

    item: Any
    timeout: float | None = None
    priority: int = 0
    tenant: str | None = None


def parse_generate(content_type: str | None, body: bytes, headers: protocol.RequestHeaders) -> GenerateRequest:
    """The item, timeout, priority and tenant of a ``/generate`` request; HTTPError 400 says
    what is wrong."""
    mimetype = (content_type or "").split(";", 1)[0].strip().lower()
    if mimetype != protocol.JSON and not mimetype.endswith("+json"):
        raise protocol.bad_request(f'send {protocol.JSON} {{"input": ...}}, not {mimetype or "no type"}')
    document = protocol.json_body(body)
    if not isinstance(document, dict) or "input" not in document:
        raise protocol.bad_request('expected a JSON object {"input": ...}')
    timeout = document.get("timeout")
    if timeout is not None:
        try:
            timeout = check_timeout(timeout)
        except ConfigError:
            raise protocol.bad_request(f'"timeout" must be a number of seconds > 0 and at most {MAX_TIMEOUT:.0f} '
                                       f'(one day), got {timeout!r}') from None
    return GenerateRequest(document["input"], timeout, *protocol.call_options(document.get("priority"), headers))


def event(name: str, data: Any) -> bytes:
    """One SSE event; its data is JSON on one line."""
    return b"event: " + name.encode() + b"\ndata: " + protocol.dumps(data) + b"\n\n"


def chunk_event(chunk: Any) -> bytes:
    if isinstance(chunk, Restarted):
        return event("restarted", {"discarded": chunk.discarded})
    return event("chunk", chunk)


def error_event(exc: BaseException) -> bytes:
    status, body, _ = protocol.error_reply(exc)
    return event("error", {**json.loads(body)["error"], "status": status})


END = event("end", {})


def sync_events(stream: ChunkStream) -> Iterator[bytes]:
    """The events of a stream for a WSGI server; closing the iterable (a client that left)
    cancels the generation."""
    with stream:
        try:
            for chunk in stream:
                yield chunk_event(chunk)
        except Exception as exc:  # the error ends the stream, as an event: the status is sent
            yield error_event(exc)
            return
        yield END


async def async_events(stream: AsyncChunkStream) -> AsyncIterator[bytes]:
    """The events of a stream for an ASGI server; cancelled (a client that left), it cancels
    the generation."""
    import anyio

    try:
        try:
            async for chunk in stream:
                yield chunk_event(chunk)
        except Exception as exc:
            yield error_event(exc)
            return
        yield END
    finally:
        with anyio.CancelScope(shield=True):  # runs even though the response was cancelled
            await stream.aclose()
