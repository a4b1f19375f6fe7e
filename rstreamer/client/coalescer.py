"""Coalescing: the concurrent calls of one RedisStreamer share ENQUEUEs and reply keys.

Calls that threads of one process submit while an ENQUEUE is in flight go out together in the
next one: one ENQUEUE_CALLS script under one token, so they share one reply key, which one
thread pops for all of them. Each call keeps its own deadline (the script writes one per item)
and its own Overloaded (the script checks max_queue call by call).

A caller's thread never talks to Redis: it queues its call and parks with its own deadline, so
it returns in time whatever Redis does, a stalled server or a black-holed path included (issue
10 #4). The streamer's I/O threads do the talking: one flusher at a time sends the pending calls,
and one popper per reply group pops its key and delivers each answer to its call's future. The
flusher pops for the last group it sent, so a lone call costs one EVALSHA and one BLPOP, as
before, plus two thread hand-offs.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future as TaskFuture
from concurrent.futures import wait
from typing import TYPE_CHECKING, Any

from ..broker.connection import RedisClient
from ..broker.direct import direct_command, run_script
from ..broker.flow import Command, run
from ..broker.forks import renew_after_fork
from ..broker.threads import DaemonThreads
from ..errors import BrokerUnavailable
from ..wire.messages import Admission
from ..wire.scripts import scripts
from .core import MAX_CONNECTIONS, WITHDRAW_GRACE, CallFactory, call_errors
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
    from .future import RedisFuture

logger = logging.getLogger(__name__)

class Ticket(BaseTicket):
    """One call's place in the threads' coalescer; a caller waits on a lock until its ENQUEUE decided."""

    __slots__ = ("_settled",)

    def __init__(self, future: RedisFuture) -> None:
        super().__init__(future)
        self._settled = threading.Lock()
        self._settled.acquire()  # released once the ENQUEUE has decided

    def _decided(self) -> None:
        self._settled.release()

    def wait_settled(self, until: float | None = None) -> None:
        """Park until the ENQUEUE has decided, or the call's deadline (or the monotonic time
        ``until``, if sooner)."""
        timeout = self.future.call.remaining()
        if until is not None:
            timeout = min(timeout, max(0.0, until - time.monotonic()))
        if self._settled.acquire(timeout=timeout):
            self._settled.release()  # settled for good: every later wait returns at once


class Coalescer:
    """Enqueues the calls of a RedisStreamer, coalescing concurrent ones, and pops their answers."""

    def __init__(self, client: RedisClient, url: str, calls: CallFactory) -> None:
        self._redis = client
        self._url = url
        self._calls = calls
        self._script = scripts(client).enqueue_calls
        self._lock = threading.Lock()
        self._pending: list[Ticket] = []
        self._flushing = False
        self._closed = False
        # Daemon threads: a program that ends (Ctrl-C in predict) is never kept alive by them.
        self._io = DaemonThreads(MAX_CONNECTIONS, "rstreamer-io")
        self._withdrawals: set[TaskFuture[None]] = set()
        self._errors = functools.partial(call_errors, url)
        renew_after_fork(self)

    def renew_after_fork(self) -> None:
        """In a forked child: the parent's calls (their callers are threads the child does not
        have), their flusher and the lock one of them may have held are not the child's."""
        self._lock = threading.Lock()
        self._pending = []
        self._flushing = False
        self._withdrawals = set()

    # callers ---------------------------------------------------------------------------------

    def enqueue(self, future: RedisFuture, patient: bool) -> None:
        """Queue ``future``'s call. Unless ``patient``, return once it is enqueued (raising why it
        was not) or its deadline has passed; a patient caller learns the outcome from the future."""
        ticket = future.ticket = Ticket(future)
        future.on_cancel(lambda: self.cancel(ticket))
        with self._lock:
            if self._closed:
                raise BrokerUnavailable("the streamer is closed")
            self._pending.append(ticket)
            start, self._flushing = not self._flushing, True
        if start:
            self._start(self._flush)
        if not patient:
            self._await_sent(ticket)

    def _await_sent(self, ticket: Ticket) -> None:
        ticket.wait_settled()
        with self._lock:
            if ticket.state is CallState.PENDING:  # the deadline passed before it was sent
                self._pending.remove(ticket)
                ticket.drop()
        # SENDING: the deadline passed during the ENQUEUE; the future times out.
        if ticket.state is CallState.FAILED and ticket.error is not None:
            raise ticket.error

    def cancel(self, ticket: Ticket) -> None:
        """Withdraw a cancelled call: never sent if it was still pending, else its unanswered
        items are withdrawn from Redis (in an I/O thread: cancel() does not wait for Redis)."""
        with self._lock:
            if ticket.state is CallState.PENDING:
                self._pending.remove(ticket)
                ticket.drop()
                return
            if ticket.state is not CallState.SENT:
                return  # SENDING: withdrawn when its ENQUEUE settles (_settle); FAILED: nothing queued
        self._start_withdrawal([ticket])

    def _start_withdrawal(self, tickets: list[Ticket]) -> None:
        try:
            task = self._io.submit(self._withdraw, tickets, False)
        except RuntimeError:  # shut down by close()
            return
        # close() and withdraw_now() let the withdrawals already asked for finish: a caller that
        # cancels and then closes (a web process shutting down, a script ended by Ctrl-C) must
        # not leave its items queued.
        with self._lock:
            self._withdrawals.add(task)
        task.add_done_callback(self._withdrawn)

    def withdraw_now(self, future: RedisFuture, timeout: float) -> None:
        """Cancel ``future``'s call and wait, at most ``timeout`` seconds, until its items are
        withdrawn from Redis: the program may be about to end (Ctrl-C), and these threads end
        with it."""
        until = time.monotonic() + timeout
        future.cancel()
        ticket = future.ticket
        if ticket is not None and ticket.state is CallState.SENDING:  # withdrawn when its ENQUEUE settles
            ticket.wait_settled(until)
        with self._lock:
            withdrawals = list(self._withdrawals)
        wait(withdrawals, timeout=max(0.0, until - time.monotonic()))

    def _withdrawn(self, task: TaskFuture[None]) -> None:
        with self._lock:
            self._withdrawals.discard(task)

    def _withdraw(self, tickets: Sequence[BaseTicket], whole: bool) -> bool:
        """Withdraw the unanswered items of ``tickets`` (see :func:`~rstreamer.client.groups.withdraw`)."""
        return run(withdraw(tickets, whole, self._calls), self._redis, self._errors)

    def close(self) -> None:
        """Refuse new calls, let pending withdrawals finish (at most WITHDRAW_GRACE s) and stop the
        poppers (each within one BLPOP slice)."""
        with self._lock:
            self._closed = True
            for ticket in self._pending:
                ticket.failed(streamer_closed())
            self._pending.clear()
            withdrawals = list(self._withdrawals)
        wait(withdrawals, timeout=WITHDRAW_GRACE)
        self._io.shutdown(cancel_futures=True)

    # the flusher -----------------------------------------------------------------------------

    def _flush(self) -> None:
        """Send the pending calls until none are left, then pop the last group's answers."""
        last: ReplyGroup | None = None
        try:
            while taken := self._take():
                if last is not None:
                    self._start_popper(last)
                last = self._send(taken)
        except BaseException:
            self._recover(last)
            raise
        if last is not None:
            self._pop_replies(last)

    def _recover(self, last: ReplyGroup | None) -> None:
        """After an unexpected error in the flusher: never leave calls without a flusher or popper."""
        with self._lock:
            restart = self._flushing = bool(self._pending) and not self._closed
        if restart:
            self._start(self._flush)
        if last is not None:
            self._start_popper(last)

    def _start_popper(self, group: ReplyGroup) -> None:
        if not self._start(self._pop_replies, group):
            group.fail_waiting(streamer_closed())

    def _start(self, task: Callable[..., None], *args: Any) -> bool:
        """Run ``task`` in an I/O thread; False once the streamer is closed."""
        try:
            self._io.run(task, *args)
        except RuntimeError:  # shut down by close()
            return False
        return True

    def _take(self) -> list[Ticket]:
        """The pending calls in order, up to MAX_GROUP_ITEMS items; none (and no flusher) when
        none is left. Calls past their deadline are dropped."""
        # One pass under the lock, which every caller takes to queue its call (issue 26).
        with self._lock:
            taken, self._pending = take(self._pending, time.monotonic())
            if not taken:
                self._flushing = False
            return taken

    def _send(self, taken: list[Ticket]) -> ReplyGroup | None:
        """One ENQUEUE_CALLS for ``taken``; settles each call; the group of the accepted ones."""
        try:
            # Not retried: a retry after a read timeout would enqueue the items twice.
            with call_errors(self._url):
                args = self._calls.enqueue_calls_args([t.future.call for t in taken])
                admission = Admission.parse(run_script(self._redis, self._script, args["keys"], args["args"]))
        except BaseException as exc:  # every caller in the ENQUEUE must learn how it ended
            self._settle([(t, exc if n == 0 else copy_error(exc)) for n, t in enumerate(taken)])
            if not isinstance(exc, Exception):
                raise
            return None
        group, verdicts = admit(taken, admission, self._calls)
        self._settle(verdicts)
        cancelled = [ticket for ticket in taken if ticket.state is CallState.SENT and ticket.future.cancelled()]
        if cancelled:  # cancelled during the ENQUEUE
            self._start_withdrawal(cancelled)
        return group

    def _settle(self, outcomes: list[tuple[Ticket, BaseException | None]]) -> None:
        """Each call added (no error) or refused with its own error."""
        with self._lock:
            for ticket, refusal in outcomes:
                if refusal is None:
                    ticket.sent()
                else:
                    ticket.failed(refusal)

    # the poppers -----------------------------------------------------------------------------

    def _pop_replies(self, group: ReplyGroup) -> None:
        """Pop ``group``'s reply key until each of its calls is answered or past its deadline
        (see :func:`~rstreamer.client.groups.pop_replies`)."""
        run(pop_replies(group, self._serving, _blpop, self._calls), self._redis, self._errors)

    def _serving(self) -> bool:
        # Once the main thread has ended the interpreter is exiting: stop within one slice.
        return not self._closed and threading.main_thread().is_alive()


def _blpop(key: str, seconds: float) -> Command:
    """The popper's BLPOP, written straight on a connection (broker/direct.py)."""
    return Command(lambda client: direct_command(client, "BLPOP", key, seconds))
