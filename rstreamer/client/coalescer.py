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

import bisect
import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future as TaskFuture
from concurrent.futures import wait
from typing import TYPE_CHECKING, Any, cast

import redis

from ..batching.batcher import Outcome
from ..broker.connection import RedisClient, blpop_block, retry_pause
from ..broker.direct import direct_command, run_script
from ..broker.threads import DaemonThreads
from ..errors import BrokerUnavailable, DecodeError
from ..wire.cancel import cancel_args
from ..wire.messages import Admission
from ..wire.replies import decode_reply, undecodable
from ..wire.scripts import scripts
from .core import MAX_CONNECTIONS, WITHDRAW_GRACE, CallFactory, call_errors

if TYPE_CHECKING:
    from .future import RedisFuture

logger = logging.getLogger(__name__)

MAX_GROUP_ITEMS = 1024
"""Most items one coalesced ENQUEUE carries, so that one script never holds Redis for long."""


class CallState(enum.Enum):
    """Where a call stands in the coalescer."""

    PENDING = "pending"  # queued for the next ENQUEUE
    SENDING = "sending"  # in an ENQUEUE in flight
    SENT = "sent"  # enqueued: its group's popper delivers its answers
    FAILED = "failed"  # refused, or its ENQUEUE failed: the ticket's error says why
    DROPPED = "dropped"  # its deadline passed before it was sent


class Ticket:
    """One call's place in the coalescer; only the Coalescer changes it, under its lock."""

    __slots__ = ("future", "size", "expires_at", "state", "error", "offset", "token", "entries", "group", "_settled")

    def __init__(self, future: RedisFuture) -> None:
        self.future = future
        self.size = len(future.call.payloads)
        self.expires_at = future.call.expires_at  # the call's deadline on the monotonic clock
        self.state = CallState.PENDING
        self.error: BaseException | None = None
        self.offset = 0  # index of its first item in its group's reply
        self.token = ""  # the token its entries carry: its group's
        self.entries: list[tuple[bytes, int]] = []  # (entry id, index) of its items, once enqueued
        self.group: ReplyGroup | None = None
        self._settled = threading.Lock()
        self._settled.acquire()  # released once the ENQUEUE has decided

    def start_sending(self, offset: int) -> None:
        """PENDING -> SENDING: the call joins an ENQUEUE, its first item at ``offset`` of the reply."""
        self.state, self.offset = CallState.SENDING, offset

    def sent(self) -> None:
        """SENDING -> SENT: Redis accepted the call; its answers come on the group's reply key."""
        self.state = CallState.SENT
        self._settled.release()

    def failed(self, error: BaseException) -> None:
        """-> FAILED: the ENQUEUE was refused or failed; the caller gets ``error``."""
        self.state, self.error = CallState.FAILED, error
        self.future.fail(error)
        self._settled.release()

    def drop(self) -> None:
        """-> DROPPED: the call's deadline passed (or it was settled) before it was sent."""
        self.state = CallState.DROPPED
        self._settled.release()

    def wait_settled(self, until: float | None = None) -> None:
        """Park until the ENQUEUE has decided, or the call's deadline (or the monotonic time
        ``until``, if sooner)."""
        timeout = self.future.call.remaining()
        if until is not None:
            timeout = min(timeout, max(0.0, until - time.monotonic()))
        if self._settled.acquire(timeout=timeout):
            self._settled.release()  # settled for good: every later wait returns at once


class ReplyGroup:
    """The calls of one coalesced ENQUEUE: one reply key, whose answers go to each call by index.

    Only its popper thread uses it.
    """

    def __init__(self, reply_key: str, tickets: list[Ticket]) -> None:
        self.reply_key = reply_key
        self.tickets = tickets
        self.offsets = [ticket.offset for ticket in tickets]

    def until(self) -> float | None:
        """The latest deadline of the calls still waiting for answers; None when none is."""
        now = time.monotonic()
        waiting = [t.expires_at for t in self.tickets if not t.future.settled() and t.expires_at > now]
        return max(waiting, default=None)

    def deliver(self, data: bytes) -> None:
        """Dispatch one reply message; one that cannot be read at all fails every waiting call."""
        try:
            results = decode_reply(data)
        except DecodeError as exc:
            self.fail_waiting(undecodable(exc))
            return
        for index, outcome in results:
            self._dispatch(index, outcome)

    def _dispatch(self, index: int, outcome: Outcome[Any]) -> None:
        position = bisect.bisect_right(self.offsets, index) - 1
        if position >= 0:
            ticket = self.tickets[position]
            ticket.future.deliver(index - ticket.offset, outcome)

    def fail_waiting(self, error: BaseException) -> None:
        """Fail every call of the group that has no answer yet (each gets its own copy of ``error``)."""
        for ticket in self.tickets:
            ticket.future.fail(_copy_error(error))

    def answered(self) -> bool:
        """Whether every call of the group has all its answers."""
        return all(ticket.future.done() for ticket in self.tickets)

    def abandoned(self) -> bool:
        """True when no call of the group waits for an answer any more (all cancelled or
        answered): its replies may be dropped whole."""
        return all(ticket.future.cancelled() or ticket.future.done() for ticket in self.tickets)


