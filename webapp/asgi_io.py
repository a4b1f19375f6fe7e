"""Request I/O the Starlette routes share: a bounded body, and work cancelled when the client leaves."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

from rstreamer import Cancelled

from . import protocol

T = TypeVar("T")


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled, which withdraws
    the call's items (rstreamer.wire.cancel): no model time for a caller that is gone."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            # Let the cancellation run (it withdraws the items) before reading the outcome: a
            # task is only marked cancelled once the loop has thrown CancelledError into it.
            await asyncio.wait({task})
        gone.cancel()
    if task.cancelled():
        raise Cancelled("the client disconnected before the answer")
    return task.result()


async def disconnected(request: Request) -> None:
    """Return once the client has disconnected (the body is read: the next ASGI message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise protocol.too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise protocol.too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)
