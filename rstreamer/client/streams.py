"""Streamed calls on the client side: ``for chunk in streamer.stream(item)`` and its async twin.

A stream marks its call as streamed in the call's control key (with a TTL), enqueues its one
item like any call (same admission: Overloaded when the queue is full, InvalidPriority for a
level no worker serves, RateLimited over the tenant's quota; the item goes to its priority
level's stream), then pops the call's reply list: each message brings the next chunks (see
:mod:`rstreamer.wire.chunks`). Leaving early (``break``, ``close()``, the ``with`` block, an error in
the caller's loop) marks the call cancelled, so the worker drops the sequence before its next
step, withdraws the item from its level's stream if no worker has read it yet (the CANCEL
script of :mod:`rstreamer.wire.cancel`), and deletes what was pushed.

:class:`_StreamState` is the sans-I/O core of both streams: the call, the reader and its buffer,
and, as flows (:mod:`rstreamer.broker.flow`), popping until the next chunk and closing. The
two streams are thin shells that run those flows; only their enqueue is their own, as it differs
on purpose: the sync stream enqueues at once, the async one at its first ``__anext__``, where a
task cancelled while the script runs must still cancel the call.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable
from operator import methodcaller
from types import TracebackType
from typing import TYPE_CHECKING, Any

import redis

from ..broker.connection import RedisClient
from ..broker.flow import Command, Flow, Pause, arun, call_bounded, pipeline, run
from ..broker.threads import call_within
from ..errors import BrokerUnavailable, Overloaded, RStreamerError, StreamerTimeout
from ..wire.cancel import cancel_args
from ..wire.chunks import CANCELLED, STREAMED, ChunkReader
from ..wire.messages import REPLY_GRACE
from ..wire.scripts import ScriptArgs, scripts
from .core import Call, CallFactory, call_errors

if TYPE_CHECKING:
    from redis.asyncio import Redis as AsyncRedis
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

POP_COUNT = 256
"""Most chunk messages one pop takes."""
CLOSE_WAIT = 0.25
"""The longest leaving a stream waits for Redis to take its cancellation."""


class _StreamState:
    """What the sync and async streams share: the call, its keys, the reader and the buffer."""

    def __init__(self, calls: CallFactory, item: Any, timeout: float | None, priority: int,
                 tenant: str | None) -> None:
        self.call: Call = calls.new_call([item], timeout, priority, tenant)
        self.calls = calls
        self.control_key = calls.keys.stream_control(self.call.token)
        self.reader = ChunkReader(calls.settings.max_item_bytes)
        self.buffer: collections.deque[Any] = collections.deque()
        self.error: BaseException | None = None
        self.started = False
        self.closed = False
        self.failures = 0
        self.entry_id: bytes | None = None  # the item's entry in its level's stream, once enqueued

    def errors(self) -> contextlib.AbstractContextManager[None]:
        """Around each command of the stream's flows: how Redis's failures reach the caller."""
        return call_errors(self.calls.url)

    @property
    def control_ttl_ms(self) -> int:
        return int((self.call.timeout + REPLY_GRACE) * 1000)

    def enqueue_args(self) -> ScriptArgs:
        return self.calls.enqueue_args(self.call)

    def enqueued(self, reply: Any) -> None:
        """Check the ENQUEUE_CALLS reply (raises when refused) and keep the item's entry id."""
        admission = self.calls.check_enqueued(reply, self.call)
        self.entry_id = admission.ids[0] if admission.ids else None

    def next_chunk(self) -> Flow[Any]:
        """The next chunk, popping the reply list until one comes; raises _End at the end of the
        answer, the answer's error where it comes, StreamerTimeout at the call's deadline."""
        while True:
            ready, chunk = self.next_ready()
            if ready:
                return chunk
            block = self.call.deadline.blpop_block()
            if block is None:
                raise self.timed_out()
            try:
                # Every message waiting in one pop: a slow reader catches up in one round trip.
                # Never waited for past the call's deadline, whatever Redis does (a stalled server):
                # the socket timeout bounds it while the deadline is further away than that, and
                # the pop runs in the caller's thread. A pop handed to a thread whose caller stops
                # waiting for it may run later and take chunks that nobody reads: past the
                # deadline only, where the stream has ended for its caller anyway.
                pop = methodcaller("blmpop", block, 1, self.call.reply_key, direction="LEFT", count=POP_COUNT)
                popped = yield Command(pop, until=self.call.deadline.command_until)
            except BrokerUnavailable as exc:
                if self.call.expired():
                    raise self.timed_out() from None
                yield Pause(self.broker_failed(exc))
                continue
            self.failures = 0
            if popped:
                self.take(popped)

    def close(self) -> Flow[None]:
        """Leave the stream, once: the call marked cancelled unless its answer ended (then its
        control key goes), its reply list deleted, its item withdrawn if no worker read it yet."""
        if self.closed or not self.started:
            return
        self.closed = True
        mark = (methodcaller("set", self.control_key, CANCELLED, px=self.control_ttl_ms) if not self.reader.done
                else methodcaller("delete", self.control_key))
        until = time.monotonic() + CLOSE_WAIT  # leaving waits for Redis that long at most
        try:
            yield pipeline(mark, methodcaller("delete", self.call.reply_key), until=until)
            withdraw = self.withdraw_args()
            if withdraw is not None:
                yield Command(lambda r: scripts(r).cancel(**withdraw), until=until)
        except (redis.RedisError, BrokerUnavailable, Overloaded):
            pass  # best effort: the control key's TTL ends the generation, the reply list's TTL the rest

    def withdraw_args(self) -> ScriptArgs | None:
        """Arguments of the CANCEL script that withdraws the item from its level's stream (an
        item no worker has read yet is deleted, never started), or None when there is nothing to
        withdraw (the answer ended, or it was never enqueued)."""
        if self.reader.done or self.entry_id is None:
            return None
        ttl = self.call.remaining()
        return cancel_args(self.calls.keys, self.call.token, self.call.priority, [(self.entry_id, 0)], ttl,
                           whole=True)

    def take(self, popped: Any) -> None:
        """The messages of one BLMPOP reply ``[key, [message, ...]]``, in order."""
        for data in popped[1]:
            if self.reader.done:
                break  # nothing follows the end
            chunks, error = self.reader.feed(data)
            self.buffer.extend(chunks)
            self.error = error

    def next_ready(self) -> tuple[bool, Any]:
        """``(True, chunk)`` when a chunk can be returned now; raises at the end or on an error."""
        if self.buffer:
            return True, self.buffer.popleft()
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        if self.reader.done:
            raise _End
        return False, None

    def timed_out(self) -> StreamerTimeout:
        return StreamerTimeout(f"the stream did not end within its timeout of {self.call.timeout}s "
                               f"({self.reader.next_seq} chunks received)")

    def broker_failed(self, exc: BrokerUnavailable) -> float:
        """Seconds to wait before popping again; raises when the retries are spent."""
        self.failures += 1
        pause = self.call.deadline.retry_pause(self.failures)
        if pause is None:
            raise exc
        return pause


