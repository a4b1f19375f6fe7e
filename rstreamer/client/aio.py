"""AsyncRedisStreamer: the web side of the Redis transport for asyncio apps (Starlette, FastAPI, aiohttp).

It speaks the same wire format as :class:`~rstreamer.client.sync.RedisStreamer` through the same
:class:`~rstreamer.client.core.CallFactory`; only the waiting is asynchronous, so the event loop
stays free while the workers run the model. Concurrent calls share ENQUEUEs and reply keys
(:mod:`rstreamer.client.aio_coalescer`), whose scripts and BLPOPs run in tasks of their own: a
caller that is cancelled or gives up at its deadline never cancels them, so no popped reply is
lost, and the caller returns in time whatever Redis does.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Generator, Iterable
from types import TracebackType
from typing import Any

from ..batching.priority import Levels
from ..batching.quotas import Quotas
from ..broker.connection import create_async_redis
from ..jobs.aio import AsyncJob, AsyncJobClient
from ..settings import ClientSettings
from .aio_coalescer import AsyncCoalescer, AsyncTicket
from .core import CLIENT_RETRIES, MAX_CONNECTIONS, SOCKET_TIMEOUT, Call, CallFactory, call_errors
from .future import BaseFuture
from .gate import WorkerGate, aread_gate
from .streams import AsyncChunkStream

logger = logging.getLogger(__name__)


class AsyncRedisStreamer:
    """Send items to the workers of ``prefix`` and ``await`` their outputs.

    Arguments and defaults are those of :class:`~rstreamer.RedisStreamer`. Calls made while an
    ENQUEUE is in flight share the next one and one reply key; ``max_connections`` bounds the
    groups of calls in flight (each waits on a connection of its own, as do the ENQUEUE in flight
    and streams), and a call that finds none free raises Overloaded. Create the streamer inside
    the event loop that uses it (for example in an ASGI lifespan) and ``await aclose()`` it, or
    use ``async with``. ``gate``: as in RedisStreamer (NoLiveWorker at once for a prefix that no
    live worker serves).
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
        gate: WorkerGate | None = None,
    ) -> None:
        self.calls = CallFactory(redis_broker, prefix, timeout, max_queue, settings)
        self.settings, self.url, self.keys = self.calls.settings, self.calls.url, self.calls.keys
        self.redis = create_async_redis(self.url, socket_timeout=SOCKET_TIMEOUT, retries=CLIENT_RETRIES,
                                        max_connections=max_connections)
        self.gate = gate or WorkerGate.for_settings(self.keys.prefix, self.settings)
        self.calls.levels_copy = self.gate.levels
        self._read_gate = functools.partial(aread_gate, self.redis, self.keys, levels=self.gate.levels)
        self._coalescer = AsyncCoalescer(self.redis, self.url, self.calls)
        self.jobs = AsyncJobClient(self.redis, self.keys, self.url, self.settings.max_item_bytes,
                                   max_queue=self.settings.max_queue)

    async def submit(self, batch: list[Any], timeout: float | None = None, *, priority: int = 0,
                     tenant: str | None = None) -> AsyncFuture:
        """Queue ``batch`` and return an AsyncFuture; ``await`` it for the outputs.

        Raises Overloaded when the queue is full, BrokerUnavailable when Redis is away,
        InvalidPriority for a level the workers do not serve (0, the default, is the most urgent)
        and RateLimited when ``tenant`` is over its quota.
        """
        return await self._submit(batch, timeout, priority, tenant, patient=False)

    async def _submit(self, batch: list[Any], timeout: float | None, priority: int, tenant: str | None,
                      patient: bool) -> AsyncFuture:
        call = self.calls.new_call(list(batch), timeout, priority, tenant)
        if call.payloads:
            call = await self._admit(call)
        future = AsyncFuture(call)
        if call.payloads:
            await self._coalescer.enqueue(future, patient)
        return future

    async def _admit(self, call: Call) -> Call:
        """``call`` as it may be enqueued, or NoLiveWorker (see :mod:`rstreamer.client.gate`)."""
        cold = await self.gate.aadmit(self._read_gate, call.expires_at)
        return self.calls.cold(call, self.gate.cold_start_wait) if cold else call

    async def predict(self, batch: list[Any], timeout: float | None = None, *, priority: int = 0,
                      tenant: str | None = None) -> list[Any]:
        """Return one output per item of ``batch``, in order (``priority`` and ``tenant`` as in
        :meth:`submit`).

        Cancelling the task that awaits it withdraws the call's items (see rstreamer.wire.cancel).
        """
        # patient: the task waits once, from enqueue to answer (a refusal settles the future).
        future = await self._submit(batch, timeout, priority, tenant, patient=True)
        try:
            return await future.result()
        except asyncio.CancelledError:
            future.cancel()
            raise

    async def submit_job(self, items: Iterable[Any], ttl: float | None = None, priority: int | None = None,
                         meta: Any = None, *, window: int | None = None,
                         webhook: str | None = None, tenant: str | None = None) -> AsyncJob:
        """Store ``items`` as a durable job; see :meth:`rstreamer.RedisStreamer.submit_job`."""
        return await self.jobs.submit(items, ttl, priority, meta, window, webhook, tenant)

    async def job(self, job_id: str) -> AsyncJob:
        """The job ``job_id`` of this prefix; raises InvalidJobId or JobNotFound."""
        return await self.jobs.get(job_id)

    def stream(self, item: Any, timeout: float | None = None, *, priority: int = 0,
               tenant: str | None = None) -> AsyncChunkStream:
        """The answer of ``item`` from a generative model, chunk by chunk:
        ``async for chunk in astreamer.stream(item): ...`` (see ``RedisStreamer.stream``;
        ``priority`` and ``tenant`` as in :meth:`submit`).

        The item is enqueued when the loop starts (or the ``async with`` block is entered): the
        enqueue's errors (Overloaded, InvalidPriority, RateLimited) are raised there. Leaving
        the loop early cancels the generation (``async with astreamer.stream(item) as chunks:``
        cancels at once, deterministically).
        """
        return AsyncChunkStream(self.redis, self.calls, item, timeout, priority, tenant, admit=self._admit)

    async def levels(self) -> Levels:
        """The priority levels the workers of this prefix serve (one when none published any)."""
        with call_errors(self.url):
            raw = await self.redis.get(self.keys.levels)
        return Levels.from_json(raw) if raw else Levels()

    async def quotas(self) -> Quotas:
        """The tenant quotas the workers of this prefix enforce (none when none published any)."""
        with call_errors(self.url):
            raw = await self.redis.get(self.keys.quotas)
        return Quotas.from_json(raw) if raw else Quotas()

    async def aclose(self) -> None:
        """Refuse new calls, let the withdrawals of cancelled calls finish (at most WITHDRAW_GRACE s),
        stop waiting for answers and close the streamer's Redis connections."""
        await self._coalescer.aclose()
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncRedisStreamer:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class AsyncFuture(BaseFuture):
    """Outputs of one ``submit``: ``await future`` or ``await future.result(timeout)``."""

    def __init__(self, call: Call) -> None:
        super().__init__(len(call.payloads), call.timeout, call.deadline)
        self.call = call
        self.ticket: AsyncTicket | None = None  # its place in the coalescer, once enqueued, until settled
        # One loop future per wait in progress: a wait is a future and a timer, where
        # asyncio.wait_for on an Event cost a task, a second future and more (issue 26).
        self._waiters: list[asyncio.Future[None]] = []

    def let_go(self) -> None:
        """Let go of the cancel callback and of the ticket."""
        super().let_go()
        self.ticket = None

    def _on_complete(self) -> None:
        for waiter in self._waiters:
            _wake(waiter)

    async def result(self, timeout: float | None = None) -> list[Any]:
        """The outputs, in order; raises the error of the first failed item.

        Raises StreamerTimeout when ``timeout`` (or the call's own deadline, whichever is
        sooner) passes first.
        """
        if not self.settled():
            # Waits on a future of its own, never on Redis: cancelling or timing out this wait
            # leaves the group's BLPOP task running, so no popped reply is lost.
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[None] = loop.create_future()
            timer = loop.call_later(max(0.0, self._until(timeout) - time.monotonic()), _wake, waiter)
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiters.remove(waiter)
        if not self.settled():
            raise self._timeout_error()
        return self._values()

    def __await__(self) -> Generator[Any, None, list[Any]]:
        return self.result().__await__()


def _wake(waiter: asyncio.Future[None]) -> None:
    """End a wait (its call settled, or its time is up)."""
    if not waiter.done():
        waiter.set_result(None)
