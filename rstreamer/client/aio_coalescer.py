"""Coalescing for asyncio: the concurrent calls of one AsyncRedisStreamer share ENQUEUEs and reply keys.

As in the threads' coalescer (:mod:`rstreamer.client.coalescer`): calls that tasks submit while an
ENQUEUE is in flight go out together in the next one, under one token, so they share one reply
key, which one popper task pops for all of them; each call keeps its own deadline and its own
verdict. A caller never talks to Redis: it queues its call and waits, with its own deadline, for
the ENQUEUE's verdict and then for its answers, so it returns in time whatever Redis does; the
flusher task and the poppers do the talking, and a caller that is cancelled never cancels them, so
no ENQUEUE is cut half-way and no popped reply is lost. Without it every call ran its own ENQUEUE
and its own BLPOP: 11.5 Redis commands per item with 64 calls in flight, against 1.7 (issue 26).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from ..broker.direct import async_direct_command, async_run_script
from ..broker.flow import Command, arun
from ..errors import BrokerUnavailable
from ..wire.messages import Admission
from ..wire.scripts import scripts
from .core import WITHDRAW_GRACE, CallFactory, call_errors
from .groups import (
    BaseTicket,
    CallState,
    ReplyGroup,
    admit,
    copy_error,
    pop_replies,
    streamer_closed,
    take,
    withdraw,
)

if TYPE_CHECKING:
    from redis.asyncio import Redis as AsyncRedis
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

    from .aio import AsyncFuture

logger = logging.getLogger(__name__)


class AsyncTicket(BaseTicket):
    """One call's place in the asyncio coalescer; its caller awaits the ENQUEUE's verdict."""

    __slots__ = ("_verdict",)

    def __init__(self, future: AsyncFuture) -> None:
        super().__init__(future)
        self._verdict: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def _decided(self) -> None:
        if not self._verdict.done():
            self._verdict.set_result(None)

    async def wait_decided(self) -> None:
        """Wait until the ENQUEUE has decided or the call's deadline has passed (a caller that is
        cancelled meanwhile cancels only its own wait, never the ENQUEUE)."""
        # A timer that ends the wait at the deadline: asyncio.wait(timeout=) cost a second future
        # and callbacks per call (issue 26).
        timer = asyncio.get_running_loop().call_later(self.future.call.remaining(), self._decided)
        try:
            await self._verdict
        finally:
            timer.cancel()


class AsyncCoalescer:
    """Enqueues the calls of an AsyncRedisStreamer, coalescing concurrent ones, and pops their
    answers. Made and used in one event loop."""

    def __init__(self, client: AsyncRedis | AsyncRedisCluster, url: str, calls: CallFactory) -> None:
        self._redis = client
        self._url = url
        self._calls = calls
        self._script = scripts(client).enqueue_calls
        self._pending: list[AsyncTicket] = []
        self._flushing = False
        self._flusher: set[asyncio.Future[Any]] = set()  # one at a time
        self._poppers: set[asyncio.Future[Any]] = set()
        self._withdrawals: set[asyncio.Future[Any]] = set()
        self._closed = False
        self._errors = functools.partial(call_errors, url)

    # callers ---------------------------------------------------------------------------------

    async def enqueue(self, future: AsyncFuture, patient: bool = False) -> None:
        """Queue ``future``'s call. Unless ``patient``, return once it is enqueued (raising why it
        was not) or its deadline has passed (the future then times out); a patient caller learns
        the outcome from the future (a refused call's future fails with its error)."""
        if self._closed:
            raise BrokerUnavailable("the streamer is closed")
        ticket = future.ticket = AsyncTicket(future)
        future.on_cancel(lambda: self.cancel(ticket))
        self._pending.append(ticket)
        if not self._flushing:
            self._flushing = True
            self._spawn(self._flush(), self._flusher)
        if patient:
            return
        try:
            await ticket.wait_decided()
        except asyncio.CancelledError:
            future.cancel()  # never sent if still pending; else withdrawn once its ENQUEUE settles
            raise
        if ticket.state is CallState.PENDING:  # the deadline passed before it was sent
            self._pending.remove(ticket)
            ticket.drop()
        if ticket.state is CallState.FAILED and ticket.error is not None:
            raise ticket.error

    def cancel(self, ticket: AsyncTicket) -> None:
        """Withdraw a cancelled call: never sent if it was still pending, else its unanswered
        items are withdrawn from Redis (in a task: cancel() does not wait for Redis)."""
        if ticket.state is CallState.PENDING:
            self._pending.remove(ticket)
            ticket.drop()
        elif ticket.state is CallState.SENT:
            self._spawn(self._withdraw([ticket], False), self._withdrawals)
        # SENDING: withdrawn when its ENQUEUE settles (_send); FAILED, DROPPED: nothing queued

    async def aclose(self) -> None:
        """Refuse new calls, let the ENQUEUE in flight and the withdrawals of cancelled calls
        finish (at most WITHDRAW_GRACE s) and stop popping: as the threads' coalescer closes (the
        calls of a closed streamer stay queued)."""
        self._closed = True
        for ticket in self._pending:
            ticket.failed(streamer_closed())
        self._pending.clear()
        for popper in list(self._poppers):
            popper.cancel()
        finishing = self._flusher | self._withdrawals
        if finishing:
            await asyncio.wait(finishing, timeout=WITHDRAW_GRACE)
        stopping = self._flusher | self._poppers | self._withdrawals
        for task in stopping:
            task.cancel()
        await asyncio.gather(*stopping, return_exceptions=True)

    # the flusher -----------------------------------------------------------------------------

    async def _flush(self) -> None:
        """Send the pending calls, one ENQUEUE at a time, until none are left."""
        try:
            while True:
                taken, self._pending = take(self._pending, time.monotonic())
                if not taken:
                    break
                group = await self._send(taken)
                if group is not None and self._closed:  # accepted while aclose() ran: nobody pops it
                    group.fail_waiting(streamer_closed())
                elif group is not None:
                    popper = self._spawn(self._pop_replies(group), self._poppers)
                    popper.add_done_callback(functools.partial(self._popper_done, group))
        finally:
            self._flushing = False
            if self._pending and not self._closed:  # left by an unexpected error: never leave calls without a flusher
                self._flushing = True
                self._spawn(self._flush(), self._flusher)

    async def _send(self, taken: list[AsyncTicket]) -> ReplyGroup | None:
        """One ENQUEUE_CALLS for ``taken``; settles each call; the group of the accepted ones."""
        try:
            # Not retried: a retry after a read timeout would enqueue the items twice.
            with call_errors(self._url):
                # Cheap once done. A cold redis.asyncio RedisCluster given many concurrent first
                # commands closes connections still in use ('NoneType' has no 'writelines',
                # redis-py 8.1); initializing first, under its own lock, avoids that.
                await self._redis.initialize()
                args = self._calls.enqueue_calls_args([t.future.call for t in taken])
                admission = Admission.parse(await async_run_script(self._redis, self._script, args["keys"],
                                                                   args["args"]))
        except BaseException as exc:  # every caller in the ENQUEUE must learn how it ended
            error = exc if isinstance(exc, Exception) else streamer_closed()
            for n, ticket in enumerate(taken):
                ticket.failed(error if n == 0 else copy_error(error))
            if not isinstance(exc, Exception):
                raise  # aclose() cancelled the flusher
            return None
        group, verdicts = admit(taken, admission, self._calls)
        for ticket, refusal in verdicts:
            if refusal is None:
                ticket.sent()
            else:
                ticket.failed(refusal)
        cancelled = [ticket for ticket in taken if ticket.state is CallState.SENT and ticket.future.cancelled()]
        if cancelled:  # cancelled during the ENQUEUE
            self._spawn(self._withdraw(cancelled, False), self._withdrawals)
        return group

    # the poppers -----------------------------------------------------------------------------

    async def _pop_replies(self, group: ReplyGroup) -> None:
        """Pop ``group``'s reply key until each of its calls is answered or past its deadline
        (see :func:`~rstreamer.client.groups.pop_replies`)."""
        # Not only cancelled by aclose(): a cancellation that lands while redis.asyncio opens a
        # connection can be swallowed (the BLPOP then returns None; seen with redis-py 8.1), so
        # the flow also stops once the streamer is closed.
        await arun(pop_replies(group, lambda: not self._closed, _blpop, self._calls), self._redis, self._errors)

    def _popper_done(self, group: ReplyGroup, popper: asyncio.Future[Any]) -> None:
        """A popper that aclose() cancelled before it ran never reached the close-out of
        :func:`~rstreamer.client.groups.pop_replies`: its callers fail now, not at their timeouts."""
        if self._closed:
            group.fail_waiting(streamer_closed())

    async def _withdraw(self, tickets: Sequence[BaseTicket], whole: bool) -> bool:
        """Withdraw the unanswered items of ``tickets`` (see :func:`~rstreamer.client.groups.withdraw`)."""
        return await arun(withdraw(tickets, whole, self._calls), self._redis, self._errors)

    @staticmethod
    def _spawn(work: Coroutine[Any, Any, object], tasks: set[asyncio.Future[Any]]) -> asyncio.Future[Any]:
        """Run ``work`` in a task of its own, kept in ``tasks`` until done; its error is logged."""
        task = asyncio.ensure_future(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        task.add_done_callback(_retrieve)
        return task


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a background task's error as seen (its caller may have stopped waiting), and log it."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        logger.error("rstreamer: a background task of the asyncio streamer failed: %r", exc)


def _blpop(key: str, seconds: float) -> Command:
    """The popper's BLPOP, written straight on a connection (broker/direct.py)."""
    return Command(lambda client: async_direct_command(client, "BLPOP", key, seconds))