class _End(Exception):
    """The stream ended normally."""


class ChunkStream:
    """The chunks of one streamed call, in order (an iterator; see ``RedisStreamer.stream``).

    ``close()`` (or leaving a ``with`` block, or dropping the iterator) cancels the generation
    on the worker if it has not ended.
    """

    def __init__(self, client: RedisClient, calls: CallFactory, item: Any, timeout: float | None,
                 priority: int = 0, tenant: str | None = None, admit: Callable[[Call], Call] | None = None) -> None:
        self._redis = client
        self._state = _StreamState(calls, item, timeout, priority, tenant)
        if admit is not None:  # the streamer's worker gate (NoLiveWorker, or a cold start's timeout)
            self._state.call = admit(self._state.call)
        self._enqueue()

    def _enqueue(self) -> None:
        state = self._state
        with call_errors(self._redis_url):
            # Marked first: the worker reads the mark when it takes the item.
            self._within(lambda: self._redis.set(state.control_key, STREAMED, px=state.control_ttl_ms))
            script = scripts(self._redis).enqueue_calls
            try:
                state.enqueued(self._within(lambda: script(**state.enqueue_args())))
            except RStreamerError:
                # Best effort, and bounded: the caller gets the call's own error, not a stalled
                # Redis's socket timeout on top of it; the mark's TTL ends it otherwise.
                unmark = lambda: self._redis.delete(state.control_key)  # noqa: E731
                with contextlib.suppress(redis.RedisError, RStreamerError):
                    call_within(unmark, time.monotonic() + CLOSE_WAIT, state.timed_out)
                raise
        state.started = True

    def _within(self, command: Callable[[], Any]) -> Any:
        """``command()`` (a Redis command), waited for no later than the call's deadline."""
        return call_bounded(command, self._redis, self._state.call.deadline.command_until, self._state.timed_out)

    @property
    def _redis_url(self) -> str:
        return self._state.calls.url

    def __iter__(self) -> ChunkStream:
        return self

    def __next__(self) -> Any:
        try:
            return run(self._state.next_chunk(), self._redis, self._state.errors)
        except _End:
            self.close()
            raise StopIteration from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop: cancel the generation unless it ended, and drop its reply list."""
        run(self._state.close(), self._redis, self._state.errors)

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        # A loop left with break drops the iterator: that is leaving early, too.
        with contextlib.suppress(Exception):
            self.close()


class AsyncChunkStream:
    """The chunks of one streamed call for asyncio: ``async for chunk in astreamer.stream(item)``.

    The item is enqueued at the first ``__anext__`` (or ``async with``). ``await aclose()``
    (or leaving an ``async with`` block) cancels the generation if it has not ended; a stream
    dropped unclosed inside a running loop is cancelled by a task.
    """

    def __init__(self, client: AsyncRedis | AsyncRedisCluster, calls: CallFactory, item: Any,
                 timeout: float | None, priority: int = 0, tenant: str | None = None,
                 admit: Callable[[Call], Awaitable[Call]] | None = None) -> None:
        self._redis = client
        self._state = _StreamState(calls, item, timeout, priority, tenant)
        self._admit = admit

    async def _enqueue(self) -> None:
        state = self._state
        if self._admit is not None:  # the streamer's worker gate (NoLiveWorker, or a cold start's timeout)
            state.call = await self._admit(state.call)
        with call_errors(state.calls.url):
            await self._within(self._redis.set(state.control_key, STREAMED, px=state.control_ttl_ms))
            script = scripts(self._redis).enqueue_calls
            state.started = True  # from here, leaving cancels
            reply = await self._within(script(**state.enqueue_args()))
            try:
                state.enqueued(reply)
            except RStreamerError:  # refused: nothing was enqueued, so nothing to cancel
                state.started = False
                with contextlib.suppress(redis.RedisError):
                    await self._redis.delete(state.control_key)
                raise

    async def _within(self, command: Awaitable[Any]) -> Any:
        """``await command`` (a Redis command), no later than the call's deadline."""
        try:
            return await asyncio.wait_for(command, max(0.0, self._state.call.deadline.command_until - time.monotonic()))
        except asyncio.TimeoutError:
            raise self._state.timed_out() from None

    def __aiter__(self) -> AsyncChunkStream:
        return self

    async def __anext__(self) -> Any:
        state = self._state
        try:
            if not state.started:
                await self._enqueue()
            return await arun(state.next_chunk(), self._redis, state.errors)
        except _End:
            await self.aclose()
            raise StopAsyncIteration from None
        except BaseException:
            await asyncio.shield(self.aclose())
            raise

    async def aclose(self) -> None:
        """Stop: cancel the generation unless it ended, and drop its reply list."""
        await arun(self._state.close(), self._redis, self._state.errors)

    async def __aenter__(self) -> AsyncChunkStream:
        if not self._state.started:
            await self._enqueue()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    def __del__(self) -> None:
        state = self._state
        if state.closed or not state.started:
            return
        with contextlib.suppress(RuntimeError):  # no running loop: the control key's TTL ends it
            loop = asyncio.get_running_loop()
            loop.create_task(self.aclose())