class Coalescer:
    """Enqueues the calls of a RedisStreamer, coalescing concurrent ones, and pops their answers."""

    def __init__(self, client: RedisClient, url: str, calls: CallFactory) -> None:
        self._redis = client
        self._url = url
        self._calls = calls
        self._script = scripts(client).enqueue_calls
        self._cancel = scripts(client).cancel
        self._lock = threading.Lock()
        self._pending: list[Ticket] = []
        self._flushing = False
        self._closed = False
        # Daemon threads: a program that ends (Ctrl-C in predict) is never kept alive by them.
        self._io = DaemonThreads(MAX_CONNECTIONS, "rstreamer-io")
        self._withdrawals: set[TaskFuture[None]] = set()

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

    def _withdraw(self, tickets: list[Ticket], whole: bool) -> bool:
        """Run CANCEL for the unanswered items of ``tickets``; best effort: a worker that still
        runs an item answers a reply key that nobody reads and that expires. True when the group's
        reply key became a tombstone (withdrawn whole while a worker held an item): it must stay."""
        tombstoned = False
        for ticket in tickets:
            entries = [(entry_id, index) for entry_id, index in ticket.entries
                       if not ticket.future.answered(index - ticket.offset)]
            if not entries:
                continue
            group_whole = whole or (ticket.group is not None and ticket.group.abandoned())
            ttl = ticket.future.call.remaining()
            try:
                with call_errors(self._url):
                    reply = self._cancel(**cancel_args(self._calls.keys, ticket.token, ticket.future.call.priority,
                                                       entries, ttl, group_whole))
                ticket.future.held.update(int(index) - ticket.offset for index in reply[1:])
                tombstoned = tombstoned or (group_whole and len(reply) > 1)
            except Exception as exc:  # noqa: BLE001 - the call is over for its caller either way
                logger.warning("could not withdraw %d cancelled items: %s", len(entries), exc)
        return tombstoned

    def close(self) -> None:
        """Refuse new calls, let pending withdrawals finish (at most WITHDRAW_GRACE s) and stop the
        poppers (each within one BLPOP slice)."""
        with self._lock:
            self._closed = True
            for ticket in self._pending:
                ticket.failed(BrokerUnavailable("the streamer was closed"))
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
            group.fail_waiting(BrokerUnavailable("the streamer was closed"))

    def _start(self, task: Callable[..., None], *args: Any) -> bool:
        """Run ``task`` in an I/O thread; False once the streamer is closed."""
        try:
            self._io.submit(task, *args)
        except RuntimeError:  # shut down by close()
            return False
        return True

    def _take(self) -> list[Ticket]:
        """The pending calls in order, up to MAX_GROUP_ITEMS items; none (and no flusher) when
        none is left. Calls past their deadline are dropped."""
        # One pass under the lock, which every caller takes to queue its call (issue 26).
        taken: list[Ticket] = []
        left: list[Ticket] = []
        items = 0
        with self._lock:
            now = time.monotonic()
            for ticket in self._pending:
                if ticket.expires_at <= now:
                    ticket.drop()
                elif not left and (not taken or items + ticket.size <= MAX_GROUP_ITEMS):
                    ticket.start_sending(items)
                    taken.append(ticket)
                    items += ticket.size
                else:
                    left.append(ticket)  # the next ENQUEUE's, in order
            self._pending = left
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
            self._settle([(t, exc if n == 0 else _copy_error(exc)) for n, t in enumerate(taken)])
            if not isinstance(exc, Exception):
                raise
            return None
        accepted = [t for t, verdict in zip(taken, admission.verdicts, strict=True) if verdict.added]
        group = ReplyGroup(taken[0].future.call.reply_key, accepted) if accepted else None
        ids = iter(admission.ids)
        for ticket in accepted:
            ticket.token, ticket.group = taken[0].future.call.token, group
            ticket.entries = [(next(ids), ticket.offset + i) for i in range(ticket.size)]
        self._settle([(t, None if v.added else self._calls.refusal(v, t.future.call))
                      for t, v in zip(taken, admission.verdicts, strict=True)])
        cancelled = [ticket for ticket in accepted if ticket.future.cancelled()]
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
        """Pop ``group``'s reply key until each of its calls is answered or past its deadline."""
        failures = 0
        while self._serving() and (until := group.until()) is not None:
            block = blpop_block(until)
            if block is None:
                break
            try:
                with call_errors(self._url):
                    popped = direct_command(self._redis, "BLPOP", group.reply_key, block)
            except BrokerUnavailable as exc:  # retried within the deadline, then the calls fail
                failures += 1
                pause = retry_pause(failures, until)
                if pause is None:
                    group.fail_waiting(exc)
                    break
                time.sleep(pause)
                continue
            except Exception as exc:
                group.fail_waiting(exc)
                break
            failures = 0
            if popped:
                group.deliver(cast(bytes, popped[1]))  # our client does not decode replies
        if not group.answered():
            if self._serving():
                # Timed out or cancelled: nobody waits for the rest; withdraw what has not run.
                # (Not on close(): the calls of a closed streamer stay queued, as they always did.)
                if self._withdraw([t for t in group.tickets if not t.future.done()], True):
                    return  # the tombstone keeps a late answer out (and freed what came)
            self._delete(group.reply_key)

    def _serving(self) -> bool:
        # Once the main thread has ended the interpreter is exiting: stop within one slice.
        return not self._closed and threading.main_thread().is_alive()

    def _delete(self, reply_key: str) -> None:
        # A late answer re-creates the key with a TTL; deleting now frees what came so far.
        try:
            self._redis.delete(reply_key)
        except redis.RedisError:
            pass


def _copy_error(error: BaseException) -> BaseException:
    """The same error for another thread to raise (one instance raised in many threads tangles tracebacks)."""
    try:
        copy = type(error)(*error.args)
    except Exception:
        return error
    copy.__cause__ = error.__cause__
    return copy
