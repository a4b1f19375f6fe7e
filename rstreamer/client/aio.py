"""AsyncRedisStreamer: the web side of the Redis transport for asyncio apps (Starlette, FastAPI, aiohttp).

It speaks the same wire format as :class:`~rstreamer.client.sync.RedisStreamer` through the same
:class:`~rstreamer.client.core.CallFactory`; only the waiting is asynchronous, so the event loop
stays free while the workers run the model. Each call's BLPOPs run in a task of their own: a
caller that is cancelled or gives up at its deadline never cancels a BLPOP, so no popped reply
is lost, and the caller returns in time whatever Redis does.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Coroutine, Generator, Iterable
from types import TracebackType
from typing import Any, cast

import redis

from ..batching.priority import Levels
from ..batching.quotas import Quotas
from ..broker.connection import create_async_redis
from ..errors import BrokerUnavailable, DecodeError
from ..jobs.aio import AsyncJob, AsyncJobClient
from ..settings import ClientSettings
from ..wire.cancel import cancel_args
from ..wire.replies import decode_reply, undecodable
from ..wire.scripts import scripts
from .core import CLIENT_RETRIES, MAX_CONNECTIONS, SOCKET_TIMEOUT, WITHDRAW_GRACE, Call, CallFactory, call_errors
from .future import BaseFuture
from .gate import WorkerGate, aread_gate
from .streams import AsyncChunkStream

logger = logging.getLogger(__name__)


class AsyncRedisStreamer:
    """Send items to the workers of ``prefix`` and ``await`` their outputs.

    Arguments and defaults are those of :class:`~rstreamer.RedisStreamer`; ``max_connections``
    bounds the calls in flight (each waits on a connection of its own), and a call past it
    raises Overloaded. Create the streamer inside the event loop that uses it (for example in
    an ASGI lifespan) and ``await aclose()`` it, or use ``async with``. ``gate``: as in
    RedisStreamer (NoLiveWorker at once for a prefix that no live worker serves).
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
        self._read_gate = functools.partial(aread_gate, self.redis, self.keys)
        self._enqueue_script = scripts(self.redis).enqueue_calls
        self._cancel_script = scripts(self.redis).cancel
        self._poppers: set[asyncio.Future[Any]] = set()
        self._withdrawals: set[asyncio.Future[Any]] = set()
        self.jobs = AsyncJobClient(self.redis, self.keys, self.url, self.settings.max_item_bytes,
                                   max_queue=self.settings.max_queue)

    async def submit(self, batch: list[Any], timeout: float | None = None, *, priority: int = 0,
                     tenant: str | None = None) -> AsyncFuture:
        """Queue ``batch`` and return an AsyncFuture; ``await`` it for the outputs.

        Raises Overloaded when the queue is full, BrokerUnavailable when Redis is away,
        InvalidPriority for a level the workers do not serve (0, the default, is the most urgent)
        and RateLimited when ``tenant`` is over its quota.
        """
        call = self.calls.new_call(list(batch), timeout, priority, tenant)
        if call.payloads:
            call = await self._admit(call)
        future = AsyncFuture(call)
        future.on_cancel(lambda: self._spawn(self._withdraw(future, whole=True), self._withdrawals))
        if call.payloads:
            enqueue = asyncio.ensure_future(self._enqueue(future))
            enqueue.add_done_callback(_retrieve)
            try:
                done, _ = await asyncio.wait({enqueue}, timeout=call.remaining())
            except asyncio.CancelledError:
                future.cancel()  # withdrawn once enqueued (see _enqueue)
                raise
            if not done:  # Redis did not answer before the deadline: the future times out
                return future
            enqueue.result()
            self._spawn(self._pop_replies(future))
        return future

    async def _admit(self, call: Call) -> Call:
        """``call`` as it may be enqueued, or NoLiveWorker (see :mod:`rstreamer.client.gate`)."""
        cold = await self.gate.aadmit(self._read_gate, call.expires_at)
        return self.calls.cold(call, self.gate.cold_start_wait) if cold else call

    def _spawn(self, work: Coroutine[Any, Any, object], tasks: set[asyncio.Future[Any]] | None = None) -> None:
        """Run ``work`` in a task of its own, kept in ``tasks`` (the poppers, which aclose()
        cancels, by default) until done."""
        kept = self._poppers if tasks is None else tasks
        task = asyncio.ensure_future(work)
        kept.add(task)
        task.add_done_callback(kept.discard)

    async def _enqueue(self, future: AsyncFuture) -> None:
        call = future.call
        # Not retried: a retry after a read timeout would enqueue the items twice.
        with call_errors(self.url):
            # Cheap once done. A cold redis.asyncio RedisCluster given many concurrent first
            # commands closes connections still in use ('NoneType' has no 'writelines',
            # redis-py 8.1); initializing first, under its own lock, avoids that.
            await self.redis.initialize()
            admission = self.calls.check_enqueued(await self._enqueue_script(**self.calls.enqueue_args(call)), call)
        future.entries = list(zip(admission.ids, range(len(call.payloads)), strict=True))
        if future.cancelled():  # cancelled while the ENQUEUE ran
            await self._withdraw(future, whole=True)

    async def _withdraw(self, future: AsyncFuture, whole: bool) -> bool:
        """Withdraw the unanswered items of a cancelled or timed-out call (see rstreamer.wire.cancel).
        True when its reply key became a tombstone (withdrawn whole while a worker held an item)."""
        entries = [(entry_id, index) for entry_id, index in future.entries if not future.answered(index)]
        if not entries:
            return False
        call = future.call
        ttl = call.remaining()
        try:
            with call_errors(self.url):
                reply = await self._cancel_script(**cancel_args(self.keys, call.token, call.priority, entries, ttl,
                                                                whole))
            future.held.update(int(index) for index in reply[1:])
        except Exception as exc:  # noqa: BLE001 - the call is over for its caller either way
            logger.warning("could not withdraw %d cancelled items: %s", len(entries), exc)
            return False
        return whole and len(reply) > 1

    async def _pop_replies(self, future: AsyncFuture) -> None:
        """Pop the call's reply key until it is answered or past its deadline."""
        failures, call = 0, future.call
        while not future.settled() and (block := call.deadline.blpop_block()) is not None:
            try:
                with call_errors(self.url):
                    popped = await self.redis.blpop([call.reply_key], timeout=block)
            except BrokerUnavailable as exc:  # retried within the deadline, then the call fails
                failures += 1
                pause = call.deadline.retry_pause(failures)
                if pause is None:
                    future.fail(exc)
                    break
                await asyncio.sleep(pause)
                continue
            except Exception as exc:
                future.fail(exc)
                break
            failures = 0
            if popped:
                future.deliver_reply(cast(bytes, popped[1]))  # our client does not decode replies
        if not future.done():
            if not await self._withdraw(future, whole=True):  # a tombstone keeps a late answer out
                await self._delete(call.reply_key)

    async def _delete(self, reply_key: str) -> None:
        # A late answer re-creates the key with a TTL; deleting now frees what came so far.
        try:
            await self.redis.delete(reply_key)
        except redis.RedisError:
            pass

    async def predict(self, batch: list[Any], timeout: float | None = None, *, priority: int = 0,
                      tenant: str | None = None) -> list[Any]:
        """Return one output per item of ``batch``, in order (``priority`` and ``tenant`` as in
        :meth:`submit`).

        Cancelling the task that awaits it withdraws the call's items (see rstreamer.wire.cancel).
        """
        future = await self.submit(batch, timeout, priority=priority, tenant=tenant)
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
        """Let the withdrawals of cancelled calls finish (at most WITHDRAW_GRACE s), stop waiting for
        answers and close the streamer's Redis connections."""
        if self._withdrawals:
            await asyncio.wait(list(self._withdrawals), timeout=WITHDRAW_GRACE)
        for popper in list(self._poppers):
            popper.cancel()
        await asyncio.gather(*self._poppers, return_exceptions=True)
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
        self.entries: list[tuple[bytes, int]] = []  # (entry id, index) of its items, once enqueued
        self._settled_event = asyncio.Event()

    def _on_complete(self) -> None:
        self._settled_event.set()

    def deliver_reply(self, data: bytes) -> None:
        """Record the answers of one reply message; one that cannot be read at all fails the call."""
        try:
            self.deliver_all(decode_reply(data))
        except DecodeError as exc:
            self.fail(undecodable(exc))

    async def result(self, timeout: float | None = None) -> list[Any]:
        """The outputs, in order; raises the error of the first failed item.

        Raises StreamerTimeout when ``timeout`` (or the call's own deadline, whichever is
        sooner) passes first.
        """
        if not self.settled():
            remaining = self._until(timeout) - time.monotonic()
            # Waits on an event, never on Redis: cancelling or timing out this wait leaves the
            # call's BLPOP task running, so no popped reply is lost.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._settled_event.wait(), max(0.0, remaining))
        if not self.settled():
            raise self._timeout_error()
        return self._values()

    def __await__(self) -> Generator[Any, None, list[Any]]:
        return self.result().__await__()


def _retrieve(task: asyncio.Future[None]) -> None:
    """Mark a background task's error as seen (its caller may have stopped waiting)."""
    if not task.cancelled():
        task.exception()
