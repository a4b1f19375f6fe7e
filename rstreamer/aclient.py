"""AsyncRedisStreamer: the web side of the Redis transport for asyncio apps (Starlette, FastAPI, aiohttp).

It speaks the same wire format as :class:`~rstreamer.client.RedisStreamer` through the same
:class:`~rstreamer.client.CallFactory`; only the waiting is asynchronous, so the event loop
stays free while the workers run the model.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Generator, Iterator
from types import TracebackType
from typing import Any

import redis
import redis.asyncio

from . import lua
from .client import BLPOP_SLICE, Call, CallFactory, blpop_block
from .connection import broker_errors, create_async_redis
from .errors import Overloaded
from .future import BaseFuture
from .messages import unpack_results
from .settings import ClientSettings

#: Connections per streamer: each call in flight holds one while it waits for its reply.
MAX_CONNECTIONS = 1000


@contextlib.contextmanager
def redis_errors(url: str) -> Iterator[None]:
    """broker_errors, except that a full connection pool means too many calls in flight: Overloaded."""
    with broker_errors(url):
        try:
            yield
        except redis.MaxConnectionsError as exc:
            raise Overloaded(f"too many calls in flight in this process: {exc}") from exc


class AsyncRedisStreamer:
    """Send items to the workers of ``prefix`` and ``await`` their outputs.

    Arguments and defaults are those of :class:`~rstreamer.RedisStreamer`; ``max_connections``
    bounds the calls in flight (each waits on a connection of its own), and a call past it
    raises Overloaded. Create the streamer inside the event loop that uses it (for example in
    an ASGI lifespan) and ``await aclose()`` it, or use ``async with``.
    """

    def __init__(
        self,
        redis_broker: str | None = None,
        prefix: str | None = None,
        *,
        timeout: float | None = None,
        max_queue: int | None = None,
        settings: ClientSettings | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.calls = CallFactory(redis_broker, prefix, timeout, max_queue, settings)
        self.settings, self.url, self.keys = self.calls.settings, self.calls.url, self.calls.keys
        self.redis = create_async_redis(self.url, socket_timeout=BLPOP_SLICE + 3.0, max_connections=max_connections)
        self._enqueue = self.redis.register_script(lua.ENQUEUE)

    async def submit(self, batch: list[Any], timeout: float | None = None) -> AsyncFuture:
        """Queue ``batch`` and return an AsyncFuture; ``await`` it for the outputs.

        Raises Overloaded when the queue is full and BrokerUnavailable when Redis is away.
        """
        call = self.calls.new_call(list(batch), timeout)
        future = AsyncFuture(self.redis, call, self.url)
        if call.payloads:
            with redis_errors(self.url):
                # Cheap once done. A cold redis.asyncio RedisCluster given many concurrent first
                # commands closes connections still in use ('NoneType' has no 'writelines',
                # redis-py 8.1); initializing first, under its own lock, avoids that.
                await self.redis.initialize()
                self.calls.check_enqueued(await self._enqueue(**self.calls.enqueue_args(call)))
        return future

    async def predict(self, batch: list[Any], timeout: float | None = None) -> list[Any]:
        """Return one output per item of ``batch``, in order."""
        future = await self.submit(batch, timeout)
        return await future.result()

    async def aclose(self) -> None:
        """Close the streamer's Redis connections."""
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncRedisStreamer:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class AsyncFuture(BaseFuture):
    """Outputs of one ``submit``: ``await future`` or ``await future.result(timeout)``."""

    def __init__(self, client: redis.asyncio.Redis, call: Call, url: str) -> None:
        super().__init__(len(call.payloads), call.timeout)
        self._redis = client
        self._reply_key = call.reply_key
        self._url = url
        # One BLPOP at a time per reply key, however many tasks await this future.
        self._popping = asyncio.Lock()

    async def result(self, timeout: float | None = None) -> list[Any]:
        """The outputs, in order; raises the error of the first failed item.

        Raises StreamerTimeout when ``timeout`` (or the call's own deadline, whichever is
        sooner) passes first.
        """
        if not await self._wait_until(self._until(timeout)):
            if self._past_deadline():
                await self._expired()
            raise self._timeout_error()
        return self._values()

    def __await__(self) -> Generator[Any, None, list[Any]]:
        return self.result().__await__()

    async def _wait_until(self, until: float) -> bool:
        async with self._popping:
            while not self.done():
                block = blpop_block(until)
                if block is None:
                    return False
                with redis_errors(self._url):
                    popped = await self._redis.blpop([self._reply_key], timeout=block)
                if popped:
                    self._deliver_all(unpack_results(popped[1]))
            return True

    async def _expired(self) -> None:
        # A late answer re-creates the key with a TTL; deleting now frees what came so far.
        try:
            await self._redis.delete(self._reply_key)
        except redis.RedisError:
            pass
