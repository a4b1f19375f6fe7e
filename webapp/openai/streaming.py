"""A streamed chat or completion as OpenAI's server-sent events, for both apps.

The answer's head is read before the response starts (:func:`open_sync`, :func:`open_async`):
up to its first text, or its end. So a request the model refuses (a prompt too long for its
context, a bad parameter) gets its status (400) and an OpenAI error body, as OpenAI's API
answers it, instead of a 200 stream with an error inside. Then every chunk is an event, the
last ones the finish reason, the usage when asked, and ``data: [DONE]``. An error after the
head ends the stream with an ``{"error": ...}`` event. A client that leaves closes the stream,
which cancels the generation (the worker drops it before its next step).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from rstreamer.client.streams import AsyncChunkStream, ChunkStream

from .errors import error_event
from .responses import StreamTranslator


def _opened(translator: StreamTranslator) -> bool:
    return translator.sent_text or translator.final is not None


def open_sync(stream: ChunkStream, translator: StreamTranslator) -> bytes:
    """The first events, once the answer has its first text (or ended); raises the stream's error."""
    head = translator.start()
    for chunk in stream:
        head += translator.feed(chunk)
        if _opened(translator):
            break
    return head


def sync_events(stream: ChunkStream, translator: StreamTranslator, head: bytes) -> Iterator[bytes]:
    """Every event, for a WSGI server; closing the iterable (a client that left) cancels the generation."""
    with stream:
        try:
            yield head
            for chunk in stream:
                event = translator.feed(chunk)
                if event:
                    yield event
        except Exception as exc:  # the stream has started: the error is its last event
            yield error_event(exc)
            return
        yield translator.end()


async def open_async(stream: AsyncChunkStream, translator: StreamTranslator) -> bytes:
    """The first events, as :func:`open_sync`."""
    head = translator.start()
    async for chunk in stream:
        head += translator.feed(chunk)
        if _opened(translator):
            break
    return head


async def async_events(stream: AsyncChunkStream, translator: StreamTranslator, head: bytes) -> AsyncIterator[bytes]:
    """Every event, for an ASGI server; cancelled (a client that left), it cancels the generation."""
    import anyio

    try:
        try:
            yield head
            async for chunk in stream:
                event = translator.feed(chunk)
                if event:
                    yield event
        except Exception as exc:
            yield error_event(exc)
            return
        yield translator.end()
    finally:
        with anyio.CancelScope(shield=True):  # runs even though the response was cancelled
            await stream.aclose()
